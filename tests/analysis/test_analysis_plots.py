"""Plots return figures (no pyplot state) and save_figure writes PNG + SVG."""

import pytest
import torch
from matplotlib.figure import Figure

from attnlab.analysis import plots

CLASSES = [
    ["vertical", "diagonal", "block"],
    ["heterogeneous", "vertical+diagonal", "vertical"],
]


def test_every_plot_returns_a_figure_and_saves(tmp_path):
    score = torch.rand(2, 3)
    score[1, 2] = float("nan")  # NaN cells are drawn grey, not an error
    other = [row[:] for row in CLASSES]
    other[0][0] = "heterogeneous"
    figs = {
        "heat": plots.score_heatmap(score, title="vertical", label="share"),
        "classes": plots.class_map(CLASSES, title="classes"),
        "counts": plots.class_count_bars(CLASSES),
        "attn": plots.attention_map(torch.rand(5, 5).softmax(-1), list("abcde")),
        "mean": plots.attention_map(torch.rand(4, 5, 5).softmax(-1), title="mean of 4"),
        "compare": plots.compare_class_maps(CLASSES, other, labels=("pretrained", "tuned")),
    }
    for name, fig in figs.items():
        assert isinstance(fig, Figure)
        png, svg = plots.save_figure(fig, tmp_path / "v1.2" / name)
        assert png.name == f"{name}.png" and svg.name == f"{name}.svg"  # suffix appended
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in svg.read_bytes()[:2000]
    assert "changed: 1 of 6 heads" in [t.get_text() for t in figs["compare"].axes[2].texts] + [
        figs["compare"].axes[2].get_title()
    ]
    # the class map letters every head, so it reads without colour
    letters = sorted(t.get_text() for t in figs["classes"].axes[0].texts)
    assert letters == sorted(["V", "D", "B", "H", "VD", "V"])


def test_pyplot_is_untouched():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plots.class_map(CLASSES)
    assert plt.get_fignums() == before


def test_bad_plot_inputs():
    fig = plots.class_map([["vertical", "n/a"]])  # a layer without maps
    assert "- n/a" in [t.get_text() for t in fig.legends[0].get_texts()]
    with pytest.raises(ValueError, match="unknown head class 'vertcal'"):
        plots.class_map([["vertcal"]])
    with pytest.raises(ValueError, match=r"\[n, n\] or \[k, n, n\]"):
        plots.attention_map(torch.rand(3, 4))
    with pytest.raises(ValueError, match="3 token labels for a map of 4"):
        plots.attention_map(torch.rand(4, 4), ["a", "b", "c"])
    with pytest.raises(ValueError, match="differ in shape"):
        plots.compare_class_maps(CLASSES, CLASSES[:1])


def test_class_map_hatches_the_replaced_heads():
    replaced = [[None, "band(window=2)", None], [None, None, None]]
    fig = plots.class_map(CLASSES, replaced=replaced)
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert [(p.get_x(), p.get_y()) for p in hatched] == [(0.5, -0.5)]  # layer 0, head 1
    assert "replaced by the plan" in [t.get_text() for t in fig.legends[0].get_texts()]
    with pytest.raises(ValueError, match="2 x 3 table"):
        plots.class_map(CLASSES, replaced=[[None]])
