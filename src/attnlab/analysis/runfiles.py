"""A run folder as the report reads it: the ``metrics.jsonl`` history, the plan in each of
its saved forms, the heads the plan replaced, and the summary split into metric groups.

Kept apart from :mod:`attnlab.analysis.report` (which writes the HTML) so that the rules
for old and new run files live in one place: ``plan.json`` / summary ``"plan"`` is a JSON
string of ``{"plan": [...]}`` in runs made before provenance was added, and the list itself
(or ``{"plan": [...]}``) after; summaries may carry provenance keys (``PROVENANCE_KEYS``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from ..io import read_jsonl
from .heads import class_counts

SOFTMAX = "softmax"  # the mechanism of a head no plan rule touched (hf.plan.SOFTMAX)


def read_history(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (``{"step", "epoch", "loss", "lr"}`` and
    ``{"step", "epoch", "eval": {...}}``); blank or torn lines (a run killed mid-write) are
    skipped; a missing file gives ``[]``."""
    return read_jsonl(path)


def plan_rules(plan: Any) -> list[Any] | None:
    """A plan as saved by any attnlab version -> its list of rules (``[]``: no plan).

    Accepts the list itself, ``{"plan": [...]}``, and either of those as a JSON string
    (``plan.json`` and summary ``"plan"`` before provenance was added held
    ``json.dumps(Plan.to_json())``, a string inside the JSON). Returns None for anything
    else (shown as given, no heads marked)."""
    for _ in range(3):  # a string may hold a string may hold the object
        if not isinstance(plan, str):
            break
        text = plan.strip()
        if not text:
            return []
        try:
            plan = json.loads(text)
        except json.JSONDecodeError:
            return [text]  # compact "LAYERS:HEADS:SPEC" rules joined with ";"
    if plan is None:
        return []
    if isinstance(plan, Mapping) and set(plan) == {"plan"}:
        plan = plan["plan"]
    if isinstance(plan, Mapping) and {"mechanism"} <= set(plan):
        return [dict(plan)]
    if isinstance(plan, (list, tuple)):
        return list(plan)
    return None


def replaced_heads(
    shape: tuple[int, int], *, surgery: Mapping[str, Any] | None = None, plan: Any = None
) -> list[list[str | None]] | None:
    """L x H table: the mechanism spec a plan put into each head, None where softmax stayed.

    From the run's SurgeryReport (summary ``"surgery"``: its ``table``) when it has the
    shape, else by resolving the plan's rules for this shape. None when neither tells
    (no plan, or a plan that no longer parses)."""
    L, H = shape
    table = (surgery or {}).get("table")
    if (isinstance(table, list) and len(table) == L
            and all(isinstance(r, list) and len(r) == H for r in table)):
        return [[None if spec == SOFTMAX else str(spec) for spec in row] for row in table]
    rules = plan_rules(plan)
    if not rules:
        return [[None] * H for _ in range(L)] if rules == [] and plan is not None else None
    # heavy: attnlab.hf loads transformers; the analysis package loads torch only
    from ..hf.plan import Plan, PlanError

    try:
        resolved = Plan.parse(rules).resolve(L, H)
    except (PlanError, ValueError, TypeError, KeyError):
        return None
    return [[None if resolved[l][h].name == SOFTMAX else resolved[l][h].spec()
             for h in range(H)] for l in range(L)]


def mechanism_labels(replaced: Sequence[Sequence[str | None]]) -> dict[str, str]:
    """spec -> short label (the name, or ``name#2`` where names repeat), in first-seen order."""
    specs = list(dict.fromkeys(s for row in replaced for s in row if s))
    names = [s.split("(", 1)[0] for s in specs]
    return {s: n if names.count(n) == 1 else f"{n}#{names[:i + 1].count(n)}"
            for i, (s, n) in enumerate(zip(specs, names, strict=True))}


# ----------------------------------------------------------------------------- metric groups

PROVENANCE_KEYS = ("status", "error", "attnlab_version", "git_commit", "versions", "device",
                   "started", "finished", "wall_seconds")
_RUN_KEYS = ("name", "task", "seed", "tuning", "interrupted", "num_processes")
# Keys only some tuners fill (Diff-Prune); left out where the run has no value.
_OPTIONAL_KEYS = ("before_finalize", "pruned_eval", "masked_steps")
_COST_PREFIXES = ("params", "seconds_per_step", "train_seconds", "steps", "masked_steps",
                  "train_examples", "peak_", "memory", "time_", "tokens_per")
# Row labels with their units; a key not listed is shown as its dotted path.
_LABELS = {
    "seconds_per_step": "time per optimizer step (s)",
    "train_seconds": "training time, evaluations excluded (s)",
    "steps": "optimizer steps",
    "masked_steps": "optimizer steps of the fixed-mask phase",
    "train_examples": "training examples",
    "peak_rss_mb": "peak memory, process RSS (MB)",
    "peak_gpu_mb": "peak GPU memory (MB)",
    "params.trainable_total": "trainable parameters, with the task head",
    "params.trainable_without_head": "trainable parameters, without the head",
    "params.backbone_total": "backbone parameters",
    "params.percent_of_backbone": "trained share of the backbone (%)",
    "params.effective_without_head": "parameters changed at the end, without the head",
    "params.backbone_name": "backbone",
    "params.tuner": "tuner",
    "surgery.params_added": "parameters added by the plan",
    "surgery.params_removed": "parameters removed by the plan",
    "analysis.source": "head analysis computed from",
    "degenerate": "warning",
    "best_metric": "best dev {main}",
    "best_step": "best evaluation at step",
    "main_metric": "main metric (model selection)",
    "greater_is_better": "higher is better",
    "wall_seconds": "wall time (s)",
    "git_commit": "git commit",
    "attnlab_version": "attnlab version",
}
_PREFIX_LABELS = {
    "best_eval.": "dev at the best evaluation: ",
    "final_eval.": "dev at the last evaluation: ",
    "pruned_eval.": "dev right after pruning: ",
    "before_finalize.": "before finalising: ",
    "versions.": "version of ",
}


def label_of(key: str, main: str) -> str:
    if key in _LABELS:
        return _LABELS[key].format(main=main)
    for prefix, text in _PREFIX_LABELS.items():
        if key.startswith(prefix):
            return text + key[len(prefix):]
    return key


def shown(val: Any) -> str:
    if val is None:
        return "n/a"
    if isinstance(val, bool):
        return "yes" if val else "no"
    if isinstance(val, int):
        return f"{val:,}"
    if isinstance(val, float):
        return "n/a" if math.isnan(val) else f"{val:.4g}"
    if isinstance(val, str):
        return val
    return json.dumps(val, default=str)


def attention_rows(
    scores: Mapping[str, Tensor],
    classes: Sequence[Sequence[str]] | None,
    replaced: Sequence[Sequence[str | None]] | None,
) -> list[tuple[str, str]]:
    """Summary numbers of the head analysis: replaced heads, class counts, score ranges."""
    L, H = next(iter(scores.values())).shape
    rows: list[tuple[str, str]] = []
    if replaced is not None:
        count: dict[str, int] = {}
        for row in replaced:
            for spec in row:
                if spec:
                    count[spec] = count.get(spec, 0) + 1
        detail = "; ".join(f"{spec}: {n}" for spec, n in count.items())
        total = sum(count.values())
        rows.append(("heads replaced by the plan",
                     f"{total} of {L * H}" + (f" ({detail})" if detail else "")))
    if classes is not None:
        for name, per_layer in class_counts(classes).items():
            rows.append((f"heads classed {name}", f"{sum(per_layer)} of {L * H}"))
    for name, table in scores.items():
        vals = [float(v) for v in table.flatten().tolist() if not math.isnan(float(v))]
        if vals:
            rows.append((f"{name}: mean over heads (min-max)",
                         f"{sum(vals) / len(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})"))
        else:
            rows.append((f"{name}: mean over heads", "n/a (no example applies)"))
    return rows


def metric_groups(
    metrics: Mapping[str, Any] | None,
    attention: Sequence[tuple[str, str]] = (),
) -> dict[str, list[tuple[str, str]]]:
    """Split a run's summary into the report's groups: {"task", "cost", "attention", "run"}
    -> [(label, shown value)]. Provenance keys are left out (the Run section shows them);
    a key the rules do not know goes to the task metrics."""
    groups: dict[str, list[tuple[str, str]]] = {"task": [], "cost": [], "attention": [],
                                                "run": []}
    main = str((metrics or {}).get("main_metric", "metric"))
    for key, val in flatten(metrics or {}):
        top = key.split(".", 1)[0]
        if top in PROVENANCE_KEYS or (top in _OPTIONAL_KEYS and val is None):
            continue
        if top in _RUN_KEYS:
            group = "run"
        elif top == "analysis" or top == "attention":
            group = "attention"
        elif top.startswith(_COST_PREFIXES) or top == "surgery":
            group = "cost"
        else:
            group = "task"
        groups[group].append((label_of(key, main), shown(val)))
    groups["attention"] = list(attention) + groups["attention"]
    return groups


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        out: list[tuple[str, Any]] = []
        for k, v in obj.items():
            out += flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, obj)]
