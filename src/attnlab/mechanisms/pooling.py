"""Poolingformer: a sliding window plus a wider window of pooled keys and values.

Part of the compressed key-value memory family (see ``memory.py``); in its own file for
length. Shape glossary: b batch, h heads, n query length (= m, key length), d head dim,
dv value head dim, S pooled slots, W candidate slots per query block, Bq query block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    check_qkv,
    masked_softmax,
    register_mechanism,
    require,
)
from ..core.slicing import over_head_groups
from ._maskedsdpa import masked_sdpa
from .memory import FAMILY
from .sparse import Band, BandConfig

Pool = Literal["mean", "max", "conv"]
POOLS = ("mean", "max", "conv")
# Query block of the second level: queries of a block share one gather of W candidate slots.
SLOT_BLOCK = 64


@dataclass(frozen=True, kw_only=True)
class PoolingformerConfig(MechanismConfig):
    name: ClassVar[str] = "poolingformer"
    window: int = 64  # w1: first-level sliding window, one-sided, |i - j| <= w1
    window2: int = 256  # w2: second level sees slots whose span lies in [i - w2, i + w2]
    pool: Pool = "mean"  # Pool: how a slot compresses its tokens (max, mean, or conv)
    pool_size: int = 4  # kappa: pooling kernel, tokens per slot
    stride: int | None = None  # xi: pooling stride (None = pool_size, non-overlapping)
    stacked: bool = True  # second level reads the first level's output (paper); else q, k, v

    def __post_init__(self) -> None:
        require(self.window >= 0, f"poolingformer window (w1, one-sided) must be >= 0, got "
                f"{self.window}")
        require(self.window2 >= self.window, f"poolingformer window2 (w2={self.window2}) must "
                f"be >= window (w1={self.window}): the second level is the wider one; set "
                f"window2 >= {self.window}")
        require(self.pool in POOLS, f"unknown pool {self.pool!r}; choose one of "
                f"{', '.join(POOLS)}")
        require(self.pool_size >= 1, f"poolingformer pool_size (kernel kappa) must be >= 1, "
                f"got {self.pool_size}")
        s = self.stride
        require(s is None or 1 <= s <= self.pool_size, f"poolingformer stride (xi) must be "
                f"between 1 and pool_size={self.pool_size} (a larger stride skips tokens), "
                f"got {s}; leave it None for non-overlapping slots")


def pool_slots(x: torch.Tensor, keep: torch.Tensor, kappa: int, xi: int, how: str,
               weight: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool x [b,h,n,e] over windows of kappa tokens every xi tokens, ignoring padding.

    keep [b,n] bool. Slot s covers tokens s*xi .. s*xi + kappa - 1 (cut at n); S slots
    cover the sequence. mean: the mean of its kept tokens; max: their elementwise max;
    conv: sum_t weight[h,:,t] * x_{s*xi+t} (depthwise, padded tokens as zeros). A slot
    without kept tokens is 0. Returns (slots [b,h,S,e], count [b,S] kept tokens per slot,
    start [S], end [b,S] token spans, inclusive). A row's slots are those of its unpadded
    sequence: a slot's span ends at its last kept token, and slots past the ones covering
    the row's last kept token hold no token (count 0), so right padding changes nothing.
    """
    b, h, n, e = x.shape
    S = 1 if n <= kappa else -(-(n - kappa) // xi) + 1
    total = (S - 1) * xi + kappa
    kept = F.pad(keep, (0, total - n))  # [b,total]
    xp = F.pad(x * keep[:, None, :, None].to(x.dtype), (0, 0, 0, total - n))  # [b,h,total,e]
    win = xp.unfold(2, kappa, xi)  # [b,h,S,e,kappa]
    kw = kept.unfold(1, kappa, xi)  # [b,S,kappa]
    extent = torch.where(keep.any(-1), n - keep.flip(-1).long().argmax(-1), 0)  # [b]
    needed = torch.where(extent <= kappa, 1, -(-(extent - kappa) // xi) + 1)  # slots [b]
    kw = kw & (torch.arange(S, device=x.device) < needed[:, None])[:, :, None]  # [b,S,kappa]
    count = kw.sum(-1)  # [b,S]
    if how == "mean":
        slots = win.sum(-1) / count.clamp(min=1)[:, None, :, None].to(x.dtype)
    elif how == "max":
        low = torch.finfo(x.dtype).min
        slots = win.masked_fill(~kw[:, None, :, None, :], low).amax(-1)  # [b,h,S,e]
        slots = torch.where((count > 0)[:, None, :, None], slots, torch.zeros_like(slots))
    else:
        assert weight is not None
        slots = (win * weight.to(x.dtype)[None, :, None]).sum(-1)  # [b,h,S,e]
    slots = slots * (count > 0)[:, None, :, None].to(x.dtype)  # slots past the row's end: 0
    start = torch.arange(S, device=x.device) * xi  # [S]
    last = start + (kappa - 1) - kw.flip(-1).long().argmax(-1)  # last kept token [b,S]
    end = torch.where(count > 0, last, (start + kappa - 1).clamp(max=n - 1))  # [b,S]
    return slots, count, start, end


def _slot_sdpa(qb: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, allowed: torch.Tensor,
               scale: float) -> torch.Tensor:
    """``slot_attention``'s softmax on ``masked_sdpa``: qb [b,h,nb,bq,d], kg / vg
    [b,h,nb,W,d|dv], allowed [b,nb,bq,W] -> [b,h,nb*bq,dv]. Blocks become the batch
    ([b*nb, h, ., .]) so that one mask [b*nb, 1, bq, W] serves every head; a row with no
    visible slot gives 0."""
    b, h, nb, bq, _ = qb.shape
    bias = torch.zeros(allowed.shape, dtype=qb.dtype, device=qb.device)
    bias = bias.masked_fill(~allowed, float("-inf")).view(b * nb, 1, bq, -1)

    def blocks_first(x: torch.Tensor) -> torch.Tensor:  # [b,h,nb,L,e] -> [b*nb,h,L,e]
        return x.transpose(1, 2).reshape(b * nb, h, x.shape[3], x.shape[4])

    o = masked_sdpa(blocks_first(qb), blocks_first(kg), blocks_first(vg), bias, None, False,
                    scale, 0.0)  # [b*nb,h,bq,dv]
    return o.view(b, nb, h, bq, -1).transpose(1, 2).reshape(b, h, nb * bq, -1)


def slot_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, ok: torch.Tensor,
                   start: torch.Tensor, end: torch.Tensor, *, window2: int, stride: int,
                   causal: bool, scale: float, p: float, dense_probs: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Query i attends slot s when start_s >= i - w2 and end_s <= i + w2 (and end_s <= i
    when causal) and the slot holds a kept token; never builds n x S.

    q [b,h,n,d], ks [b,h,S,d], vs [b,h,S,dv], ok [b,S] bool, start [S], end [S] or [b,S]
    (per row, see ``pool_slots``). Queries come
    in blocks of Bq; block u gathers the W = (Bq - 1 + 2*w2) // xi + 1 consecutive slots
    from the first whose start is >= u*Bq - w2 (every visible slot of the block is among
    them). Memory O(n*W). Returns (out [b,h,n,dv], slot probabilities [b,h,n,S] when
    ``dense_probs`` else None). Rows without a visible slot give 0. Without the
    probabilities or dropout the softmax runs on SDPA (``_slot_sdpa``).
    """
    b, h, n, d = q.shape
    S = ks.shape[2]
    bq = min(SLOT_BLOCK, n)
    nb = -(-n // bq)
    W = min(S, (bq - 1 + 2 * window2) // stride + 1)
    dev = q.device
    u0 = torch.arange(nb, device=dev) * bq  # [nb] first query of each block
    lo = torch.div(u0 - window2 + stride - 1, stride, rounding_mode="floor").clamp(min=0)
    idx = lo[:, None] + torch.arange(W, device=dev)  # [nb,W]
    real = idx < S
    idx = idx.clamp(max=S - 1)
    i = (u0[:, None] + torch.arange(bq, device=dev))[:, :, None]  # [nb,bq,1]
    st = start[idx][:, None, :]  # [nb,1,W]
    en = end.expand(b, S)[:, idx][:, :, None, :]  # [b,nb,1,W]
    allowed = (real[:, None, :] & (st >= i - window2))[None] & (en <= i + window2)
    if causal:
        allowed = allowed & (en <= i)
    allowed = allowed & ok[:, idx][:, :, None, :]  # [b,nb,bq,W]
    qb = F.pad(q, (0, 0, 0, nb * bq - n)).view(b, h, nb, bq, d)
    kg, vg = ks[:, :, idx], vs[:, :, idx]  # [b,h,nb,W,d], [b,h,nb,W,dv]
    if not dense_probs and p == 0:  # torch's fused kernel: no [b,h,nb,bq,W] scores kept
        return _slot_sdpa(qb, kg, vg, allowed, scale)[:, :, :n], None
    scores = (qb @ kg.transpose(-1, -2)) * scale  # [b,h,nb,bq,W]
    probs = masked_softmax(scores, allowed[:, None].expand(scores.shape))
    pd = F.dropout(probs, p, training=True) if p > 0 else probs
    out = (pd @ vg).reshape(b, h, nb * bq, -1)[:, :, :n]  # [b,h,n,dv]
    dense = None
    if dense_probs:
        full = probs.new_zeros(b, h, nb, bq, S)
        full.scatter_add_(-1, idx[None, None, :, None, :].expand(probs.shape), probs)
        dense = full.reshape(b, h, nb * bq, S)[:, :, :n]  # [b,h,n,S]
    return out, dense


@register_mechanism(PoolingformerConfig)
class Poolingformer(nn.Module):
    """Poolingformer: two-level attention, a sliding window then pooled attention further out.

    Paper: Zhang, Gong, Shen, Li, Lv, Duan, Chen, "Poolingformer: Long Document Modeling
    with Pooling Attention", ICML 2021.
    Formula (per head, stacked as the paper: the second level reads the first's output):
      level 1: y_i = softmax_{|i-j| <= w1}(q_i k_j^T / sqrt(d)) v_j          (band)
      level 2: slots Ybar_s = Pool(y_{s*xi .. s*xi+kappa-1}) (kappa = pool_size, xi = stride)
               z_i = softmax_{s in N2(i)}(y_i Ybar_s^T / sqrt(d)) Ybar_s,
               N2(i) = slots whose whole span lies in [i - w2, i + w2]
      out_i = y_i + z_i.
    Complexity O(n*(w1 + (Bq + 2*w2)/xi)*d), linear in n. Level 1 is the library's exact
    ``band`` (blocked engine from 256 tokens on, FlexAttention on CUDA); level 2 gathers,
    per block of Bq = 64 queries, the slots its queries can see (:func:`slot_attention`).
    ``stacked=False``: level 2 reads the host's q and the pooled K, V instead
    (z_i = softmax(q_i Kbar^T / sqrt(d)) Vbar), i.e. both levels in parallel over the input.
    Pooling: "mean" and "max" over the slot's kept tokens (a slot of padding only is
    masked), "conv": a learned depthwise kernel [h,d,kappa] per head, initialised to
    1/kappa (mean pooling over the full span, padding counted as zeros). A slot's span
    ends at its last kept token, so a right-padded row sees the slots its unpadded
    sequence would (padding-invariant outputs).
    Causal: level 1 is causal band; a slot is visible only when its whole span is at or
    before i (end_s <= i), so pooled slots never mix future tokens.
    Deviations: the paper's second level has its own projections W'_Q, W'_K, W'_V of y;
    in head space they are the identity (y is the query, the pooled y the keys and values),
    which needs dv == d; its "conv" pooling is a dynamic (input-dependent) convolution,
    here a static depthwise one; windows are one-sided (the paper quotes total sizes);
    self-attention only (n == m). ``need_weights`` returns the effective weights
    P1 + P2 M P1 (stacked) or P1 + P2 M (parallel) [b,h,n,n], M the slots' mean-pooling
    matrix: exact (out = weights @ v) for "mean", an attribution for "max" and "conv".
    Dropout ``ctx.dropout`` applies to both levels' probabilities in training mode.
    """

    example: ClassVar[str] = "poolingformer(window=2, window2=8, pool_size=3)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Zhang et al. 2021", keys_are_tokens=True,
        complexity="O(n*(w + w2/stride))",
    )

    def __init__(self, cfg: PoolingformerConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.level1 = Band(BandConfig(window=cfg.window), dims)  # no parameters
        self.register_parameter("pool_weight", None)
        if cfg.pool == "conv":
            self.pool_weight = nn.Parameter(torch.empty(dims.num_heads, dims.head_dim,
                                                        cfg.pool_size))  # [h,dv,kappa]
        self.reset_parameters()

    @property
    def stride(self) -> int:
        return self.cfg.pool_size if self.cfg.stride is None else self.cfg.stride

    def reset_parameters(self) -> None:
        """The conv kernel starts as mean pooling, 1/kappa per tap."""
        if self.pool_weight is not None:
            with torch.no_grad():
                self.pool_weight.fill_(1.0 / self.cfg.pool_size)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, n, d = q.shape
        c = self.cfg
        require(k.shape[2] == n, f"poolingformer keys are the query tokens: needs n == m, "
                f"got n={n}, m={k.shape[2]}")
        require(v.shape[-1] == d, f"poolingformer needs v's head dim == q's (the pooled "
                f"values/outputs are the second level's keys), got {v.shape[-1]} and {d}")
        keep = (torch.ones(b, n, dtype=torch.bool, device=q.device) if ctx.key_mask is None
                else ctx.key_mask.to(device=q.device, dtype=torch.bool).expand(b, n))
        first = self.level1(q, k, v, ctx)
        y = first.out  # [b,h,n,dv]
        p = ctx.dropout if self.training else 0.0
        spans: list[torch.Tensor] = []  # count [b,S], start [S], end [b,S]: the same per group

        def level2(*parts) -> AttnOutput:
            """Level 2 for a group of g heads; parts: (y,) stacked or (q, k, v), then the
            group's conv kernel [g,dv,kappa] when pool="conv"."""
            q2, k2, v2 = parts[:3] if not c.stacked else parts[:1] * 3
            pw = parts[-1] if self.pool_weight is not None else None
            ks, count, start, end = pool_slots(k2, keep, c.pool_size, self.stride, c.pool,
                                               pw)  # [b,g,S,d]
            vs = ks if c.stacked else pool_slots(v2, keep, c.pool_size, self.stride, c.pool,
                                                 pw)[0]  # [b,g,S,dv]
            spans[:] = [count, start, end]
            z, slot_p = slot_attention(q2, ks, vs, count > 0, start, end, window2=c.window2,
                                       stride=self.stride, causal=ctx.causal,
                                       scale=ctx.scale_for(d), p=p,
                                       dense_probs=ctx.need_weights)
            return AttnOutput(z, slot_p)  # [b,g,n,dv], [b,g,n,S] or None

        # Level 2's per-block key sets [b,h,nb,W,d] and scores [b,h,nb,bq,W] grow with n:
        # a few heads at a time keep them small (core/slicing.py); heads are independent.
        per_head = b * n * ((SLOT_BLOCK + 2 * c.window2) // self.stride + 1) * 4
        second = over_head_groups(level2, (y,) if c.stacked else (q, k, v), per_head,
                                  per_head=() if self.pool_weight is None
                                  else (self.pool_weight,))
        z, slot_p = second.out, second.probs
        count, start, end = spans
        weights = None
        if ctx.need_weights:
            assert first.probs is not None and slot_p is not None
            tok = torch.arange(n, device=q.device)[None, :]  # [1,n]
            span = (tok >= start[:, None])[None] & (tok <= end[:, :, None])  # [b,S,n]
            member = (span & keep[:, None, :]).to(slot_p.dtype)  # [b,S,n]
            pool_mat = member / count.clamp(min=1)[:, :, None].to(slot_p.dtype)
            via = slot_p @ pool_mat[:, None]  # [b,h,n,n]
            weights = first.probs + (via @ first.probs if c.stacked else via)
        return AttnOutput(y + z, weights)
