"""Attention with priors: extra terms on the scores (here: residual scores, RealFormer).

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.5. The family
spans three files: this one (RealFormer and the cross-layer helpers every mechanism that
passes something up the stack uses), ``priors_position.py`` (Gaussian position priors:
``gaussian_prior``, ``gaussian_transformer``, ``hardcoded_gaussian``) and
``priors_layers.py`` (maps from lower layers: ``predictive``, ``lazyformer``).

Cross-layer state: a mechanism stores a NamedTuple with a ``layer_idx`` field under its own
key in ``AttnContext.state`` and the next such layer reads it with :func:`lower_entry`, which
refuses an entry from the same or a later layer (a state dict reused across forwards). Under
Hugging Face gradient checkpointing the backend replays each layer's state for its
recomputation (``attnlab.hf.backend.Replay``), so these mechanisms need nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    check_qkv,
    register_mechanism,
)
from ._rowchunks import attend_rows, draws_dropout, in_row_chunks

# Key of the residual-score entry in ``AttnContext.state``; the value is a ResidualScores.
REALFORMER_STATE_KEY = "realformer.scores"


class ResidualScores(NamedTuple):
    """Raw pre-softmax scores [b,h,n,m] of the last realformer layer, and that layer."""

    scores: torch.Tensor
    layer_idx: int


def lower_entry(state: dict[str, Any] | None, key: str, name: str, layer_idx: int,
                what: str) -> Any | None:
    """The entry a lower layer stored under ``key`` in ``state`` (None if there is none).

    The entry is a NamedTuple with a ``layer_idx`` field. Raises ValueError when it comes
    from this or a later layer: the state dict was reused across forward passes, or two
    groups of mechanism ``name`` share a layer. ``what`` names the entry in the message.
    """
    if state is None or key not in state:
        return None
    prev = state[key]
    if prev.layer_idx >= layer_idx:
        raise ValueError(
            f"{name} at layer {layer_idx} found {what} written by layer {prev.layer_idx}: "
            "AttnContext.state must be a fresh dict for each forward pass and each layer may "
            f"hold a single {name} group"
        )
    return prev


def previous_scores(
    state: dict[str, Any] | None, layer_idx: int, shape: torch.Size
) -> torch.Tensor | None:
    """The previous realformer layer's scores from ``state`` (None at the first layer).

    Raises ValueError when the entry comes from this or a later layer (a state dict reused
    across forward passes, or two realformer groups in one layer) or has another shape
    (the heads or lengths differ between layers).
    """
    prev: ResidualScores | None = lower_entry(state, REALFORMER_STATE_KEY, "realformer",
                                              layer_idx, "residual scores")
    if prev is None:
        return None
    if prev.scores.shape != shape:
        raise ValueError(
            f"realformer at layer {layer_idx} has scores of shape [b,h,n,m]={list(shape)} "
            f"but layer {prev.layer_idx} passed up {list(prev.scores.shape)}; residual "
            "attention needs the same heads and lengths in every realformer layer "
            "(put it on all heads of the layers, with equal head counts)"
        )
    return prev.scores


@dataclass(frozen=True, kw_only=True)
class RealFormerConfig(MechanismConfig):
    name: ClassVar[str] = "realformer"


@register_mechanism(RealFormerConfig)
class RealFormer(nn.Module):
    """Residual attention: each layer adds the previous layer's raw scores to its own.

    Paper: Liu, Luo, Wang, Ma, Li, "RealFormer: Transformer Likes Residual Attention",
    Findings of ACL 2021.
    Formula: S_l = Q K^T / sqrt(d) + S_{l-1}; out = softmax(S_l + mask) V, where S_{l-1}
    is the previous realformer layer's pre-softmax score (itself residual). The first
    realformer layer of a forward pass (no entry in ``ctx.state``, or ``state`` None) is
    plain softmax attention. Complexity O(n*m) time and memory (scores are materialised:
    the next layer needs them). Without ``need_weights`` the rows run in chunks under
    activation checkpoints (``_rowchunks``), so training keeps S_l (which the next layer
    reads) and none of the softmax's [b, h, n, m] tensors.
    Cross-layer state: the raw, un-masked (finite) S_l is stored in
    ``ctx.state["realformer.scores"]`` with the layer index; the next layer checks that
    the shape matches and raises a clear error otherwise. Masks (padding, causal) are
    applied after the addition, so masked pairs never carry -inf up the stack. Gradients
    flow through the residual path, as in the paper, also under Hugging Face gradient
    checkpointing (non-reentrant; the backend replays the state, see the module doc).
    Scope "layer": head i of layer l must feed head i of layer l+1, which a per-layer
    mechanism guarantees (the paper applies it to every head of every layer).
    Dropout ``ctx.dropout`` applies to the probabilities in training mode.
    """

    example: ClassVar[str] = "realformer"
    caps: ClassVar[Capabilities] = Capabilities(
        family="priors", paper="Liu et al. 2021", scope="layer", exact=False,
        complexity="O(n*m)",
    )

    def __init__(self, cfg: RealFormerConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
              prev: torch.Tensor | None, first_row: int, num_queries: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out [b,h,c,dv], S_l [b,h,c,m], probabilities [b,h,c,m]) of query rows first_row
        .. of num_queries (q [b,h,c,d]: those rows; prev: their rows of S_{l-1} or None)."""
        scores = (q @ k.transpose(-1, -2)) * ctx.scale_for(q.shape[-1])  # [b,h,c,m]
        if prev is not None:
            scores = scores + prev.to(scores.dtype)
        out, probs = attend_rows(scores, v, ctx, self.training, first_row, num_queries)
        return out, scores, probs  # [b,h,c,dv], [b,h,c,m] x2

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        n, m = q.shape[-2], k.shape[-2]
        prev = previous_scores(ctx.state, ctx.layer_idx, torch.Size((*q.shape[:2], n, m)))
        if ctx.need_weights:
            out, scores, probs = self._rows(q, k, v, ctx, prev, 0, n)
        else:  # query rows in checkpointed chunks (_rowchunks): of the [b,h,n,m] tensors
            # training keeps only S_l, which the next layer reads anyway
            probs = None
            out, scores = in_row_chunks(
                lambda r0, qc, pc: self._rows(qc, k, v, ctx, pc, r0, n)[:2], q, m,
                dropout=draws_dropout(ctx, self.training), row_inputs=(prev,),
                concat_extras=True)
        if ctx.state is not None:
            ctx.state[REALFORMER_STATE_KEY] = ResidualScores(scores, ctx.layer_idx)
        return AttnOutput(out, probs)
