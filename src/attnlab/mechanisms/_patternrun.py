"""How a position pattern of ``sparse`` runs: one dispatch for all of them.

FlexAttention on CUDA (``_flex``: block-sparse kernels, cached masks), else the pattern's
fast path where it applies (the blocked engine ``_blocksparse``, or per-query key lists on
the gathered engine, ``key_list_attention``), else dense masked softmax over the pattern's
``bias``: SDPA under its mask (``_maskedsdpa``), or the reference itself when the weights
are returned (``ctx.need_weights``, capture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..core import (
    AttnContext,
    AttnOutput,
    HeadDims,
    MechanismConfig,
    accumulation_dtype,
    check_qkv,
    reference_attention,
)
from ..core.masks import positions
from . import _blocksparse as bs
from . import _flex, _gathered
from ._maskedsdpa import masked_sdpa

# Fast path: (q, k, v, ctx, scale, dropout) -> out [b,h,n,dv]
FastPath = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnContext, float, float],
                    torch.Tensor]


class Pattern(Protocol):
    """What :func:`run_pattern` reads off a pattern mechanism (an ``nn.Module`` of ``sparse``)."""

    @property
    def cfg(self) -> MechanismConfig: ...
    @property
    def dims(self) -> HeadDims: ...
    @property
    def training(self) -> bool: ...
    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor: ...


def run_pattern(mech: Pattern, q, k, v, ctx: AttnContext, fast: FastPath | None) -> AttnOutput:
    """Shared forward: FlexAttention on CUDA, else the blocked fast path when it applies,
    else dense masked softmax over ``bias``: SDPA (``_maskedsdpa``), or the reference
    itself when the weights are returned."""
    check_qkv(q, k, v, mech.dims)
    n, m = q.shape[2], k.shape[2]
    scale = ctx.scale_for(q.shape[-1])
    p = ctx.dropout if mech.training else 0.0
    sparse = bs.use_blocked(n, m, ctx.need_weights, v.shape[-1] == q.shape[-1])
    if sparse and p == 0 and _flex.available(q):
        out = _flex.flex_pattern_attention(
            q, k, v, lambda: mech.bias(n, m, layer_idx=ctx.layer_idx)[0] == 0,
            (mech.cfg, ctx.layer_idx), key_mask=ctx.key_mask, causal=ctx.causal, scale=scale,
        )
        return AttnOutput(out)
    if sparse and fast is not None:
        if q.device.type != "cpu":  # CUDA without FlexAttention here: the inputs' dtype
            return AttnOutput(fast(q, k, v, ctx, scale, p))
        # on the CPU 16-bit inputs run the engines in fp32 (under autocast too) and return
        # in their dtype: in bf16 the blocked engine's log-sum-exp merges and key-gradient
        # sums round (bigbird at n = 300: 3.2u from fp32, u = 2^-8 times the output's
        # scale; the dense bf16 oracle 1.0u), and the CPU flash kernels take fp32 only
        work = accumulation_dtype(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            out = fast(q.to(work), k.to(work), v.to(work), ctx, scale, p)
        return AttnOutput(out.to(q.dtype))
    bias = mech.bias(n, m, layer_idx=ctx.layer_idx).to(q.device)  # [1,n,m]
    causal = ctx.causal
    if causal and n != m:
        # the pattern reads query i as position i, and so does causality: j <= i (not the
        # reference's queries-at-the-end alignment, j <= i + m - n, of position-free heads)
        i, j = positions(n, m, q.device)
        bias = bias.masked_fill(j > i, float("-inf"))  # [1,n,m]
        causal = False
    if not ctx.need_weights:  # torch's fused kernel under the same mask
        return AttnOutput(masked_sdpa(q, k, v, bias, ctx.key_mask, causal, scale, p))
    out, probs = reference_attention(
        q, k, v, bias=bias, key_mask=ctx.key_mask, causal=causal, scale=scale,
        dropout=p, training=mech.training,
    )
    return AttnOutput(out, probs)


def key_list_attention(keys: tuple[torch.Tensor, torch.Tensor], q, k, v, ctx: AttnContext,
                       scale: float, p: float) -> torch.Tensor:
    """The fast path over per-query key lists: ``keys`` = (idx [n,K], ok [n,K]), the
    pattern's keys of each query (``core.masks``' ``*_key_list``), run on ``_gathered`` with
    the causal rule and the key mask added here."""
    n = q.shape[2]
    idx, ok = (t.to(q.device) for t in keys)  # [n,K]
    if ctx.causal:
        ok = ok & (idx <= torch.arange(n, device=q.device)[:, None])
    allowed = ok[None, None]  # [1,1,n,K]
    if ctx.key_mask is not None:
        allowed = allowed & ctx.key_mask.to(device=q.device, dtype=torch.bool)[:, idx][:, None]
    return _gathered.gathered_attention(q, k, v, idx, allowed, scale=scale, dropout=p)
