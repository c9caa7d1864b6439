"""``attnlab analyze importance``: head importance and head ablation of a model, top to bottom.

1. load the model: a finished run (rebuilt with its plan, tuner and weights) or a saved model
   folder with its task head (``recipes.analyze.load_model``);
2. encode the task's dev split with its labels (the run's task, data and maximum length by
   default, as ``attnlab analyze heads`` reads them);
3. Michel et al. (2019)'s gradient importance of every head,
   ``I_h = E_x |dL(x)/dxi_h|``, normalised per layer by the l2 norm unless
   ``normalize=False`` (:func:`attnlab.analysis.importance.head_importance`);
4. ablation (optional, 1 + L*H + classes evaluations of the dev split): the task's main
   metric with each head masked and with every head of each class masked, through the
   evaluator ``attnlab run`` uses (:func:`attnlab.analysis.importance.ablate`);
5. the head classes: read from ``--analysis`` (a ``head_scores.json``), or computed now on
   the same examples by ``analyze_model``; with them, the table "importance by head class";
6. write ``importance.json`` / ``.csv`` / ``.md`` and the layer x head heat maps
   ``importance.png/svg`` and ``ablation.png/svg``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..analysis.importance import (
    Ablation,
    HeadImportance,
    ablate,
    by_class,
    by_class_markdown,
    class_masks,
    head_importance,
)
from ..analysis.plots import save_figure, score_heatmap
from ..hf.arch import inspect_model
from ..io import atomic_write
from ..tasks import get_task
from .analyze import LoadedModel, Progress, TextSource, analyze_model
from .evaluation import make_evaluator
from .head_select import read_head_table
from .rundir import is_tlm_run

TOP = 10  # heads listed in the Markdown summary


@dataclass
class ImportanceResult:
    """What :func:`run_importance` measured; written by :func:`write_importance`."""

    importance: HeadImportance
    ablation: Ablation | None  # None: not asked for
    classes: list[list[str]] | None  # [L][H] head classes (None: the analysis had none)
    by_class: list[dict[str, Any]]  # rows of analysis.importance.by_class
    meta: dict[str, Any] = field(default_factory=dict)


def _check_head(model: torch.nn.Module, task: Any, name: str) -> None:
    """A sequence classifier must have the task's label count (else the loss is wrong)."""
    if task.head != "sequence-classification":
        return
    have = getattr(getattr(model, "config", None), "num_labels", None)
    want = max(task.num_labels, 1)
    if have is not None and "ForSequenceClassification" in type(model).__name__ \
            and have != want:
        raise ValueError(f"{name} has a classifier of {have} labels but task {task.name!r} has "
                         f"{want}; give the task the model was fine-tuned on (--task)")


def run_importance(
    loaded: LoadedModel,
    source: TextSource,
    *,
    batch_size: int = 32,
    normalize: bool = True,
    ablation: bool = True,
    analysis: str | None = None,
    metric: str | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> ImportanceResult:
    """Importance, ablation and the by-class table of ``loaded`` on ``source``'s task split
    (see the module doc). ``analysis``: a head_scores.json (or its folder) for the classes;
    None analyses the model now on the same examples. ``metric``: the ablation's metric, one
    the task computes (default: its main metric)."""
    if loaded.run_dir is not None and is_tlm_run(loaded.run_dir):
        raise ValueError(f"{loaded.name} is a TLM run, whose task head is not a Hugging Face "
                         "one that head importance can mask and score; `attnlab analyze heads "
                         f"{loaded.source}` analyses its encoder")
    if source.text_file is not None:
        raise ValueError("head importance needs labelled examples: give a task (--task), not "
                         "--text-file")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if source.limit is not None and source.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {source.limit}")
    task = get_task(source.task)
    split = source.split or task.eval_splits[0]
    examples = task.load(split, source.resolved_data_dir())[: source.limit]
    if not examples:
        raise ValueError(f"no examples in {source.describe()}")
    max_length = 128 if source.max_length is None else source.max_length
    features = task.encode(examples, loaded.tokenizer, max_length)
    _check_head(loaded.model, task, loaded.name)
    host = inspect_model(loaded.model)
    start = time.perf_counter()

    collate = task.collator(loaded.tokenizer, seed=seed)
    batches = [collate(features[i : i + batch_size]) for i in range(0, len(features), batch_size)]
    imp = head_importance(loaded.model, batches, normalize=normalize, progress=progress)

    if analysis is not None:
        table = read_head_table(analysis)
        if table.shape != (host.num_layers, host.num_heads):
            raise ValueError(f"the head analysis {table.source} has {table.shape[0]} layers x "
                             f"{table.shape[1]} heads but {loaded.name} has {host.num_layers} x "
                             f"{host.num_heads}; analyse this model, or leave out --analysis")
        classes, classes_from = table.classes, table.source
    else:
        heads = analyze_model(loaded, source, batch_size=batch_size, n_examples=0,
                              progress=progress)
        classes, classes_from = heads.analysis.classes, f"{source.describe()} (computed now)"

    abl = None
    if ablation:
        evaluate = make_evaluator(task, {split: (examples, features)}, loaded.tokenizer, seed,
                                  batch_size)
        main = metric in (None, task.main_metric)
        abl = ablate(loaded.model, evaluate, metric or task.main_metric,
                     greater_is_better=task.greater_is_better if main else None,
                     groups=class_masks(classes) if classes is not None else None,
                     progress=progress)
    meta = {
        "model": loaded.source,
        "model_name": loaded.name,
        "text": source.describe(),
        "task": task.name,
        "split": split,
        "max_length": max_length,
        "batch_size": batch_size,
        "layers": host.num_layers,
        "heads": host.num_heads,
        "examples": imp.n_examples,
        "normalized": normalize,
        "classes_from": classes_from,
        "seconds": round(time.perf_counter() - start, 2),
    }
    rows = by_class(classes, imp, abl) if classes is not None else []
    return ImportanceResult(imp, abl, classes, rows, meta)


# ----------------------------------------------------------------------------- writing


def _num(x: float) -> float | None:
    """8 significant digits (raw importances can be ~1e-9); NaN -> None (JSON null)."""
    return None if math.isnan(x) else float(f"{x:.8g}")


def _table(t: torch.Tensor) -> list[list[float | None]]:
    return [[_num(float(x)) for x in row] for row in t.tolist()]


def importance_doc(result: ImportanceResult) -> dict[str, Any]:
    """The ``importance.json`` document (NaN -> null)."""
    imp, abl = result.importance, result.ablation
    doc: dict[str, Any] = {
        "layers": int(imp.raw.shape[0]),
        "heads": int(imp.raw.shape[1]),
        "importance": _table(imp.importance),
        "importance_raw": _table(imp.raw),
        "normalized": imp.normalized,
        "classes": result.classes,
        "ablation": None,
        "by_class": [{k: _num(v) if isinstance(v, float) else v for k, v in r.items()}
                     for r in result.by_class],
        "meta": result.meta,
    }
    if abl is not None:
        delta = abl.delta
        doc["ablation"] = {
            "metric": abl.metric,
            "greater_is_better": abl.greater_is_better,
            "baseline": _num(abl.baseline),
            "heads": _table(abl.heads) if abl.heads is not None else None,
            "delta": _table(delta) if delta is not None else None,
            "classes": {n: {"heads": abl.group_sizes[n], "metric": _num(v),
                            "delta": _num(abl.group_delta(n))} for n, v in abl.groups.items()},
        }
    return doc


def _csv(result: ImportanceResult) -> str:
    imp, abl = result.importance, result.ablation
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    metric = abl.metric if abl is not None else None
    w.writerow(["layer", "head", "importance", "importance_raw",
                *([f"masked_{metric}", "delta"] if abl is not None else []),
                *(["class"] if result.classes is not None else [])])
    for l in range(imp.raw.shape[0]):
        for h in range(imp.raw.shape[1]):
            row: list[Any] = [l, h, _num(float(imp.importance[l, h])),
                              _num(float(imp.raw[l, h]))]
            if abl is not None and abl.heads is not None:
                row += [_num(float(abl.heads[l, h])), _num(float(abl.heads[l, h] - abl.baseline))]
            if result.classes is not None:
                row.append(result.classes[l][h])
            w.writerow(row)
    return buf.getvalue()


def _markdown(result: ImportanceResult) -> str:
    imp, abl, m = result.importance, result.ablation, result.meta
    norm = "normalised per layer (l2)" if imp.normalized else "raw"
    lines = [f"# Head importance: {m['model_name']}", "",
             f"{m['examples']} examples of {m['text']}; importance E_x|dL/dxi_h| "
             f"(Michel et al. 2019), {norm}; classes from {m['classes_from']}."]
    if abl is not None:
        lines.append(f"Ablation: {abl.metric} with every head {abl.baseline:.4f}; delta = "
                     "metric with the head(s) masked minus that.")
    if result.by_class:
        lines += ["", "## Importance by head class", "",
                  by_class_markdown(result.by_class, abl.metric if abl else None).rstrip()]
    order = torch.argsort(imp.importance.flatten(), descending=True)[:TOP].tolist()
    H = imp.raw.shape[1]
    lines += ["", f"## The {len(order)} most important heads", "",
              "| layer | head | importance | class | delta, masked |", "|---:|---:|---:|---|---:|"]
    for k in order:
        l, h = divmod(k, H)
        cls = result.classes[l][h] if result.classes is not None else "n/a"
        delta = (f"{float(abl.heads[l, h] - abl.baseline):+.4f}"
                 if abl is not None and abl.heads is not None else "n/a")
        lines.append(f"| {l} | {h} | {float(imp.importance[l, h]):.4f} | {cls} | {delta} |")
    return "\n".join(lines) + "\n"


def write_importance(result: ImportanceResult, out: Path) -> list[Path]:
    """``importance.json/.csv/.md`` and the heat maps into ``out``; returns the paths."""
    imp, abl, name = result.importance, result.ablation, result.meta.get("model_name", "model")
    written = [
        atomic_write(out / "importance.json",
                     json.dumps(importance_doc(result), indent=1, allow_nan=False) + "\n"),
        atomic_write(out / "importance.csv", _csv(result)),
        atomic_write(out / "importance.md", _markdown(result)),
    ]
    label = "importance / layer l2 norm" if imp.normalized else "E|dL/dxi|"
    fig = score_heatmap(imp.importance, title=f"head importance: {name}", vmin=0.0,
                        label=label)
    written += save_figure(fig, out / "importance")
    if abl is not None and abl.delta is not None:
        bound = max(float(abl.delta.abs().max()), 1e-6)
        fig = score_heatmap(abl.delta, title=f"head masked: {name}", cmap="RdBu",
                            vmin=-bound, vmax=bound, fmt="+.2f",
                            label=f"{abl.metric} change from {abl.baseline:.3f}")
        written += save_figure(fig, out / "ablation")
    return written
