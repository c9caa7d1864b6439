"""Figures of results over seeds: one comparison, a grid search, a data-size sweep, a
tuners x tasks matrix, for ``attnlab compare`` / ``attnlab collect`` and for the committed
plots in docs/img (``docs/img/make_plots.py`` redraws those from the docs' tables).

Every figure here follows the same rules (docs/decisions.md, "Result plots"):

- every metric axis names the task, the model and the unit (axis label, or the panel title
  for what the panel shares);
- a metric axis is scaled to the data and never forced to start at zero, so results are
  points (the mean as a diamond with a ± std bar, each seed as a dot), not bars, whose
  length is only honest from zero;
- a missing result is drawn as missing (a hatched band marked "n/a"), never as zero;
- labels are horizontal (variants on the y axis) and at least 9 pt, so the PNG reads at
  100% zoom.

Pure functions on ``matplotlib.figure.Figure`` with an Agg canvas (no pyplot state), like
``attnlab.analysis.plots``; save with ``analysis.plots.figure_bytes`` or ``fig.savefig``.
Rows are dicts as ``recipes.compare.summarise`` makes them: ``variant``, ``mean``, ``std``,
``seeds`` (how many are in the mean) and ``values`` (one per seed; None or NaN = missing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..analysis.plots import metric_unit

MEAN_COLOR = "#0072B2"
SEED_COLOR = "#333333"
SERIES_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
FONT = 10  # tick labels; axis labels and titles are larger


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # renders anywhere, never opens a window, no pyplot state
    return fig


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def metric_axis_label(metric: str, task: str | None = None, unit: str | None = None) -> str:
    """``dev MCC (Matthews corr., -1 to 1)``: the metric, then its unit."""
    return f"dev {metric} ({unit or metric_unit(metric.lower(), task)})"


def _where(task: str | None, model: str | None) -> str:
    return ", ".join(x for x in (task, model) if x)


def _legend_handles() -> list[Any]:
    return [
        Line2D([], [], color=MEAN_COLOR, marker="D", linestyle="-", markersize=6,
               label="mean ± std over seeds"),
        Line2D([], [], color=SEED_COLOR, marker="o", linestyle="none", markersize=4,
               label="one seed"),
    ]


def _missing(ax: Any, y: float, horizontal: bool = True) -> None:
    """A hatched band over one row (or column) of a panel, marked "n/a"."""
    if horizontal:
        ax.axhspan(y - 0.35, y + 0.35, facecolor="none", edgecolor="#999999", hatch="///",
                   linewidth=0)
        ax.text(0.5, y, "n/a (not run)", transform=ax.get_yaxis_transform(), ha="center",
                va="center", fontsize=FONT - 1, color="#555555",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    else:
        ax.axvspan(y - 0.35, y + 0.35, facecolor="none", edgecolor="#999999", hatch="///",
                   linewidth=0)


def _draw_row(ax: Any, y: float, row: Mapping[str, Any]) -> bool:
    """One variant at height ``y``: seeds as dots, mean ± std as a diamond with a bar.
    Returns False (and draws the missing band) when the row has no value."""
    values = [v for v in row.get("values") or [] if _finite(v)]
    mean = row.get("mean")
    if not _finite(mean):
        if not values:
            _missing(ax, y)
            return False
        mean = sum(values) / len(values)
    if values:
        ax.plot(values, [y] * len(values), "o", color=SEED_COLOR, markersize=4, zorder=3,
                alpha=0.8)
    std = row.get("std")
    seeds = row.get("seeds", len(values))
    if seeds and seeds > 1 and _finite(std):
        ax.errorbar([mean], [y], xerr=[std], fmt="D", color=MEAN_COLOR, markersize=6,
                    capsize=4, linewidth=1.4, zorder=2)
    else:
        ax.plot([mean], [y], "D", color=MEAN_COLOR, markersize=6, zorder=2)
    return True


def _variant_label(row: Mapping[str, Any]) -> str:
    seeds = row.get("seeds")
    return f"{row['variant']} (n={seeds})" if seeds is not None else str(row["variant"])


def seed_plot(
    rows: Sequence[Mapping[str, Any]],
    *,
    task: str | None = None,
    model: str | None = None,
    metric: str | None = None,
    unit: str | None = None,
    title: str | None = None,
) -> Figure:
    """One comparison: a row per variant (top to bottom in the given order), the dev metric
    on the x axis (scaled to the data), seeds as dots and the mean ± std as a diamond."""
    if not rows:
        raise ValueError("seed_plot needs at least one row")
    task = task or rows[0].get("task")
    model = model or rows[0].get("model")
    metric = metric or str(rows[0].get("metric", "metric"))
    n = len(rows)
    width = max(6.5, 0.075 * max(len(_variant_label(r)) for r in rows) + 5.0)
    fig = _figure(width, 0.42 * n + 2.1)
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        _draw_row(ax, n - 1 - i, r)
    ax.set_yticks(range(n), [_variant_label(r) for r in reversed(rows)], fontsize=FONT)
    ax.set_ylim(-0.6, n - 0.4)
    ax.tick_params(axis="x", labelsize=FONT)
    ax.set_xlabel(metric_axis_label(metric, task, unit), fontsize=FONT + 1)
    ax.margins(x=0.08)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or _where(task, model) or "", fontsize=FONT + 1)  # "" = no title
    fig.legend(handles=_legend_handles(), fontsize=FONT - 1, loc="outside lower center",
               ncols=2, frameon=False)
    return fig


def grid_plot(
    points: Sequence[Mapping[str, Any]],
    *,
    param: str,
    task: str,
    model: str,
    metric: str,
    unit: str | None = None,
    baseline: Mapping[str, Any] | None = None,
    chosen: float | None = None,
    title: str | None = None,
    xlabel: str | None = None,
) -> Figure:
    """A grid search: the dev metric against a numeric parameter (e.g. JAT's rho), one
    point per grid value (``{"x", "y", "group"}``; groups, e.g. the device, get their own
    marker colour), the baseline's mean ± std as a band with its seeds as dotted lines, and
    the chosen value starred."""
    fig = _figure(8.0, 4.0)
    ax = fig.add_subplot()
    if baseline is not None:
        m, s = baseline["mean"], baseline.get("std") or 0.0
        label = (f"{baseline.get('variant', 'baseline')}: mean ± std over "
                 f"{baseline.get('seeds')} seeds")
        ax.axhspan(m - s, m + s, color="#999999", alpha=0.25, linewidth=0, label=label)
        ax.axhline(m, color="#555555", linewidth=1.2)
        for k, v in enumerate(v for v in baseline.get("values") or [] if _finite(v)):
            ax.axhline(v, color="#555555", linewidth=0.8, linestyle=":",
                       label="baseline, one seed" if k == 0 else None)
    groups = list(dict.fromkeys(p.get("group") for p in points))
    xs_all = [p["x"] for p in points]
    ax.plot(xs_all, [p["y"] for p in points], color="#bbbbbb", linewidth=1.0, zorder=1)
    for gi, g in enumerate(groups):
        pts = [p for p in points if p.get("group") == g]
        ax.plot([p["x"] for p in pts], [p["y"] for p in pts], "o", markersize=6, zorder=3,
                color=SERIES_COLORS[gi % len(SERIES_COLORS)],
                label=f"{param} grid point, {g}" if g else f"{param} grid point")
    if chosen is not None:
        best = next(p for p in points if p["x"] == chosen)
        ax.plot([best["x"]], [best["y"]], "*", markersize=16, color="#D55E00",
                markeredgecolor="black", zorder=4, label=f"chosen: {xlabel or param} = {chosen:g}")
    ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all], fontsize=FONT)
    ax.tick_params(axis="y", labelsize=FONT)
    ax.set_xlabel(xlabel or param, fontsize=FONT + 1)
    ax.set_ylabel(metric_axis_label(metric, task, unit), fontsize=FONT + 1)
    ax.grid(alpha=0.3)
    ax.set_title(title or _where(task, model), fontsize=FONT + 1)
    ax.legend(fontsize=FONT - 1, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    return fig


def sweep_plot(
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    xlabel: str,
    task: str,
    model: str,
    metric: str,
    unit: str | None = None,
    title: str | None = None,
) -> Figure:
    """Several variants over one numeric setting (e.g. the share of training data): per
    variant a line through the means, ± std bars and the seeds as dots; variants are
    shifted apart a little on x so their seeds do not overlap."""
    fig = _figure(8.0, 4.2)
    ax = fig.add_subplot()
    xs_all = sorted({p["x"] for pts in series.values() for p in pts})
    step = min((b - a for a, b in zip(xs_all, xs_all[1:], strict=False)), default=1.0)
    k = len(series)
    for si, (name, pts) in enumerate(series.items()):
        color = SERIES_COLORS[si % len(SERIES_COLORS)]
        shift = (si - (k - 1) / 2) * 0.08 * step
        xs = [p["x"] + shift for p in pts]
        ax.errorbar(xs, [p["mean"] for p in pts], yerr=[p.get("std") or 0.0 for p in pts],
                    fmt="D-", color=color, markersize=6, capsize=4, linewidth=1.4,
                    label=f"{name}: mean ± std")
        for x, p in zip(xs, pts, strict=True):
            vals = [v for v in p.get("values") or [] if _finite(v)]
            ax.plot([x] * len(vals), vals, "o", color=color, markersize=4, alpha=0.6,
                    markeredgecolor="black", markeredgewidth=0.4, zorder=3)
    ax.plot([], [], "o", color="#999999", markeredgecolor="black", markeredgewidth=0.4,
            label="one seed")
    ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all], fontsize=FONT)
    ax.tick_params(axis="y", labelsize=FONT)
    ax.set_xlabel(xlabel, fontsize=FONT + 1)
    ax.set_ylabel(metric_axis_label(metric, task, unit), fontsize=FONT + 1)
    ax.grid(alpha=0.3)
    ax.set_title(title or _where(task, model), fontsize=FONT + 1)
    ax.legend(fontsize=FONT - 1, loc="best", framealpha=0.9)
    return fig


def matrix_plot(
    cells: Mapping[tuple[str, str], Mapping[str, Any] | None],
    *,
    rows: Sequence[str],
    tasks: Sequence[tuple[str, str, str]],
    model: str | None = None,
    ncols: int = 3,
    title: str | None = None,
) -> Figure:
    """Rows (e.g. tuners) x tasks: one panel per task, laid out ``ncols`` to a line, each a
    :func:`seed_plot`-style panel with its own metric axis (tasks' metrics differ; one shared
    axis would mislead). ``tasks``: (key, title, metric) per task; ``cells[(row, key)]``: a
    result row, or missing / None, drawn as a hatched "n/a" band."""
    n = len(rows)
    ncols = max(1, min(ncols, len(tasks)))
    nlines = math.ceil(len(tasks) / ncols)
    label_w = 0.075 * max(len(r) for r in rows) + 0.3
    fig = _figure(ncols * (3.3 + label_w), nlines * (0.34 * n + 1.7) + 0.6)
    axes = fig.subplots(nlines, ncols, squeeze=False)
    for k, (key, name, metric) in enumerate(tasks):
        ax = axes[k // ncols][k % ncols]
        for i, r in enumerate(rows):
            cell = cells.get((r, key))
            if cell is None:
                _missing(ax, n - 1 - i)
            else:
                _draw_row(ax, n - 1 - i, cell)
        ax.set_yticks(range(n), list(reversed(rows)), fontsize=FONT)
        ax.set_ylim(-0.6, n - 0.4)
        ax.tick_params(axis="x", labelsize=FONT - 1)
        ax.set_xlabel(metric_axis_label(metric, key), fontsize=FONT)
        ax.set_title(_where(name, model), fontsize=FONT + 1)
        ax.margins(x=0.08)
        ax.grid(axis="x", alpha=0.3)
    for k in range(len(tasks), nlines * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    with_seeds = any(_finite(v) for c in cells.values() if c for v in c.get("values") or [])
    handles = [*_legend_handles()[: 2 if with_seeds else 1],
               Patch(facecolor="none", edgecolor="#999999", hatch="///", label="n/a: not run")]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=FONT,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=FONT + 2)
    return fig
