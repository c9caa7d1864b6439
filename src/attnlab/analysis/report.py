"""Outputs on disk: head-score tables (CSV/JSON), and the one-file HTML report.

The report is a single self-contained HTML file: figures are PNG data URIs, data is inline
JSON, the JS and CSS come from ``templates/`` and are inlined, and a Content-Security-Policy
forbids every fetch, so it opens offline from file:// or as a mail attachment and cannot leak
a request. It shows the run's config, plan and provenance, its training curves (loss per
logged step, dev metric per evaluation, from ``metrics.jsonl``), its metrics in three groups
(task metrics; cost: time per step, peak memory, parameters; attention statistics), layer x
head grids of the classes, of every score and of the plan's mechanisms (the heads the plan
replaced are marked in every grid and in the explorer), and a head explorer: choose an
example, a layer and a head, and see the attention map as a heatmap and as bertviz-style
token-to-token lines.

Run files are read in both of their forms: ``plan.json`` / summary ``"plan"`` as a JSON
string of ``{"plan": [...]}`` (runs before the provenance change) or as the list itself
(or ``{"plan": [...]}``); provenance keys (``attnlab_version``, ``git_commit``,
``versions``, ``device``, ``started``, ``finished``, ``wall_seconds``, ``status``) are
shown when the summary has them.

File size: each example stores L * H * n * n weights as integers in thousandths (3
decimals), about 3 bytes each; the defaults (4 examples, <= 48 tokens, 6 x 12 heads) keep a
report near 1-2 MB. Matplotlib is imported only when figures are drawn.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..io import atomic_write
from .heads import (
    HEAD_CLASSES,
    Maps,
    TokenInfo,
    batch_shape,
    class_counts,
    class_names,
    layer_list,
)
from .runfiles import (
    PROVENANCE_KEYS,
    attention_rows,
    flatten,
    label_of,
    mechanism_labels,
    metric_groups,
    plan_rules,
    replaced_heads,
    shown,
)

MAX_REPORT_WEIGHTS = 4_000_000  # inline weights above this make a report too heavy to open


# ----------------------------------------------------------------------------- files


# ----------------------------------------------------------------------------- tables


def _num(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def _table_shape(scores: Mapping[str, Tensor]) -> tuple[int, int]:
    shapes = {tuple(v.shape) for v in scores.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"scores must be [layers, heads] tables of one shape, got {shapes}")
    return next(iter(shapes))  # type: ignore[return-value]


def _score_lists(scores: Mapping[str, Tensor]) -> dict[str, list[list[float | None]]]:
    return {k: [[_num(float(x)) for x in row] for row in v.tolist()] for k, v in scores.items()}


def _check_class_table(classes: Sequence[Sequence[str]], shape: tuple[int, int]) -> None:
    if len(classes) != shape[0] or any(len(r) != shape[1] for r in classes):
        raise ValueError(f"classes must be a {shape[0]} x {shape[1]} table like the scores")
    class_names(classes)  # names the first unknown class


def to_json(
    path: str | os.PathLike[str],
    scores: Mapping[str, Tensor],
    classes: Sequence[Sequence[str]] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """``{"layers", "heads", "scores": {label: [[...]]}, "classes", "meta"}``; NaN -> null."""
    shape = _table_shape(scores)
    if classes is not None:
        _check_class_table(classes, shape)
    doc = {
        "layers": shape[0],
        "heads": shape[1],
        "scores": _score_lists(scores),
        "classes": [list(r) for r in classes] if classes is not None else None,
        "meta": dict(meta) if meta else {},
    }
    return atomic_write(path, json.dumps(doc, indent=1, default=str) + "\n")


def read_json(path: str | os.PathLike[str]) -> tuple[dict[str, Tensor], list[list[str]] | None]:
    """Inverse of :func:`to_json`: (scores, classes); null -> NaN."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    scores = {
        k: torch.tensor([[math.nan if x is None else x for x in row] for row in v],
                        dtype=torch.float64)
        for k, v in doc["scores"].items()
    }
    return scores, doc.get("classes")


def to_csv(
    path: str | os.PathLike[str],
    scores: Mapping[str, Tensor],
    classes: Sequence[Sequence[str]] | None = None,
) -> Path:
    """One row per head: layer, head, one column per score, then class; NaN -> empty."""
    L, H = _table_shape(scores)
    if classes is not None:
        _check_class_table(classes, (L, H))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["layer", "head", *scores, *(["class"] if classes is not None else [])])
    for l in range(L):
        for h in range(H):
            vals = [_num(float(v[l, h])) for v in scores.values()]
            row = [l, h, *("" if x is None else x for x in vals)]
            w.writerow(row + ([classes[l][h]] if classes is not None else []))
    return atomic_write(path, buf.getvalue())


# ----------------------------------------------------------------------------- metric groups

_GROUP_TITLES = {
    "task": ("Task metrics", "dev-set results of the run; model selection by the main metric"),
    "cost": ("Cost", "time per step, peak memory, parameters"),
    "attention": ("Attention statistics", "the head analysis below, in numbers"),
    "run": ("Run", ""),
}


def _metrics_html(groups: Mapping[str, Sequence[tuple[str, str]]]) -> str:
    if not any(groups.values()):
        return '<p class="empty">No metrics given.</p>'
    parts = []
    for key, (title, help_text) in _GROUP_TITLES.items():
        rows = groups.get(key) or []
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                       for k, v in rows) or '<tr><td class="empty">none recorded</td></tr>'
        helper = f'<p class="help">{html.escape(help_text)}</p>' if help_text else ""
        parts.append(f'<div class="metric-group" id="metrics-{key}"><h3>{title}</h3>{helper}'
                     f'<table class="metrics">{body}</table></div>')
    return f'<div class="metric-groups">{"".join(parts)}</div>'


def _provenance_html(prov: Mapping[str, Any]) -> str:
    if not prov:
        return ""
    rows = "".join(f"<tr><th>{html.escape(label_of(k, ''))}</th><td>{html.escape(shown(v))}"
                   "</td></tr>" for k, v in flatten(prov))
    return (f'<details open><summary>Provenance</summary><table class="metrics" '
            f'id="provenance">{rows}</table></details>')


# ----------------------------------------------------------------------------- training


def _training_html(history: Sequence[Mapping[str, Any]], *, task: str, model: str,
                   main_metric: str | None, loss_unit: str, greater_is_better: bool) -> str:
    if not history:
        return '<p class="empty">No training history (metrics.jsonl) given.</p>'
    from .plots import training_curves  # heavy: matplotlib, loaded when figures are drawn

    try:
        fig = training_curves(history, task=task, model=model, main_metric=main_metric,
                              loss_unit=loss_unit, greater_is_better=greater_is_better)
    except ValueError:
        return '<p class="empty">The training history has no loss and no eval records.</p>'
    n_loss = sum(1 for r in history if isinstance(r.get("loss"), (int, float)))
    evals = [r for r in history if isinstance(r.get("eval"), Mapping)]
    caption = (f"training curves: {n_loss} logged loss values, {len(evals)} evaluations "
               f"({task}, {model})")
    parts = [f'<figure class="static" id="training-curves"><img alt="training curves" '
             f'src="{_data_uri(fig)}"><figcaption>{html.escape(caption)}</figcaption></figure>']
    if evals:
        names = list(dict.fromkeys(k for r in evals for k in r["eval"]))
        head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
        body = "".join(
            f"<tr><td>{html.escape(str(r.get('step', '')))}</td>"
            f"<td>{html.escape(str(r.get('epoch', '')))}</td>"
            + "".join(f"<td>{html.escape(shown(r['eval'].get(n)))}</td>" for n in names)
            + "</tr>" for r in evals)
        parts.append(f'<details><summary>Evaluations ({len(evals)})</summary>'
                     f'<table class="metrics" id="evaluations"><tr><th>step</th><th>epoch</th>'
                     f'{head}</tr>{body}</table></details>')
    return "".join(parts)


def _history_data(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Compact curves for the inline JSON: loss [[step, value]], eval [[step, {...}]]."""
    loss = [[r["step"], _num(float(r["loss"]))] for r in history
            if isinstance(r.get("loss"), (int, float)) and "step" in r]
    evals = [[r["step"], {k: (_num(float(v)) if isinstance(v, (int, float)) else None)
                          for k, v in r["eval"].items()}]
             for r in history if isinstance(r.get("eval"), Mapping) and "step" in r]
    return {"loss": loss, "eval": evals}


# ----------------------------------------------------------------------------- the report


def _template(name: str) -> str:
    # one part per joinpath: Traversable.joinpath takes a single child before Python 3.11
    return resources.files("attnlab.analysis").joinpath("templates").joinpath(name).read_text(
        "utf-8")


def _script_json(obj: Any) -> str:
    """JSON safe inside <script>: no "</script>", "<!--" or "&" can end or bend the block."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _pretty(obj: Any) -> str:
    return html.escape(json.dumps(obj, indent=2, default=str, sort_keys=False))


def _data_uri(item: Any) -> str:
    """A matplotlib Figure, or a path to a .png/.svg file -> base64 data URI."""
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
        mime = {".png": "image/png", ".svg": "image/svg+xml"}.get(path.suffix.lower())
        if mime is None:
            raise ValueError(f"report figures must be .png or .svg files, got {path}")
        raw = path.read_bytes()
    else:
        from .plots import figure_bytes  # heavy: matplotlib, loaded when figures are drawn

        mime, raw = "image/png", figure_bytes(item, "png", dpi=100)
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def _figures_html(figures: Mapping[str, Any]) -> str:
    if not figures:
        return '<p class="empty">No figures.</p>'
    parts = [
        f'<figure class="static"><img alt="{html.escape(name)}" src="{_data_uri(fig)}">'
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, fig in figures.items()
    ]
    return "".join(parts)


def _example_data(ex: Mapping[str, Any], shape: tuple[int, int], max_tokens: int, k: int):
    tokens = [str(t) for t in ex["tokens"]]
    maps = torch.as_tensor(ex["maps"]).detach().float().cpu()
    L, H = shape
    if maps.dim() != 4 or tuple(maps.shape[:2]) != shape or maps.shape[2] != maps.shape[3]:
        raise ValueError(
            f"example {k}: maps must be [L, H, n, n] = [{L}, {H}, n, n] (cropped to the real "
            f"tokens), got {tuple(maps.shape)}"
        )
    n = maps.shape[-1]
    if len(tokens) != n:
        raise ValueError(f"example {k}: {len(tokens)} tokens for maps over {n} positions")
    shown = min(n, max_tokens)
    ints = (maps[:, :, :shown, :shown] * 1000).round().clamp(0, 1000).to(torch.int16)
    return {
        "tokens": tokens[:shown],
        "n": shown,
        "total": n,
        "maps": ints.flatten().tolist(),  # index ((layer * H + head) * n + query) * n + key
    }


def example_maps(
    maps: Maps, infos: Sequence[TokenInfo], limit: int | None = None
) -> list[dict[str, Any]]:
    """Per-example ``{"tokens", "maps": [L, h, n_i, n_i]}`` cropped to the real tokens: the
    ``examples`` argument of ``build_report`` (tokens are "0", "1", ... without strings)."""
    layers = layer_list(maps)
    batch_shape(layers)
    if any(x is None for x in layers):
        raise ValueError("example_maps needs maps for every layer; some layers are None")
    full = [x for x in layers if x is not None]  # every layer (checked above)
    out = []
    for i, info in enumerate(infos[:limit]):
        keep = info.keep.to(full[0].device)
        crop = [x[i].index_select(-2, keep).index_select(-1, keep) for x in full]
        toks = list(info.tokens) if info.tokens else [str(k) for k in range(info.length)]
        out.append({"tokens": toks, "maps": torch.stack(crop).detach().float().cpu()})
    return out


def build_report(
    out_path: str | os.PathLike[str],
    *,
    title: str,
    config: Mapping[str, Any] | None = None,
    plan: Any = None,
    metrics: Mapping[str, Any] | None = None,
    scores: Mapping[str, Tensor],
    classes: Sequence[Sequence[str]] | None = None,
    examples: Sequence[Mapping[str, Any]] = (),
    figures: Mapping[str, Any] | None = None,
    max_examples: int = 4,
    max_tokens: int = 48,
    surgery: Mapping[str, Any] | None = None,
    history: Sequence[Mapping[str, Any]] = (),
    provenance: Mapping[str, Any] | None = None,
    task: str | None = None,
    model: str | None = None,
    loss_unit: str = "cross-entropy, nats",
) -> Path:
    """Write one self-contained HTML report; returns its path.

    ``scores``: label -> [L, H]; ``classes``: L x H class names (or None);
    ``examples``: dicts ``{"tokens": [...], "maps": [L, H, n, n]}`` already cropped to the
    real tokens; the first ``max_examples`` are kept, each shown up to ``max_tokens`` tokens.
    ``figures``: extra name -> matplotlib Figure or .png/.svg path; the class map and the
    per-layer class counts are added when ``classes`` is given.
    ``plan`` (any saved form, see :func:`plan_rules`) and ``surgery`` (a SurgeryReport dict)
    mark the replaced heads; ``history``: the ``metrics.jsonl`` records, drawn as training
    curves whose axes name ``task`` and ``model`` (default: from ``metrics`` and ``config``)
    and the loss's ``loss_unit``. ``metrics`` (a run summary) is shown in groups;
    its provenance keys, or ``provenance``, go to the Run section.
    """
    if not scores:
        raise ValueError("build_report needs at least one score table (scores={...})")
    shape = _table_shape(scores)
    if classes is not None:
        _check_class_table(classes, shape)
    metrics = dict(metrics or {})
    prov = dict(provenance) if provenance is not None else {
        k: metrics[k] for k in PROVENANCE_KEYS if k in metrics}
    replaced = replaced_heads(shape, surgery=surgery, plan=plan)
    rules = plan_rules(plan)
    cfg = config if isinstance(config, Mapping) else {}
    task = task or str(metrics.get("task") or (cfg.get("task") or {}).get("name") or "task")
    model = model or str((cfg.get("model") or {}).get("name") or "model")
    kept = list(examples)[:max_examples]
    ex_data = [_example_data(ex, shape, max_tokens, k) for k, ex in enumerate(kept)]
    n_weights = sum(len(e["maps"]) for e in ex_data)
    if n_weights > MAX_REPORT_WEIGHTS:
        raise ValueError(
            f"the examples hold {n_weights:,} weights (> {MAX_REPORT_WEIGHTS:,}); "
            "lower max_examples or max_tokens to keep the report small enough to open"
        )
    all_figures: dict[str, Any] = {}
    if classes is not None:
        # heavy: matplotlib, loaded when figures are drawn
        from .plots import class_count_bars, class_map

        all_figures["head classes"] = class_map(classes, replaced=replaced if replaced and any(
            any(r) for r in replaced) else None)
        all_figures["classes per layer"] = class_count_bars(classes)
    all_figures.update(figures or {})
    data = {
        "title": title,
        "layers": shape[0],
        "heads": shape[1],
        "scale": 1000,
        "scores": _score_lists(scores),
        "classes": [list(r) for r in classes] if classes is not None else None,
        "classNames": class_names(classes) if classes is not None else list(HEAD_CLASSES),
        "classCounts": class_counts(classes) if classes is not None else None,
        "examples": ex_data,
        "replaced": replaced,
        "mechanisms": mechanism_labels(replaced) if replaced else {},
        "history": _history_data(history),
    }
    # heavy: matplotlib, loaded when figures are drawn
    from .plots import CLASS_ABBREV, CLASS_COLORS

    data["classColors"] = CLASS_COLORS
    data["classAbbrev"] = CLASS_ABBREV
    attention = attention_rows(scores, classes, replaced)
    if surgery and "surgery" not in metrics:  # the plan's parameter cost, under Cost
        metrics["surgery"] = {k: surgery[k] for k in ("params_added", "params_removed")
                              if k in surgery}
    shown_plan = rules if rules else plan  # a plan saved as a JSON string, shown as JSON
    values = {
        "TITLE": html.escape(title),
        "CSS": _template("report.css"),
        "JS": _template("report.js"),
        "CONFIG": _pretty(config) if config else "(no config given)",
        "PLAN": _pretty(shown_plan) if shown_plan else "(no plan: every head is softmax "
                                                        "attention)",
        "PROVENANCE": _provenance_html(prov),
        "TRAINING": _training_html(
            history, task=task, model=model, main_metric=metrics.get("main_metric"),
            loss_unit=loss_unit, greater_is_better=bool(metrics.get("greater_is_better", True))),
        "METRICS": _metrics_html(metric_groups(metrics, attention)),
        "FIGURES": _figures_html(all_figures),
        "DATA": _script_json(data),
    }
    page = re.sub(r"\{\{([A-Z]+)\}\}", lambda m: values[m.group(1)], _template("report.html"))
    return atomic_write(out_path, page)
