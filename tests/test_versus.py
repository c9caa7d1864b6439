"""--versus: each row's gap to a reference row and Welch's p (compare and collect)."""

import json
import math

import pytest
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.config import ConfigError
from attnlab.recipes.compare import to_markdown
from attnlab.recipes.versus import add_versus, welch_p

runner = CliRunner()
TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "train.max_steps=2", "train.batch_size=4", "task.train_limit=16", "task.eval_limit=8"]


def _welch_by_hand(a, b):
    """Welch's t and Welch-Satterthwaite df written out, p from the t distribution."""
    from scipy.stats import t as student_t

    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1)
    sa, sb = va / len(a), vb / len(b)
    t = (ma - mb) / math.sqrt(sa + sb)
    df = (sa + sb) ** 2 / (sa ** 2 / (len(a) - 1) + sb ** 2 / (len(b) - 1))
    return 2 * student_t.sf(abs(t), df)


def test_welch_p_matches_the_formula():
    rte_baseline, rte_jat = [0.5776, 0.5993, 0.5632], [0.5740, 0.5884, 0.5668]
    assert welch_p(rte_jat, rte_baseline) == pytest.approx(_welch_by_hand(rte_jat, rte_baseline),
                                                           rel=1e-9)
    assert welch_p(rte_jat, rte_baseline) == pytest.approx(0.785, abs=1e-3)  # docs/results.md
    far = welch_p([1.0, 1.1, 0.9, 1.05], [0.0, 0.1, -0.1])
    assert far == pytest.approx(_welch_by_hand([1.0, 1.1, 0.9, 1.05], [0.0, 0.1, -0.1]))
    assert far < 1e-3
    assert welch_p([0.5], [0.4, 0.6]) is None  # one seed: no variance
    assert welch_p([0.5, 0.5], [0.5, 0.5]) is None  # no spread anywhere: t undefined
    assert welch_p([0.5, float("nan"), 0.6], [0.4, 0.6]) is not None  # NaN seeds dropped


def _row(label, values):
    return {"variant": label, "metric": "accuracy", "mean": sum(values) / len(values),
            "std": 0.0, "seeds": len(values), "values": values, "trainable_without_head": 1,
            "percent_of_backbone": 100.0, "sec_per_step": 1.0, "peak_rss_mb": 1.0}


def test_add_versus_rows_and_table():
    rows = add_versus([_row("baseline", [0.5776, 0.5993, 0.5632]),
                       _row("jat", [0.5740, 0.5884, 0.5668]), _row("one", [0.6])], "baseline")
    assert rows[0]["delta"] == 0.0 and rows[0]["p_welch"] is None
    assert rows[1]["delta"] == pytest.approx(0.5764 - 0.58, abs=1e-4)
    assert rows[2]["p_welch"] is None
    assert [r["is_reference"] for r in rows] == [True, False, False]
    md = to_markdown(rows).splitlines()
    assert md[0].endswith("| Δ vs baseline | p (Welch) |") and md[1].count("|") == 11
    assert md[2].endswith("| (reference) | - |")
    assert md[3].endswith("| -0.0036 | 0.78 |")
    assert md[4].endswith("| +0.0200 | - |")
    assert "| 0.5740, 0.5884, 0.5668 |" in md[3]  # the per-seed column
    # a row equal to the reference (same label in collect, same values) is not the reference
    twin = add_versus([_row("a", [0.5, 0.6]), _row("a", [0.5, 0.6])], "a")
    assert to_markdown(twin).splitlines()[3].endswith("| +0.0000 | 1 |")
    with pytest.raises(ConfigError, match="no such row; the rows are 'baseline', 'jat'"):
        add_versus(rows[:2], "base")


def test_compare_versus_checks_the_label_before_running(tmp_path):
    res = runner.invoke(app, ["compare", "name=v", f"output_dir={tmp_path}", *TINY, "--vary",
                              "plan=baseline,0-1:all:band(window=2)", "--seeds", "1",
                              "--versus", "nope"])
    assert res.exit_code == 2 and "no such row" in " ".join(res.output.split())
    assert not (tmp_path / "v").exists()  # nothing ran
    res = runner.invoke(app, ["compare", "name=v", f"output_dir={tmp_path}", *TINY, "--vary",
                              "plan=baseline,0-1:all:band(window=2)", "--seeds", "2",
                              "--versus", "baseline"])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "v" / "comparison.json").read_text())
    assert [r["versus"] for r in rows] == ["baseline", "baseline"]
    assert rows[1]["delta"] == pytest.approx(rows[1]["mean"] - rows[0]["mean"])
    assert "p (Welch)" in (tmp_path / "v" / "comparison.md").read_text()
    assert "p_welch" in (tmp_path / "v" / "comparison.csv").read_text().splitlines()[0]
    out = tmp_path / "c"
    res = runner.invoke(app, ["collect", str(tmp_path / "v"), "--out", str(out),
                              "--versus", "v/baseline", "--show", "optim.lr"])
    assert res.exit_code == 0, res.output
    header = (out / "comparison.md").read_text().splitlines()[0]
    assert header.endswith("| Δ vs v/baseline | p (Welch) | optim.lr |")
    res = runner.invoke(app, ["collect", "--matrix", f"a@t={tmp_path / 'v' / 'baseline'}",
                              "--out", str(out), "--versus", "a@t"])
    assert res.exit_code == 2 and "does not apply to --matrix" in " ".join(res.output.split())
