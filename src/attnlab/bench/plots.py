"""Scaling curves of a benchmark's rows: time and peak memory against length, log-log.

One line per method (``bench sparse``: "sdpa", "band(window=128)", ...; ``bench jat``:
"naive", "efficient"); points a method skipped (None) are left out, so a line stops where a
method no longer fits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io import atomic_path


def scaling_plot(rows: list[dict[str, Any]], path: str | Path, title: str = "",
                 subject: str | None = None) -> Path:
    """Write a two-panel PNG (fwd+bwd time, peak memory vs n) for benchmark ``rows``.

    ``subject`` names what was measured (the workload and its shape, e.g. "one JAT layer,
    6 heads x 64, batch 8"); each panel's title carries it, so each axis is labelled with
    what ran and its unit. Default: from the rows' kind (``bench jat``: "form" rows, or
    ``bench sparse``: "method" rows)."""
    # heavy: matplotlib, imported on use (bench.speed, which the benchmark's child
    # processes import, imports this module)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "method" if "method" in rows[0] else "form"
    if subject is None:
        subject = ("one JAT layer: official n^3 form vs efficient" if key == "form"
                   else "one attention layer: dense SDPA vs sparse pattern")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("fwdbwd_ms", "forward + backward time (ms, log scale)", "time"),
              ("peak_mem_mb", "peak memory (MB, log scale)", "peak memory"))
    for ax, (field, label, what) in zip(axes, panels, strict=True):
        ax.set_title(f"{what}: {subject}", fontsize=9)
        for name in dict.fromkeys(r[key] for r in rows):
            pts = [(r["n"], r[field]) for r in rows
                   if r[key] == name and r.get(field) is not None and r[field] > 0]
            skipped = [r["n"] for r in rows if r[key] == name and r.get(field) is None]
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                gone = f" (not run at n = {', '.join(map(str, skipped))})" if skipped else ""
                ax.plot(xs, ys, "o-", label=name + gone)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n (tokens, log scale)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return write_png(fig, path)


# Offsets (points) tried for a label, nearest first: 8 directions on growing rings.
_RINGS = (4.0, 11.0, 20.0, 32.0, 46.0, 62.0)
_DIRECTIONS = ((1, 0.3), (1, -1), (-1, 0.3), (-1, -1), (0, 1), (0, -1.6), (1, 1), (-1, 1))


def place_labels(ax: Any, xs: list[float], ys: list[float], labels: list[str],
                 fontsize: float = 6.0) -> list[Any]:
    """Label each point (data coordinates) where its text overlaps no other label, no other
    point and stays inside the axes: candidate offsets on rings of growing radius, nearest
    first, the first free one kept (greedy, the most crowded points first); a label moved
    off its first ring gets a thin leader line. Where nothing is free, the candidate with
    the least overlap. Returns the annotations. Call it after the axes' limits and scales
    are final (the placement is in display space)."""
    fig = ax.figure
    fig.canvas.draw()  # limits, scales and the renderer the text extents need
    renderer = fig.canvas.get_renderer()
    pts = ax.transData.transform(list(zip(xs, ys, strict=True)))  # [N, 2] display px
    px = fig.dpi / 72.0  # display pixels per point
    dot = 3.0 * px  # half the side of the box kept free around every point
    frame = ax.get_window_extent(renderer)
    placed: list[tuple[float, float, float, float]] = []  # label boxes (x0, y0, x1, y1)

    def overlap(box: tuple[float, float, float, float], own: int) -> float:
        x0, y0, x1, y1 = box
        area = 0.0
        for a0, b0, a1, b1 in placed:
            area += max(0.0, min(x1, a1) - max(x0, a0)) * max(0.0, min(y1, b1) - max(y0, b0))
        for k, (cx, cy) in enumerate(pts):
            if k != own:
                area += (max(0.0, min(x1, cx + dot) - max(x0, cx - dot))
                         * max(0.0, min(y1, cy + dot) - max(y0, cy - dot)))
        outside = ((x1 - x0) * (y1 - y0) - max(0.0, min(x1, frame.x1) - max(x0, frame.x0))
                   * max(0.0, min(y1, frame.y1) - max(y0, frame.y0)))
        return area + outside

    # the most crowded points first (sum of inverse distances to the others)
    dist = ((pts[:, None, :] - pts[None, :, :]) ** 2).sum(-1) ** 0.5 + 1.0
    order = sorted(range(len(labels)), key=lambda k: -float((1.0 / dist[k]).sum()))
    out: list[Any] = [None] * len(labels)
    for k in order:
        probe = ax.annotate(labels[k], (xs[k], ys[k]), xytext=(0, 0), va="center",
                            textcoords="offset points", fontsize=fontsize)
        best: tuple[float, tuple[float, float], tuple[float, float, float, float], str] | None
        best = None
        for ring in _RINGS:
            for dx, dy in _DIRECTIONS:
                align = "right" if dx < 0 else "center" if dx == 0 else "left"
                probe.set_position((dx * ring, dy * ring))
                probe.set_horizontalalignment(align)
                ext = probe.get_window_extent(renderer)
                box = (ext.x0, ext.y0, ext.x1, ext.y1)
                cost = overlap(box, k)
                if best is None or cost < best[0]:
                    best = (cost, (dx * ring, dy * ring), box, align)
                if cost == 0.0:
                    break
            if best is not None and best[0] == 0.0:
                break
        probe.remove()
        assert best is not None
        _, offset, box, align = best
        far = max(abs(offset[0]), abs(offset[1])) > 1.7 * _RINGS[0]  # off the first ring
        leader = {"arrowstyle": "-", "lw": 0.4, "color": "0.5", "shrinkA": 0, "shrinkB": 2}
        out[k] = ax.annotate(labels[k], (xs[k], ys[k]), xytext=offset, fontsize=fontsize,
                             textcoords="offset points", ha=align, va="center",
                             arrowprops=leader if far else None)
        placed.append(box)
    return out


def write_png(fig: Any, path: str | Path) -> Path:
    """Save ``fig`` atomically at 120 dpi (the format from ``path``'s suffix) and close it."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:  # the temporary name keeps the suffix savefig reads
            fig.savefig(tmp, dpi=120)
    finally:
        import matplotlib.pyplot as plt  # imported on use, as above: CLI start-up

        plt.close(fig)
    return path


def env_title(env: dict[str, Any]) -> str:
    """A one-line plot title from ``bench.speed.environment()``."""
    where = env.get("gpu") or f"{env.get('cpu')} CPU, {env.get('threads')} thread(s)"
    return f"{where}; torch {env.get('torch')}; {env.get('date')}"
