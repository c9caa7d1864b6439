"""``bench.plots.place_labels``: every label readable on a crowded chart."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from attnlab.bench.plots import place_labels  # noqa: E402


def _boxes(fig, anns):
    """The text of each annotation, without its leader line."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    return [Text.get_window_extent(a, renderer) for a in anns]


def _overlap(a, b) -> float:
    return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1)
                                                            - max(a.y0, b.y0))


def test_crowded_labels_overlap_neither_each_other_nor_points():
    """30 points, 20 of them in a small corner (as the fast, light mechanisms of a 4K cost
    chart): no two label boxes overlap, no label covers another point, all stay inside
    the axes. Labels at a fixed offset (what the chart did before) overlap here."""
    g = torch.Generator().manual_seed(0)
    xs = (torch.rand(30, generator=g) * 4 + 0.1).tolist()
    ys = (torch.rand(30, generator=g) * 4 + 0.1).tolist()
    for k in range(20):  # the crowded corner
        xs[k], ys[k] = 3.5 + 0.4 * k / 20, 1.0 + 0.3 * ((7 * k) % 20) / 20
    labels = [f"mechanism_{k}(window={k * 8})" for k in range(30)]
    fig, ax = plt.subplots(figsize=(9, 7))
    ax.scatter(xs, ys, s=25)
    naive = [ax.annotate(t, (x, y), xytext=(3, 2), textcoords="offset points", fontsize=6)
             for x, y, t in zip(xs, ys, labels, strict=True)]
    fig.canvas.draw()
    boxes = _boxes(fig, naive)
    assert any(_overlap(a, b) > 0 for i, a in enumerate(boxes) for b in boxes[i + 1:])
    for a in naive:
        a.remove()

    anns = place_labels(ax, xs, ys, labels)
    fig.canvas.draw()
    boxes = _boxes(fig, anns)
    assert [a.get_text() for a in anns] == labels
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert _overlap(a, b) == 0.0, (a, b)
    frame = ax.get_window_extent(fig.canvas.get_renderer())
    pts = ax.transData.transform(list(zip(xs, ys, strict=True)))
    dot = 3.0 * fig.dpi / 72.0
    for k, box in enumerate(boxes):
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 <= box.y1
        assert box.y1 <= frame.y1
        for j, (cx, cy) in enumerate(pts):
            if j != k:
                assert not (box.x0 < cx + dot and cx - dot < box.x1 and box.y0 < cy + dot
                            and cy - dot < box.y1), (labels[k], j)
    plt.close(fig)


def test_scaling_plot_draws_both_panels_and_skips_missing_points(tmp_path):
    from attnlab.bench.plots import env_title, scaling_plot
    from attnlab.bench.speed import environment

    rows = [
        {"n": 128, "form": "naive", "fwdbwd_ms": 5.0, "peak_mem_mb": 774.0},
        {"n": 128, "form": "efficient", "fwdbwd_ms": 8.0, "peak_mem_mb": 102.0},
        {"n": 512, "form": "naive", "fwdbwd_ms": None, "peak_mem_mb": None},  # skipped
        {"n": 512, "form": "efficient", "fwdbwd_ms": 62.0, "peak_mem_mb": 536.0},
    ]
    out = scaling_plot(rows, tmp_path / "sub" / "jat.png", title=env_title(environment()))
    assert out.is_file() and out.stat().st_size > 5000
    assert not list(out.parent.glob(".*tmp*"))  # written via a temporary file
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[1] == 1320  # 11 in x 120 dpi, two panels
