"""`attnlab collect`: one table from several compare calls, recomputed from run summaries."""

import json

from typer.testing import CliRunner

from attnlab.cli import app

runner = CliRunner()
TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "train.max_steps=2", "train.batch_size=4", "task.train_limit=16", "task.eval_limit=8"]


def _compare(tmp_path, name, *extra):
    res = runner.invoke(app, ["compare", f"name={name}", f"output_dir={tmp_path}", *TINY,
                              *extra, "--seeds", "2"])
    assert res.exit_code == 0, res.output


def test_collect_rows_from_variant_and_compare_folders(tmp_path):
    _compare(tmp_path, "a", "optim.lr=1e-3", "--vary", "tuning.method=bitfit")
    _compare(tmp_path, "b", "optim.lr=1e-4", "--vary", "plan=baseline,0-1:all:band(window=2)")
    out = tmp_path / "all"
    res = runner.invoke(app, ["collect", f"bitfit={tmp_path / 'a' / 'bitfit'}",
                              str(tmp_path / "b"), "--show", "optim.lr", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "comparison.json").read_text())
    assert [r["variant"] for r in rows] == ["bitfit", "b/0-1_all_band_window=2_", "b/baseline"]
    assert [r["optim.lr"] for r in rows] == [1e-3, 1e-4, 1e-4]
    # the same numbers compare wrote for its own table
    own = {r["variant"]: r for r in json.loads((tmp_path / "b" / "comparison.json").read_text())}
    assert rows[2]["values"] == own["baseline"]["values"] and rows[2]["seeds"] == 2
    assert "| optim.lr |" in (out / "comparison.md").read_text()
    assert (out / "comparison.png").is_file()
    # compare's variant folders contain '=': with or without a label, the path is kept whole
    band = tmp_path / "b" / "0-1_all_band_window=2_"
    res = runner.invoke(app, ["collect", str(band), f"w=2={band}", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "comparison.json").read_text())
    assert [r["variant"] for r in rows] == ["b/0-1_all_band_window=2_", "w=2"]


def test_collect_errors_name_the_problem(tmp_path):
    res = runner.invoke(app, ["collect", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "no such folder" in " ".join(res.output.split())
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["collect", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "neither a variant folder" in " ".join(res.output.split())


def test_table_shows_spread_only_with_several_seeds():
    from attnlab.recipes.compare import to_markdown

    row = {"variant": "v", "metric": "mcc", "mean": 0.31, "std": 0.0, "seeds": 1,
           "trainable_without_head": 10, "percent_of_backbone": 1.0, "sec_per_step": 0.1,
           "peak_rss_mb": 5.0}
    assert "| 0.3100 |" in to_markdown([row]) and "±" not in to_markdown([row]).split("\n")[2]
    many = {**row, "seeds": 3, "std": 0.02}
    assert "| 0.3100 ± 0.0200 |" in to_markdown([many])
