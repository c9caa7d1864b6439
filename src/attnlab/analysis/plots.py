"""Figures for head analysis: pure functions returning matplotlib figures.

Why pure functions on ``matplotlib.figure.Figure`` with an Agg canvas rather than pyplot:
nothing touches pyplot's global figure list (no leaks over a long CLI run, no display, no
``plt.show``), and the caller decides where a figure goes (:func:`save_figure`, the report).
Inputs are tensors, numpy arrays or nested lists; layers are rows (layer 0 at the top) and
heads are columns, as in the papers' figures.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from ..io import atomic_write
from .heads import HEAD_CLASSES, NO_CLASS, class_counts, class_names

# One colour per class (colour-blind-safe Okabe-Ito hues; heterogeneous in neutral grey).
CLASS_COLORS: dict[str, str] = {
    "vertical": "#0072B2",
    "diagonal": "#E69F00",
    "vertical+diagonal": "#CC79A7",
    "block": "#009E73",
    "heterogeneous": "#D9D9D9",
    NO_CLASS: "#FFFFFF",
}
# Short cell labels so the class map reads without colour too.
CLASS_ABBREV: dict[str, str] = {
    "vertical": "V",
    "diagonal": "D",
    "vertical+diagonal": "VD",
    "block": "B",
    "heterogeneous": "H",
    NO_CLASS: "-",
}
ALL_CLASSES: tuple[str, ...] = (*HEAD_CLASSES, NO_CLASS)


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # Agg canvas: renders anywhere, never opens a window
    return fig


def _grid_axes(ax: Any, n_layers: int, n_heads: int) -> None:
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(labelsize=7)


def _check_classes(classes: Sequence[Sequence[str]]) -> np.ndarray:
    """Class names -> indices into ALL_CLASSES [L, H]; names the first unknown class."""
    class_names(classes)  # validates
    idx = {c: i for i, c in enumerate(ALL_CLASSES)}
    return np.array([[idx[c] for c in row] for row in classes], dtype=np.int64)


def score_heatmap(
    score: Any,
    *,
    title: str | None = None,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool = True,
    fmt: str = ".2f",
    label: str | None = None,
) -> Figure:
    """Layer x head heatmap of one score [L, H], each cell annotated; NaN cells grey."""
    s = _np(score)
    if s.ndim != 2:
        raise ValueError(f"score must be a [layers, heads] table, got shape {s.shape}")
    L, H = s.shape
    fig = _figure(0.5 * H + 2.2, 0.42 * L + 1.4)
    ax = fig.add_subplot()
    cm = colormaps[cmap].with_extremes(bad="#bbbbbb")
    im = ax.imshow(np.ma.masked_invalid(s), cmap=cm, vmin=vmin, vmax=vmax, aspect="auto")
    fig.colorbar(im, ax=ax, label=label or "", shrink=0.9)
    _grid_axes(ax, L, H)
    if annotate:
        for (l, h), v in np.ndenumerate(s):
            if np.isnan(v):
                ax.text(h, l, "n/a", ha="center", va="center", fontsize=5)
                continue
            r, g, b_, _ = cm(im.norm(v))
            dark = 0.299 * r + 0.587 * g + 0.114 * b_ < 0.5  # luminance of the cell colour
            ax.text(h, l, format(v, fmt), ha="center", va="center", fontsize=6,
                    color="white" if dark else "black")
    if title:
        ax.set_title(title)
    return fig


def _draw_classes(ax: Any, idx: np.ndarray, *, letters: bool = True) -> None:
    cm = ListedColormap([CLASS_COLORS[c] for c in ALL_CLASSES])
    ax.imshow(idx, cmap=cm, vmin=-0.5, vmax=len(ALL_CLASSES) - 0.5, aspect="auto")
    if letters:
        for (l, h), k in np.ndenumerate(idx):
            ax.text(h, l, CLASS_ABBREV[ALL_CLASSES[k]], ha="center", va="center", fontsize=6)
    _grid_axes(ax, *idx.shape)


def _class_legend(fig: Figure, loc: Literal["outside right upper", "outside lower center"],
                  names: Sequence[str],
                  extra: Sequence[Patch] = ()) -> None:
    handles = [
        Patch(facecolor=CLASS_COLORS[c], edgecolor="black", label=f"{CLASS_ABBREV[c]} {c}")
        for c in names
    ] + list(extra)
    ncols = len(handles) if loc.endswith("center") else 1
    fig.legend(handles=handles, loc=loc, ncols=ncols, fontsize=7)


def class_map(
    classes: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    replaced: Sequence[Sequence[str | None]] | None = None,
) -> Figure:
    """Grid of heads coloured (and lettered) by class, with a legend.

    ``replaced``: an L x H table, the mechanism a plan put into each head (None where the
    head kept softmax attention); those heads are hatched and outlined."""
    idx = _check_classes(classes)
    L, H = idx.shape
    fig = _figure(0.45 * H + 3.4, 0.4 * L + 1.4)
    ax = fig.add_subplot()
    _draw_classes(ax, idx)
    extra = []
    if replaced is not None:
        if len(replaced) != L or any(len(r) != H for r in replaced):
            raise ValueError(f"replaced must be a {L} x {H} table like the classes")
        for (l, h), _ in np.ndenumerate(idx):
            if replaced[l][h]:
                ax.add_patch(Rectangle((h - 0.5, l - 0.5), 1, 1, fill=False, hatch="///",
                                       edgecolor="black", linewidth=1.2))
        extra = [Patch(facecolor="white", edgecolor="black", hatch="///",
                       label="replaced by the plan")]
    _class_legend(fig, "outside right upper", class_names(classes), extra)
    if title:
        ax.set_title(title)
    return fig


def class_count_bars(classes: Sequence[Sequence[str]], *, title: str | None = None) -> Figure:
    """Per-layer class counts as stacked bars (one bar per layer, one colour per class)."""
    _check_classes(classes)
    counts = class_counts(classes)
    L = len(classes)
    fig = _figure(max(4.0, 0.5 * L + 2.5), 3.4)
    ax = fig.add_subplot()
    bottom = np.zeros(L)
    for c, per_layer in counts.items():
        vals = np.asarray(per_layer, dtype=np.float64)
        ax.bar(range(L), vals, bottom=bottom, color=CLASS_COLORS[c], edgecolor="black",
               linewidth=0.4, label=c)
        bottom += vals
    ax.set_xticks(range(L))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("heads")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    return fig


def class_share_comparison(a: Sequence[Sequence[str]], b: Sequence[Sequence[str]], *,
                           labels: tuple[str, str], title: str | None = None) -> Figure:
    """Two models of any shapes: for each head class, the share of each layer's heads in
    that class against relative depth (layer / (layers - 1); 0 = first, 1 = last), one line
    per model. How TLM compared task-driven and pretrained models (vertical vs
    heterogeneous heads by depth)."""
    _check_classes(a)
    _check_classes(b)
    names = [c for c in ALL_CLASSES if any(c in row for m in (a, b) for row in m)]
    fig = _figure(3.0 * len(names) + 1.0, 3.2)
    axes = fig.subplots(1, len(names), sharey=True, squeeze=False)[0]
    for ax, c in zip(axes, names, strict=True):
        for classes, label, style, color in ((a, labels[0], "o-", "black"),
                                             (b, labels[1], "s--", "tab:orange")):
            depth = np.linspace(0.0, 1.0, len(classes)) if len(classes) > 1 else np.zeros(1)
            share = [sum(x == c for x in row) / len(row) for row in classes]
            ax.plot(depth, share, style, color=color, label=label)
        ax.set_title(c, fontsize=9)
        ax.set_xlabel("relative depth (0 first layer, 1 last)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("share of the layer's heads")
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def attention_map(
    attn: Any,
    tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    cmap: str = "Blues",
    vmax: float | None = None,
) -> Figure:
    """Heatmap of one head's attention map [n, n], or the average of a stack [k, n, n] of
    same-length examples (maps of different lengths cannot be averaged position-wise).
    Rows are queries, columns keys."""
    a = _np(attn)
    if a.ndim == 3:
        a = a.mean(0)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"attention map must be [n, n] or [k, n, n], got shape {a.shape}")
    n = a.shape[0]
    if tokens is not None and len(tokens) != n:
        raise ValueError(f"{len(tokens)} token labels for a map of {n} tokens")
    side = min(12.0, max(3.5, 0.18 * n + 2.0))
    fig = _figure(side + 0.8, side)
    ax = fig.add_subplot()
    im = ax.imshow(a, cmap=cmap, vmin=0.0, vmax=vmax, aspect="equal")
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    if tokens is not None:
        size = 7 if n <= 40 else 5
        ax.set_xticks(range(n), labels=list(tokens), rotation=90, fontsize=size)
        ax.set_yticks(range(n), labels=list(tokens), fontsize=size)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    return fig


def compare_class_maps(
    a: Sequence[Sequence[str]],
    b: Sequence[Sequence[str]],
    *,
    labels: tuple[str, str] = ("A", "B"),
    title: str | None = None,
) -> Figure:
    """A, B and their difference side by side; changed heads outlined in red.

    The third panel shows B's class where it differs from A and blank where equal, so the
    eye lands on what changed (e.g. vertical heads of the pretrained model turning
    heterogeneous after task training, the TLM observation).
    """
    ia, ib = _check_classes(a), _check_classes(b)
    if ia.shape != ib.shape:
        raise ValueError(f"class maps differ in shape: {ia.shape} vs {ib.shape}")
    L, H = ia.shape
    changed = ia != ib
    fig = _figure(3 * (0.42 * H + 1.0) + 0.5, 0.4 * L + 2.0)
    axes = fig.subplots(1, 3, sharey=True)
    _draw_classes(axes[0], ia)
    _draw_classes(axes[1], ib)
    _draw_classes(axes[2], ib, letters=False)
    axes[2].imshow(np.where(changed, np.nan, 1.0), cmap=ListedColormap(["white"]),
                   aspect="auto")  # white over unchanged heads
    for (l, h), c in np.ndenumerate(changed):
        if c:
            for ax in axes[1:]:
                ax.add_patch(Rectangle((h - 0.5, l - 0.5), 1, 1, fill=False, edgecolor="red",
                                       linewidth=1.4))
            axes[2].text(h, l, f"{CLASS_ABBREV[ALL_CLASSES[ia[l, h]]]}>"
                         f"{CLASS_ABBREV[ALL_CLASSES[ib[l, h]]]}", ha="center", va="center",
                         fontsize=5)
    axes[0].set_title(labels[0])
    axes[1].set_title(labels[1])
    axes[2].set_title(f"changed: {int(changed.sum())} of {L * H} heads")
    for ax in axes[1:]:
        ax.set_ylabel("")
    _class_legend(fig, "outside lower center", class_names([*a, *b]))
    if title:
        fig.suptitle(title)
    return fig


# ----------------------------------------------------------------------------- training

# What a dev metric's number means, for axis labels (the task runners' conventions: SQuAD
# reports percentages, every other score is a fraction or a correlation).
METRIC_UNITS: dict[str, str] = {
    "mcc": "Matthews corr., -1 to 1",
    "accuracy": "fraction correct, 0-1",
    "f1": "0-1",
    "combined_score": "mean of F1 and accuracy, 0-1",
    "pearson": "linear corr., -1 to 1",
    "spearman": "rank corr., -1 to 1",
    "precision": "0-1",
    "recall": "0-1",
    "perplexity": "exp(nats per masked token)",
    "loss": "nats per masked token",
    "exact_match": "%",
}


def metric_unit(metric: str, task: str | None = None) -> str:
    """The unit of a dev metric (``"dev/f1"`` and ``"PER_f1"`` count as ``f1``)."""
    base = metric.rsplit("/", 1)[-1]
    if task == "squad" and (base == "f1" or base.endswith(("_f1", "_exact"))):
        return "%"
    for short in (base, base.rsplit("_", 1)[-1], base.split()[-1] if base.split() else base):
        if short in METRIC_UNITS:  # "PER_f1", "entity f1" -> f1
            return METRIC_UNITS[short]
    return "score"


def _history_points(history: Sequence[Any]) -> tuple[list[tuple[int, float]],
                                                     dict[str, list[tuple[int, float]]],
                                                     list[tuple[int, int]]]:
    """metrics.jsonl records -> (loss points, {metric: eval points}, (step, epoch) pairs)."""
    loss: list[tuple[int, float]] = []
    evals: dict[str, list[tuple[int, float]]] = {}
    epochs: list[tuple[int, int]] = []
    for rec in history:
        step = rec.get("step")
        if not isinstance(step, (int, float)):
            continue
        if isinstance(rec.get("epoch"), (int, float)):
            epochs.append((int(step), int(rec["epoch"])))
        if isinstance(rec.get("loss"), (int, float)):
            loss.append((int(step), float(rec["loss"])))
        for k, v in (rec.get("eval") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                evals.setdefault(k, []).append((int(step), float(v)))
    return loss, evals, epochs


def training_curves(
    history: Sequence[Any],
    *,
    task: str,
    model: str,
    main_metric: str | None = None,
    loss_unit: str = "cross-entropy, nats",
    greater_is_better: bool = True,
) -> Figure:
    """Training loss per logged step and the dev metric per evaluation, side by side.

    ``history``: the run's ``metrics.jsonl`` records, ``{"step", "epoch", "loss", "lr"}``
    and ``{"step", "epoch", "eval": {metric: value}}``. The dev panel shows ``main_metric``
    (default: the first metric of the first evaluation) and marks its best evaluation.
    Each y axis names the task, the model and the unit, and is scaled to the data (never
    forced to start at zero). The loss is the logged step's own batch loss (plus any
    regulariser the run adds), so it is noisy by nature.
    """
    loss, evals, _ = _history_points(history)
    if not loss and not evals:
        raise ValueError("training_curves: the history has no loss and no eval records")
    if main_metric is None or main_metric not in evals:
        main_metric = next(iter(evals), None)
    panels = int(bool(loss)) + int(main_metric is not None)
    fig = _figure(5.2 * panels + 0.4, 3.6)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    where = f"{task}, {model}"
    k = 0
    if loss:
        ax = axes[k]
        k += 1
        xs, ys = zip(*loss, strict=True)
        ax.plot(xs, ys, color="#0072B2", linewidth=1.0, marker="." if len(xs) <= 60 else None)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"training loss ({loss_unit})")
        ax.set_title(f"training loss: {where}", fontsize=10)
        ax.grid(alpha=0.3)
    if main_metric is not None:
        ax = axes[k]
        pts = evals[main_metric]
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, color="#D55E00", marker="o", markersize=4, linewidth=1.2)
        best = (max if greater_is_better else min)(range(len(ys)), key=ys.__getitem__)
        ax.plot([xs[best]], [ys[best]], marker="*", markersize=12, color="#D55E00",
                markeredgecolor="black", linestyle="none",
                label=f"best {ys[best]:.4f} at step {xs[best]}")
        ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"dev {main_metric} ({metric_unit(main_metric, task)})")
        ax.set_title(f"dev {main_metric} per evaluation: {where}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def figure_bytes(fig: Figure, fmt: str, *, dpi: int = 110) -> bytes:
    """PNG or SVG bytes without the date/software stamps (files stay byte-reproducible)."""
    buf = io.BytesIO()
    meta = {"Software": None} if fmt == "png" else {"Date": None, "Creator": None}
    fig.savefig(buf, format=fmt, dpi=dpi, metadata=meta)
    return buf.getvalue()


def save_figure(fig: Figure, path_without_ext: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``<path>.png`` and ``<path>.svg`` (each atomically); returns both paths.

    The suffixes are appended, never substituted, so ``runs/v1.2/heads`` stays intact.
    """
    base = str(path_without_ext)
    png = atomic_write(base + ".png", figure_bytes(fig, "png"))
    svg = atomic_write(base + ".svg", figure_bytes(fig, "svg"))
    return png, svg
