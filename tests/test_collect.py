"""`attnlab collect`: one table from several compare calls, recomputed from run summaries."""

import json

import pytest
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.recipes.summary import RunSummary

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
    assert [r["variant"] for r in rows] == ["bitfit", "b/0-1_all_band_window=2", "b/baseline"]
    assert [r["optim.lr"] for r in rows] == [1e-3, 1e-4, 1e-4]
    # the same numbers compare wrote for its own table
    own = {r["variant"]: r for r in json.loads((tmp_path / "b" / "comparison.json").read_text())}
    assert rows[2]["values"] == own["baseline"]["values"] and rows[2]["seeds"] == 2
    assert "| optim.lr |" in (out / "comparison.md").read_text()
    assert (out / "comparison.png").is_file()
    # compare's variant folders contain '=': with or without a label, the path is kept whole
    band = tmp_path / "b" / "0-1_all_band_window=2"
    res = runner.invoke(app, ["collect", str(band), f"w=2={band}", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "comparison.json").read_text())
    assert [r["variant"] for r in rows] == ["b/0-1_all_band_window=2", "w=2"]
    # a label twice would put one folder's numbers in two rows
    res = runner.invoke(app, ["collect", f"x={band}", f"x={band}", "--out", str(out)])
    assert res.exit_code == 2 and "x given more than once" in " ".join(res.output.split())
    (tmp_path / "a-file").write_text("")
    res = runner.invoke(app, ["collect", str(band), "--out", str(tmp_path / "a-file" / "o")])
    assert res.exit_code == 2 and "is a file, not a folder" in " ".join(res.output.split())


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


def test_collect_matrix_rows_by_tasks(tmp_path):
    """--matrix: ROW@TASK labels, a metric per task (MCC for CoLA, F1 for MRPC)."""
    _compare(tmp_path, "cola", "optim.lr=1e-3", "--vary", "tuning.method=bitfit,pasta")
    # a second "task" with another metric: the same runs re-labelled (tests have no offline
    # pair-task data), reporting accuracy instead of MCC
    for m in ("bitfit", "pasta"):
        for seed in (0, 1):
            src = tmp_path / "cola" / m / f"seed-{seed}"
            dst = tmp_path / "cola2" / m / f"seed-{seed}"
            dst.mkdir(parents=True)
            summary = json.loads((src / "summary.json").read_text())
            summary["main_metric"] = "accuracy"
            summary["best_metric"] = summary["best_eval"]["accuracy"]
            (dst / "summary.json").write_text(json.dumps(summary))
            (dst / "config.yaml").write_text((src / "config.yaml").read_text())
    out = tmp_path / "m"
    items = [f"{m}@{t}={tmp_path / t / m}" for m in ("bitfit", "pasta") for t in ("cola", "cola2")]
    res = runner.invoke(app, ["collect", "--matrix", *items[:3], "--out", str(out)])
    assert res.exit_code == 0, res.output
    md = (out / "matrix.md").read_text().splitlines()
    assert md[0] == "| | cola (mcc) | cola2 (accuracy) | trained params (% backbone) |"
    rows = {r["variant"]: r for r in json.loads((out / "comparison.json").read_text())}
    bitfit = rows["bitfit@cola"]
    want = f"{bitfit['mean']:.4f} ± {bitfit['std']:.4f}"
    assert md[2].startswith(f"| bitfit | {want} |")
    assert md[3].startswith("| pasta | ") and " | - | " in md[3]  # a missing cell
    assert f"{rows['pasta@cola']['percent_of_backbone']:.3f}%" in md[3]
    assert (out / "matrix.png").is_file() and not (out / "comparison.png").exists()
    # without --matrix two metrics are refused; with it, labels must be ROW@TASK
    res = runner.invoke(app, ["collect", *items, "--out", str(out)])
    assert res.exit_code == 2 and "--matrix" in " ".join(res.output.split())
    res = runner.invoke(app, ["collect", "--matrix", str(tmp_path / "cola" / "pasta"),
                              "--out", str(out)])
    assert res.exit_code == 2 and "ROW@COLUMN=PATH" in " ".join(res.output.split())
    res = runner.invoke(app, ["collect", "--matrix", items[0], items[0], "--out", str(out)])
    assert res.exit_code == 2 and "bitfit@cola given more than once" in " ".join(
        res.output.split())


def test_diff_prune_rows_show_what_they_kept():
    """Diff-Prune trains every entry and keeps 0.5%: both counts in the table and matrix."""
    from attnlab.recipes.collect import to_matrix_markdown
    from attnlab.recipes.compare import summarise, to_markdown

    def summary(trainable, effective, metric=0.3):
        params = {"trainable_without_head": trainable, "percent_of_backbone":
                  100.0 * trainable / 22_713_216, "trainable_total": trainable + 770,
                  "backbone_total": 22_713_216}
        if effective is not None:
            params["effective_without_head"] = effective
        return RunSummary.from_dict({"main_metric": "mcc", "best_metric": metric,
                                     "params": params, "seconds_per_step": 1.0,
                                     "peak_rss_mb": 1.0})

    dp = summarise("diff_prune@cola", [summary(22_713_216, 113_567)] * 2)
    lora = summarise("lora@cola", [summary(73_728, None)] * 2)  # older summaries: no key
    assert dp["effective_without_head"] == 113_567
    assert dp["percent_effective"] == pytest.approx(100 * 113_567 / 22_713_216)
    md = to_markdown([dp, lora])
    assert "| 22,713,216 (100.000%); kept 113,567 (0.500%) |" in md
    assert "| 73,728 (0.325%) |" in md
    matrix = to_matrix_markdown([dp, lora])
    assert "| 100.000%, kept 0.500% |" in matrix and "| 0.325% |" in matrix
    # a share that is not a round float stays one share (no "kept" for non-pruning tuners)
    prefix = summarise("prefix@cola", [summary(92_160, 92_160)] * 2)
    assert "kept" not in to_matrix_markdown([prefix]) and "kept" not in to_markdown([prefix])


def _summary(metric):
    return RunSummary.from_dict({
        "main_metric": "spearmanr", "best_metric": metric, "seconds_per_step": 0.5,
        "peak_rss_mb": 100.0, "params": {"trainable_total": 10, "trainable_without_head": 8,
                                         "percent_of_backbone": 1.0}})


def test_seeds_without_a_metric_are_left_out_and_said_so():
    """A NaN (constant-prediction Spearman) or missing best metric is not in the mean, the
    seeds column says how many are, and the per-seed column marks the gap."""
    from attnlab.recipes.compare import mean_std, summarise, to_markdown

    assert mean_std([0.4, float("nan"), 0.44, None]) == pytest.approx((0.42, 0.0008 ** 0.5))
    row = summarise("v", [_summary(0.4), _summary(float("nan")), _summary(0.44)])
    assert (row["seeds"], row["seeds_run"]) == (2, 3)
    line = to_markdown([row]).splitlines()[2]
    assert "| 0.4200 ± 0.0283 | 0.4000, -, 0.4400 | 2 of 3 |" in line


def test_collect_reads_seeds_in_numeric_order(tmp_path):
    from attnlab.recipes.collect import _seeds

    for k in (0, 1, 2, 10, 11):
        (tmp_path / f"seed-{k}").mkdir()
        (tmp_path / f"seed-{k}" / "summary.json").write_text("{}")
    assert [p.parent.name for p in _seeds(tmp_path)] == [
        "seed-0", "seed-1", "seed-2", "seed-10", "seed-11"]


def test_collect_warns_about_seeds_it_leaves_out(tmp_path):
    """A seed folder without summary.json (running, or cut) or with an interrupted summary is
    left out of the row, and collect says which."""
    from attnlab.recipes.collect import _row

    cut = {**_summary(0.5).to_dict(), "interrupted": True}
    for k, summary in ((0, _summary(0.4).to_dict()), (1, None), (2, cut)):
        (tmp_path / f"seed-{k}").mkdir()
        if summary is not None:
            (tmp_path / f"seed-{k}" / "summary.json").write_text(json.dumps(summary))
    with pytest.warns(UserWarning, match="seed-1, seed-2 left out"):
        row = _row("v", tmp_path, [])
    assert row["seeds"] == 1
