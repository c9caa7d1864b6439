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

from dataclasses import dataclass, replace
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
from .dense import Softmax, SoftmaxConfig

# Key of the residual-score entry in ``AttnContext.state``; the value is a ResidualScores or
# a ResidualFactors.
REALFORMER_STATE_KEY = "realformer.scores"
# The factored form (``factored_fits``): while the factors are at most 8 head dims wide (8
# realformer layers of equal head dims) for inputs of 512 x 512 scores per head or more,
# 4 below that (where time, not the [b,h,n,m] memory, decides; decision 41).
FACTORED_LONG_SCORES = 1 << 18
FACTORED_MAX_WIDTH = 8
FACTORED_SHORT_WIDTH = 4


class ResidualScores(NamedTuple):
    """Raw pre-softmax scores [b,h,n,m] of the last realformer layer, and that layer."""

    scores: torch.Tensor
    layer_idx: int


class ResidualFactors(NamedTuple):
    """The same scores as a product, S = queries @ keys^T: queries [b,h,n,w] and keys
    [b,h,m,w] are every realformer layer's q * scale and k so far, concatenated (w = the
    sum of their head dims), and the last of those layers."""

    queries: torch.Tensor
    keys: torch.Tensor
    layer_idx: int

    def product(self) -> torch.Tensor:
        """S [b,h,n,m]."""
        return self.queries @ self.keys.transpose(-1, -2)


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
) -> ResidualScores | ResidualFactors | None:
    """The previous realformer layer's entry from ``state`` (None at the first layer).

    Raises ValueError when the entry comes from this or a later layer (a state dict reused
    across forward passes, or two realformer groups in one layer) or has another shape
    (the heads or lengths differ between layers).
    """
    prev: ResidualScores | ResidualFactors | None = lower_entry(
        state, REALFORMER_STATE_KEY, "realformer", layer_idx, "residual scores")
    if prev is None:
        return None
    if isinstance(prev, ResidualFactors):
        got = torch.Size((*prev.queries.shape[:3], prev.keys.shape[2]))
    else:
        got = prev.scores.shape
    if got != shape:
        raise ValueError(
            f"realformer at layer {layer_idx} has scores of shape [b,h,n,m]={list(shape)} "
            f"but layer {prev.layer_idx} passed up {list(got)}; residual "
            "attention needs the same heads and lengths in every realformer layer "
            "(put it on all heads of the layers, with equal head counts)"
        )
    return prev


def factored_fits(n: int, m: int, width: int, head_dim: int) -> bool:
    """Whether a realformer layer runs on the factors (``ResidualFactors``): while they are
    at most ``FACTORED_MAX_WIDTH`` head dims wide for inputs of ``FACTORED_LONG_SCORES``
    scores per head or more, ``FACTORED_SHORT_WIDTH`` below that (their product's cost
    grows with the width; the explicit form's [b,h,n,m] scores cost memory at long
    inputs)."""
    long = n * m >= FACTORED_LONG_SCORES
    return width <= (FACTORED_MAX_WIDTH if long else FACTORED_SHORT_WIDTH) * head_dim


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
    plain softmax attention. Complexity O(n*m) time.
    Two forms, the same S_l: S_l is a sum of products, sum_{i <= l} (Q_i s_i) K_i^T (s_i
    each layer's scale), so it is also [Q_1 s_1, .., Q_l s_l] [K_1, .., K_l]^T.
      * factored (``ResidualFactors``): without ``need_weights``, while the concatenated
        factors are at most 8 head dims wide from 512 x 512 scores per head, 4 below that
        (``factored_fits``): SDPA over the concatenated queries and keys (the flash
        kernel on the CPU), the factors passed up; memory O((n + m) * w), no [b,h,n,m]
        tensor kept. Past that width the next layer computes S_{l-1} from the factors and
        continues explicit.
      * explicit (``ResidualScores``): S_l materialised and passed up. Without
        ``need_weights`` the rows run in chunks under activation checkpoints
        (``_rowchunks``), so training keeps S_l (which the next layer reads) and none of
        the softmax's [b, h, n, m] tensors.
    Cross-layer state: the raw, un-masked (finite) S_l, in either form, is stored in
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
        self.softmax = Softmax(SoftmaxConfig(), dims)  # no parameters: the factored form

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
        n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
        entry = previous_scores(ctx.state, ctx.layer_idx, torch.Size((*q.shape[:2], n, m)))
        if not ctx.need_weights and not isinstance(entry, ResidualScores):
            width = d + (0 if entry is None else entry.queries.shape[-1])
            if factored_fits(n, m, width, d):
                return self._factored(q, k, v, ctx, entry)
        prev = entry.product() if isinstance(entry, ResidualFactors) else (
            None if entry is None else entry.scores)
        if ctx.need_weights:
            out, scores, probs = self._rows(q, k, v, ctx, prev, 0, n)
        else:  # query rows in checkpointed chunks (_rowchunks): of the [b,h,n,m] tensors
            # training keeps only S_l, which the next layer reads anyway
            probs = None
            rows_ctx = replace(ctx, state=None)  # see Predictive.forward: no state cycle
            out, scores = in_row_chunks(
                lambda r0, qc, pc: self._rows(qc, k, v, rows_ctx, pc, r0, n)[:2], q, m,
                dropout=draws_dropout(ctx, self.training), row_inputs=(prev,),
                concat_extras=True)
        if ctx.state is not None:
            ctx.state[REALFORMER_STATE_KEY] = ResidualScores(scores, ctx.layer_idx)
        return AttnOutput(out, probs)

    def _factored(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
                  prev: ResidualFactors | None) -> AttnOutput:
        """S_l = Q K^T * scale + S_{l-1} as one product: [Q_1 s_1, .., Q_l s_l] times
        [K_1, .., K_l]^T, so softmax(S_l + mask) V runs as SDPA over the concatenated
        queries and keys at scale 1 and the factors are passed up instead of S_l."""
        qs = q * ctx.scale_for(q.shape[-1])  # [b,h,n,d]
        ks = k
        if prev is not None:
            qs = torch.cat([prev.queries.to(q.dtype), qs], -1)  # [b,h,n,w]
            ks = torch.cat([prev.keys.to(k.dtype), k], -1)  # [b,h,m,w]
        out = self.softmax.train(self.training)(
            qs, ks, v, replace(ctx, scale=1.0, need_weights=False)).out  # [b,h,n,dv]
        if ctx.state is not None:
            ctx.state[REALFORMER_STATE_KEY] = ResidualFactors(qs, ks, ctx.layer_idx)
        return AttnOutput(out)
