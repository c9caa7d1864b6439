"""Head importance (Michel et al. 2019) and head ablation, for any model attnlab can mask.

Michel, Levy and Neubig, "Are Sixteen Heads Really Better than One?" (NeurIPS 2019) give
every head h a mask variable xi_h (``MHAtt(x) = sum_h xi_h Att_h(x)``, xi = 1 for the model
as trained) and define its importance as the expected sensitivity of the loss to it:

    I_h = E_x | dL(x) / d xi_h |                                   (their eq. 2)

:func:`head_importance` computes exactly that, per example: a batch of b examples gets a mask
[b, L, H] of ones (example i's output depends on row i only), one backward of the batch loss
gives every example's gradient, and the mean of the absolute values over the examples is
I [L, H]. transformers' task losses are weighted means over the batch,
``L_batch = sum_i w_i L(x_i)`` (:func:`example_weights`: w_i = 1/b for sentence-level labels
and answer spans; labelled tokens of i / labelled tokens of the batch for token-level labels
[b, n] with -100 ignored), so ``dL(x_i)/d xi = grad_i / w_i``; an example without a labelled
token has no loss and is left out. Cost: one forward and backward per batch; no parameter
gradient is kept (``torch.autograd.grad`` with respect to the mask only).

Deviation / choice, documented: Hugging Face's script (``run_bertology.py`` in transformers'
research projects, not the paper's authors' code) accumulates |gradient of each *batch*
loss| and divides by the token count, so gradients of opposite sign cancel inside a batch;
this module follows the paper's
per-example expectation instead. Like that script by default, the importance is then
normalised per layer by the l2 norm over the layer's heads (``I_lh / ||I_l||_2``), which the
paper reports helps pruning across layers; ``normalize=False`` keeps the raw values, and both
are returned. The script's further global min-max rescaling is not applied.

Ablation (:func:`ablate`): the task metric with each head masked (xi_h = 0, every other head
1), and with every head of a group (e.g. a head class) masked at once, next to the metric of
the model as is (the same masking path with all ones). ``delta = masked - baseline``, so for a
metric where greater is better a negative delta is a loss.

The mask is applied by :func:`attnlab.hf.headmask.head_mask` (imported on use: the analysis
package loads torch only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from .heads import class_names

T = TypeVar("T")
# progress(iterable, total, description) -> the same items; the CLI passes a rich bar.
Progress = Callable[[Iterable[T], int, str], Iterable[T]]
IGNORE_INDEX = -100  # label of a token without a loss (transformers' CrossEntropyLoss default)


def _no_progress(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    return items


# ----------------------------------------------------------------------------- importance


@dataclass
class HeadImportance:
    """What :func:`head_importance` measured."""

    raw: Tensor  # [L, H] float64: E_x |dL(x)/dxi_h|
    importance: Tensor  # [L, H] float64: raw / (l2 norm of its layer), or raw (normalize off)
    normalized: bool  # whether ``importance`` is normalised per layer
    n_examples: int  # examples in the mean (those with a loss)


def example_weights(batch: Mapping[str, Tensor]) -> Tensor:
    """[b] float64 weights w_i with transformers' batch loss ``L_batch = sum_i w_i L(x_i)``.

    Integer ``labels`` [b, n] (token classification, masked LM): labelled tokens of i over
    labelled tokens of the batch (-100 ignored, as CrossEntropyLoss does). Anything else
    (sequence labels [b] or [b, C], start/end positions [b]): 1/b.
    """
    labels = batch.get("labels")
    ref = next(v for v in batch.values() if isinstance(v, Tensor))
    b = ref.shape[0]
    if isinstance(labels, Tensor) and labels.dim() == 2 and not labels.is_floating_point():
        count = (labels != IGNORE_INDEX).sum(-1).double()  # [b]
        return (count / count.sum().clamp(min=1.0)).cpu()
    return torch.full((b,), 1.0 / b, dtype=torch.float64)


def layer_normalize(raw: Tensor) -> Tensor:
    """Each layer's row divided by its l2 norm over heads (a zero row stays zero)."""
    norm = raw.pow(2).sum(-1, keepdim=True).sqrt()  # [L, 1]
    return raw / (norm + 1e-20)  # the 1e-20 of run_bertology.py: 0 / 0 -> 0


def _mask_dtype(model: nn.Module) -> torch.dtype:
    """float64 for a float64 model (exact finite-difference checks), else float32."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def head_importance(
    model: nn.Module,
    batches: Sequence[Mapping[str, Tensor]],
    *,
    normalize: bool = True,
    progress: Progress | None = None,
) -> HeadImportance:
    """I [L, H] over ``batches`` (model inputs with labels, as a task's collator makes them);
    see the module doc. The model runs in eval mode (dropout off); its mode is restored."""
    from ..hf.arch import inspect_model  # lazy: attnlab.hf loads transformers
    from ..hf.headmask import head_mask

    if not batches:
        raise ValueError("head importance needs at least one batch of labelled examples")
    host = inspect_model(model)
    shape = (host.num_layers, host.num_heads)
    device = next(model.parameters()).device
    dtype = _mask_dtype(model)
    total = torch.zeros(shape, dtype=torch.float64)
    count = 0
    was_training = model.training
    model.eval()
    try:
        for batch in (progress or _no_progress)(batches, len(batches), "head importance"):
            batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            weights = example_weights(batch)  # [b]
            with torch.enable_grad():
                xi = torch.ones(weights.shape[0], *shape, device=device, dtype=dtype,
                                requires_grad=True)  # [b, L, H]
                with head_mask(model, xi):
                    out = model(**batch)
                loss = getattr(out, "loss", None)
                if loss is None:
                    raise ValueError(
                        f"{type(model).__name__} returned no loss: head importance needs a "
                        "model with a task head and batches with labels (a fine-tuned run, or "
                        "a saved model with its head and --task)")
                (grad,) = torch.autograd.grad(loss, xi)  # [b, L, H]
            keep = weights > 0
            per_example = grad.detach().double().cpu()[keep] / weights[keep, None, None]
            total += per_example.abs().sum(0)  # [L, H]
            count += int(keep.sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no example has a labelled token, so there is no loss; check the "
                         "labels of the data")
    raw = total / count
    return HeadImportance(raw, layer_normalize(raw) if normalize else raw.clone(), normalize,
                          count)


# ----------------------------------------------------------------------------- ablation


@dataclass
class Ablation:
    """The task metric with heads masked (xi = 0), next to the model as is."""

    metric: str  # the metric's name, e.g. "mcc"
    greater_is_better: bool | None  # None: not known (a metric other than the task's main)
    baseline: float  # the metric with every head (xi = 1)
    heads: Tensor | None  # [L, H] float64: the metric with only that head masked
    groups: dict[str, float] = field(default_factory=dict)  # group -> metric, group masked
    group_sizes: dict[str, int] = field(default_factory=dict)  # group -> heads in it

    @property
    def delta(self) -> Tensor | None:
        """[L, H]: masked minus baseline (None when single heads were not ablated)."""
        return None if self.heads is None else self.heads - self.baseline

    def group_delta(self, name: str) -> float:
        return self.groups[name] - self.baseline


Evaluate = Callable[[nn.Module], Mapping[str, float]]  # model -> metrics on the eval data


def _metric(evaluate: Evaluate, model: nn.Module, metric: str) -> float:
    result = evaluate(model)
    if metric not in result:
        raise ValueError(f"the evaluation gives no metric {metric!r}; it gives "
                         f"{', '.join(sorted(result))}")
    return float(result[metric])


def ablate(
    model: nn.Module,
    evaluate: Evaluate,
    metric: str,
    *,
    greater_is_better: bool | None = True,
    per_head: bool = True,
    groups: Mapping[str, Tensor] | None = None,
    progress: Progress | None = None,
) -> Ablation:
    """The metric with every head (baseline), with each head masked (``per_head``), and with
    each group of ``groups`` (name -> bool [L, H], True = masked) masked at once. Runs
    ``evaluate(model)`` 1 + L*H (per_head) + len(groups) times, under ``torch.no_grad``."""
    from ..hf.arch import inspect_model  # lazy: attnlab.hf loads transformers
    from ..hf.headmask import head_mask

    host = inspect_model(model)
    shape = (host.num_layers, host.num_heads)
    dtype = _mask_dtype(model)
    ones = torch.ones(shape, dtype=dtype)
    jobs: list[tuple[str, Tensor]] = [("", ones)]
    if per_head:
        for layer in range(shape[0]):
            for head in range(shape[1]):
                mask = ones.clone()
                mask[layer, head] = 0.0
                jobs.append((f"{layer}:{head}", mask))
    for name, sel in (groups or {}).items():
        if tuple(sel.shape) != shape:
            raise ValueError(f"group {name!r} has shape {tuple(sel.shape)}; the model has "
                             f"{shape[0]} layers x {shape[1]} heads")
        jobs.append((f"group:{name}", torch.where(sel.bool(), 0.0, ones).to(dtype)))
    values: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for key, mask in (progress or _no_progress)(jobs, len(jobs), "ablation"):
                with head_mask(model, mask):
                    values[key] = _metric(evaluate, model, metric)
    finally:
        model.train(was_training)
    heads = None
    if per_head:
        heads = torch.tensor([[values[f"{l}:{h}"] for h in range(shape[1])]
                              for l in range(shape[0])], dtype=torch.float64)
    named = dict(groups or {})
    return Ablation(metric, greater_is_better, values[""], heads,
                    {n: values[f"group:{n}"] for n in named},
                    {n: int(named[n].bool().sum()) for n in named})


# ----------------------------------------------------------------------------- by class


def class_masks(classes: Sequence[Sequence[str]]) -> dict[str, Tensor]:
    """class -> bool [L, H] of its heads, for every class that has one (in class order)."""
    out = {}
    for name in class_names(classes):
        sel = torch.tensor([[c == name for c in row] for row in classes], dtype=torch.bool)
        if bool(sel.any()):
            out[name] = sel
    return out


def _mean(x: Tensor) -> float:
    return float(x.double().mean()) if x.numel() else math.nan


def by_class(
    classes: Sequence[Sequence[str]],
    importance: HeadImportance | None = None,
    ablation: Ablation | None = None,
) -> list[dict[str, Any]]:
    """One row per head class present: ``heads``, ``mean_importance`` (normalised as the
    result is), ``mean_raw_importance``, ``mean_head_delta`` (mean over its heads of the
    metric change when that head alone is masked) and ``class_delta`` (the change when the
    whole class is masked at once); NaN where not measured."""
    rows = []
    for name, sel in class_masks(classes).items():
        row: dict[str, Any] = {"class": name, "heads": int(sel.sum())}
        row["mean_importance"] = (_mean(importance.importance[sel]) if importance is not None
                                  else math.nan)
        row["mean_raw_importance"] = (_mean(importance.raw[sel]) if importance is not None
                                      else math.nan)
        delta = ablation.delta if ablation is not None else None
        row["mean_head_delta"] = _mean(delta[sel]) if delta is not None else math.nan
        row["class_delta"] = (ablation.group_delta(name)
                              if ablation is not None and name in ablation.groups else math.nan)
        rows.append(row)
    return rows


def _fmt(v: Any, signed: bool = False) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:+.4f}" if signed else f"{v:.4f}"
    return str(v)


def by_class_markdown(rows: Sequence[Mapping[str, Any]], metric: str | None = None) -> str:
    """The "importance by head class" table as Markdown."""
    what = f" ({metric})" if metric else ""
    head = ["class", "heads", "mean importance", "mean raw importance",
            f"mean delta, one head masked{what}", f"delta, class masked{what}"]
    keys = ["class", "heads", "mean_importance", "mean_raw_importance", "mean_head_delta",
            "class_delta"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += ["| " + " | ".join(_fmt(r[k], signed=k.endswith("delta")) for k in keys) + " |"
              for r in rows]
    return "\n".join(lines) + "\n"
