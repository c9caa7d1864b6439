"""Result figures (compare, collect, docs/img): labelled axes, data-scaled metric axes,
missing cells drawn as missing; the committed plots' numbers still match the docs, and the
Welch p values the docs quote follow from the per-seed numbers in their tables."""

import importlib.util
from pathlib import Path

from matplotlib.figure import Figure

from attnlab.recipes import figures

ROOT = Path(__file__).resolve().parents[1]


def _row(variant, values):
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return {"variant": variant, "metric": "f1", "task": "conll2003", "mean": mean, "std": std,
            "seeds": len(values), "values": values}


def test_seed_plot_axis_follows_the_data_and_names_task_model_unit():
    rows = [_row("baseline", [0.9061, 0.9095, 0.9080]), _row("jat", [0.9044, 0.9094, 0.9058])]
    fig = figures.seed_plot(rows, model="all-MiniLM-L6-v2")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    assert 0.85 < lo < 0.9044 and 0.9095 < hi < 0.95  # not forced to start at zero
    assert ax.get_xlabel() == "dev f1 (0-1)"
    assert ax.get_title() == "conll2003, all-MiniLM-L6-v2"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["jat (n=3)", "baseline (n=3)"]
    assert not ax.patches  # points, no bars


def test_matrix_plot_draws_a_missing_cell_as_missing_not_zero():
    cells = {("full", "cola"): _row("full@cola", [0.31, 0.36, 0.28]),
             ("pasta", "cola"): _row("pasta@cola", [0.12, 0.14, 0.03]),
             ("full", "rte"): _row("full@rte", [0.58, 0.60, 0.56]),
             ("pasta", "rte"): None}
    fig = figures.matrix_plot(cells, rows=["full", "pasta"],
                              tasks=[("cola", "CoLA", "mcc"), ("rte", "RTE", "accuracy")],
                              model="all-MiniLM-L6-v2")
    cola, rte = fig.axes[:2]
    assert rte.get_title() == "RTE, all-MiniLM-L6-v2"
    assert rte.get_xlabel() == "dev accuracy (fraction correct, 0-1)"
    assert "n/a (not run)" in [t.get_text() for t in rte.texts]
    assert [p.get_hatch() for p in rte.patches] == ["///"]
    drawn_x = [x for line in rte.lines for x in line.get_xdata()]
    assert drawn_x and min(drawn_x) > 0.5  # nothing plotted at zero for the missing cell
    assert rte.get_xlim()[0] > 0.4
    assert not cola.texts  # no missing cell there


def test_committed_plots_match_the_numbers_in_the_docs():
    spec = importlib.util.spec_from_file_location("make_plots",
                                                  ROOT / "docs" / "img" / "make_plots.py")
    make_plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_plots)
    for name in make_plots.PLOTS:
        assert (ROOT / "docs" / "img" / f"{name}.png").is_file(), name
        assert make_plots.check_numbers(name) == [], (
            f"{name}: its table changed; update docs/img/make_plots.py and redraw it")


def test_quoted_welch_p_values_follow_from_the_seeds_in_the_tables():
    spec = importlib.util.spec_from_file_location("pvalues", ROOT / "docs" / "pvalues.py")
    pvalues = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pvalues)
    lines = pvalues.check((ROOT / "docs" / "results.md").read_text(encoding="utf-8"))
    assert len(lines) == len(pvalues.QUOTED)
    assert all(line.startswith("ok") for line in lines), "\n".join(lines)
    # the check can fail: a quoted p that the seeds do not give is reported
    pvalues.QUOTED.append(("x", "y", 0.9, [0.3138, 0.3609, 0.2766], [0.5776, 0.5993, 0.5632]))
    assert pvalues.check((ROOT / "docs" / "results.md").read_text())[-1].startswith("MISMATCH")


def test_tuner_matrix_table_is_the_per_task_cells():
    spec = importlib.util.spec_from_file_location("make_plots",
                                                  ROOT / "docs" / "img" / "make_plots.py")
    make_plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_plots)
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert make_plots.matrix_cells_elsewhere(text) == []
    assert make_plots.matrix_markdown() in text  # the documented table is the printed one
    make_plots.MATRIX["PASTA"][0] = (0.1234, 0.0001)  # a cell no task table shows
    assert make_plots.matrix_cells_elsewhere(text) == ["0.1234 ± 0.0001"]
