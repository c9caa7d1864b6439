"""Dense softmax attention: the canonical scaled dot-product (Vaswani et al. 2017)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core import (
    OMIT_DEFAULT,
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    causal_mask,
    check_qkv,
    reference_attention,
    register_mechanism,
)
from ._maskedsdpa import sdpa


@dataclass(frozen=True, kw_only=True)
class SoftmaxConfig(MechanismConfig):
    name: ClassVar[str] = "softmax"
    # False: the scores and probabilities are tensors, as in the vanilla Transformer of
    # LRA's and MEGA's cost tables (a baseline for their ratios), not the fused kernel
    fused: bool = field(default=True, metadata=OMIT_DEFAULT)  # spec: 'softmax' stays


def rows_with_keys(
    key_mask: torch.Tensor | None, causal: bool, n: int, m: int
) -> torch.Tensor | None:
    """[b,1,n,1] bool: does query row i have at least one allowed key? None = always."""
    if key_mask is None:
        return None
    if causal:  # query i sees keys j <= i + m - n (core.reference's alignment)
        seen = key_mask.cumsum(-1) > 0  # [b,m]: any kept key at or before j
        last = torch.arange(n, device=key_mask.device) + (m - n)  # [n] last visible key
        live = seen[:, last.clamp_min(0)] & (last >= 0)  # [b,n]; n > m: first rows see none
        return live[:, None, :, None]
    return key_mask.any(-1)[:, None, None, None]


@register_mechanism(SoftmaxConfig)
class Softmax(nn.Module):
    """Scaled dot-product attention, softmax(Q K^T / sqrt(d) + mask) V.

    Paper: Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
    Fast path: ``F.scaled_dot_product_attention`` (through ``_maskedsdpa.sdpa``, which
    gives q, k and v one head dim where the CPU fused kernel needs it); probabilities are
    materialised (via ``core.reference``) only when ``ctx.need_weights``. Complexity
    O(n*m). bias() is all zeros, so the fast path is checked against the reference
    directly.
    ``fused=False`` computes it as the vanilla Transformer does (the baseline of the speed
    and memory ratios in LRA's Table 2 and in MEGA's LRA results): scores = Q K^T * scale
    with masked entries set to the dtype's lowest value [b,h,n,m], probs = softmax(scores),
    dropout, probs @ V, autograd keeping the [b,h,n,m] probabilities (O(n*m) memory). The
    same function as the fused path; it serves as the cost baseline of those tables
    (``attnlab bench lra --baseline "softmax(fused=False)"``).
    """

    example: ClassVar[str] = "softmax"
    caps: ClassVar[Capabilities] = Capabilities(
        family="dense", paper="Vaswani et al. 2017", exact=True, complexity="O(n*m)"
    )

    def __init__(self, cfg: SoftmaxConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int) -> torch.Tensor:
        return torch.zeros(1, n, m)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v)
        scale = ctx.scale_for(q.shape[-1])
        p = ctx.dropout if self.training else 0.0
        if ctx.need_weights:
            out, probs = reference_attention(
                q, k, v, key_mask=ctx.key_mask, causal=ctx.causal, scale=scale,
                dropout=p, training=self.training,
            )
            return AttnOutput(out, probs)
        n, m = q.shape[-2], k.shape[-2]
        keep = None  # bool [b,1,1,m], True = attend
        if ctx.key_mask is not None:
            keep = ctx.key_mask[:, None, None, :].to(torch.bool)
        if self.cfg.fused:
            mask = keep  # broadcast to [b,h,n,m]
            if ctx.causal and (mask is not None or n != m):
                cm = causal_mask(n, m, q.device)  # [n,m]
                mask = cm if mask is None else mask & cm
            out = sdpa(q, k, v, attn_mask=mask, dropout_p=p,
                       is_causal=ctx.causal and mask is None, scale=scale)  # [b,h,n,dv]
        else:
            out = self._explicit(q, k, v, keep, ctx.causal, scale, p)
        live = rows_with_keys(ctx.key_mask, ctx.causal, n, m)  # rows with no key give 0
        if live is not None:
            out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return AttnOutput(out)

    @staticmethod
    def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  keep: torch.Tensor | None, causal: bool, scale: float, p: float
                  ) -> torch.Tensor:
        """The vanilla Transformer's attention (``fused=False``): out [b,h,n,dv]; keep
        [b,1,1,m] bool or None. Not ``core.reference_attention``: the oracle's [b,h,n,m]
        boolean masks would make this baseline heavier than the vanilla one."""
        n, m = q.shape[-2], k.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [b,h,n,m]
        low = torch.finfo(scores.dtype).min
        if keep is not None:  # lowest value at masked keys (BERT eager adds it)
            scores = scores.masked_fill(~keep, low)
        if causal:
            scores = scores.masked_fill(~causal_mask(n, m, q.device), low)
        probs = torch.softmax(scores, dim=-1)  # [b,h,n,m], kept by autograd
        if p > 0:
            probs = F.dropout(probs, p, training=True)
        return torch.matmul(probs, v)  # [b,h,n,dv]
