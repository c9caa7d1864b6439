"""W_O sparsity: full fine-tuning with an L1 and a group-lasso penalty on each head's W_O block.

In multi-head attention head i reaches the residual stream only through its block
W_O^i = W_O[:, i*dv:(i+1)*dv] of the output projection (BERT: ``attention.output.dense``), and
all heads write into the same D dimensions, so they compete for them. This tuner trains every
weight, as ``full`` does, and adds to the task loss (``aux_loss``, which the runner adds)

    lambda_1 * sum_l sum |W_O^(l)|                                           (L1)
  + lambda_g * sum_l sum_i sum_r ||W_O^(l)[r, i*dv:(i+1)*dv]||_2             (group lasso)

summed over layers l, heads i and output rows r: one group per (head, output dimension), so
the group term pushes whole output dimensions of a head to zero, leaving each head fewer
directions of the output space. ``attnlab.analysis.overlap`` measures what that does to the
heads' output subspaces; the runner stores it before and after training in
``summary.json["head_overlap"]`` for this tuner.

Plain (sub)gradients through AdamW: the penalty shrinks entries but does not set them to
exactly zero (no proximal step). Biases are not penalised. Tuners do not compose (a model
takes one tuner), so the rest of the model always trains fully here.

Scale on the embedded MiniLM (6 layers, W_O 384 x 384), ``wo_penalty(*wo_weights(m), l1,
group)`` with ``m = attnlab.load_default_model()[0]``: L1 sum 33,763 (l1=1, group=0), group
sum 7,426 (l1=0, group=1); the defaults below add 0.34 and 0.07 to the task loss at the start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..hf.arch import inspect_model, output_projections
from .base import (
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    finish_tuning,
    register_tuner,
    start_tuning,
    unwrap_peft,
)


@dataclass(frozen=True, kw_only=True)
class WoSparseConfig(TunerConfig):
    """Full fine-tuning plus lambda_1 * L1 + lambda_g * group lasso on every W_O block."""

    name = "wo_sparse"
    l1: float = 1e-5  # lambda_1: weight of sum |W_O| over all layers
    group: float = 1e-5  # lambda_g: weight of sum over (head, output row) of ||group||_2

    def __post_init__(self) -> None:
        if self.l1 < 0 or self.group < 0:
            raise ValueError("wo_sparse weights l1 and group must be >= 0")


def wo_penalty(weights: Sequence[torch.Tensor], num_heads: int, l1: float,
               group: float) -> torch.Tensor:
    """l1 * sum |W| + group * sum_{i, r} ||W[r, i*dv:(i+1)*dv]||_2 over the W_O weights
    ([D, h*dv] each); a scalar that keeps the graph to the weights."""
    total = weights[0].new_zeros(())
    for w in weights:
        d_out, d_in = w.shape
        if d_in % num_heads:
            raise ValueError(f"W_O of shape {tuple(w.shape)} does not split into "
                             f"{num_heads} heads")
        if l1:
            total = total + l1 * w.abs().sum()
        if group:
            groups = w.view(d_out, num_heads, d_in // num_heads)  # [D, h, dv]
            total = total + group * torch.linalg.vector_norm(groups, dim=-1).sum()
    return total


def wo_weights(model: nn.Module) -> tuple[list[torch.Tensor], int]:
    """(W_O weight of every layer, h) of a Hugging Face encoder."""
    inner = unwrap_peft(model)
    host = inspect_model(inner)
    return [lin.weight for _, lin in output_projections(inner, host)], host.num_heads


@dataclass(frozen=True)
class _Penalised:
    """What ``aux_loss`` reads (a plain model attribute, found once at ``apply``)."""

    cfg: WoSparseConfig
    projections: tuple[nn.Linear, ...]  # W_O of every layer
    num_heads: int


_ATTR = "_attnlab_wo_sparse"


@register_tuner(WoSparseConfig)
class WoSparseTuner(RequiresGradTuner):
    """Everything trains; the W_O penalty is the auxiliary loss."""

    def apply(self, model: nn.Module, cfg: WoSparseConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        host = inspect_model(model)  # fails here, before training, on an unknown W_O
        projections = tuple(lin for _, lin in output_projections(model, host))
        model.requires_grad_(True)
        object.__setattr__(model, _ATTR, _Penalised(cfg, projections, host.num_heads))
        return finish_tuning(model, record)

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        found = getattr(model, _ATTR, None)
        if not isinstance(found, _Penalised):
            raise ValueError("this model was not tuned with wo_sparse; apply it first")
        if not (found.cfg.l1 or found.cfg.group):
            return None
        return wo_penalty([lin.weight for lin in found.projections], found.num_heads,
                          found.cfg.l1, found.cfg.group)
