"""Content-based sparse attention with a learned edge predictor.

``sac``: Sparse Adaptive Connection, an MLP scores every (query, key) edge from [q_i; k_j]
and each query keeps its top-k edges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    accumulation_dtype,
    causal_mask,
    check_qkv,
    masked_softmax,
    register_mechanism,
)

# Hidden-layer entries [b, h, rows, m, H] the edge scoring holds at once without gradient
# (1 Mi fp32 = 4 MB).
SCORE_CHUNK_ELEMS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SACConfig(MechanismConfig):
    name: ClassVar[str] = "sac"
    k: int = 8  # k: edges (keys) kept per query, the top-k of the predictor's scores
    predictor: Literal["mlp"] = "mlp"  # edge predictor f([q_i; k_j]) (the paper's LSTM: not here)
    hidden: int = 16  # width of the predictor MLP's hidden layer

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1 (edges kept per query), got {self.k}")
        if self.predictor != "mlp":
            raise ValueError(
                f"predictor must be 'mlp' (the only edge predictor implemented), "
                f"got {self.predictor!r}"
            )
        if self.hidden < 1:
            raise ValueError(f"hidden must be >= 1 (predictor MLP width), got {self.hidden}")


def sac_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    edge_scores: torch.Tensor,
    *,
    top_k: int,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over each query's top-k predicted edges; returns (out [b,h,n,dv], probs [b,h,n,m]).

    q [b,h,n,d], k [b,h,m,d], v [b,h,m,dv]; edge_scores e [b,h,n,m] from the predictor.
    Allowed edges: unpadded keys (and j <= i when causal, queries aligned to the last n keys).
    M = top-k of e among allowed edges (ties: torch.topk). p = softmax(q.k * scale) over M.
    Straight-through: out = sum_j p_ij * (M_ij + s_ij - sg(s_ij)) v_j, s = sigmoid(e), sg =
    stop-gradient: the value is exactly p @ v, the gradient reaches e through s on kept edges.
    Rows with no allowed key give zeros. probs are the pre-dropout p.
    """
    b, h, n, d = q.shape
    m = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    allowed = torch.ones(b, 1, n, m, dtype=torch.bool, device=q.device)  # [b,1,n,m]
    if causal:
        allowed = allowed & causal_mask(n, m, q.device)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].to(torch.bool)
    allowed = allowed.expand(b, h, n, m)  # [b,h,n,m]
    kk = min(top_k, m)
    idx = edge_scores.detach().masked_fill(~allowed, float("-inf")).topk(kk, dim=-1).indices
    keep = torch.zeros_like(allowed).scatter(-1, idx, True) & allowed  # M [b,h,n,m]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b,h,n,m]
    probs = masked_softmax(scores, keep)  # [b,h,n,m]
    s = torch.sigmoid(edge_scores)  # [b,h,n,m]
    gate = keep.to(s.dtype) + s - s.detach()  # value M, gradient d s
    p = F.dropout(probs, dropout, training=True) if (training and dropout > 0) else probs
    return torch.matmul(p * gate, v), probs


@register_mechanism(SACConfig)
class SAC(nn.Module):
    """Sparse Adaptive Connection: a learned edge predictor picks each query's k keys.

    Paper: Li, Meng, Zhou, Han, Wu, Li, "SAC: Accelerating and Structuring Self-Attention via
    Sparse Adaptive Connection", NeurIPS 2020.
    Formula: edge score e_ij = w2 . relu(W1 [q_i; k_j] + b1) + b2 (one MLP shared by the
    heads); M_i = top-k_j e_ij over the allowed keys; o_i = sum_{j in M_i} softmax_j(q_i . k_j
    / sqrt(d)) v_j. Gradient to the predictor: straight-through, o_i = sum_j p_ij (M_ij +
    s_ij - sg(s_ij)) v_j with s = sigmoid(e) (forward value exactly the hard top-k; this
    straight-through estimator stands in for the paper's own training of the predictor).
    Complexity (scoring every candidate edge): O(n*m*(d + hidden)) time; memory O(n*k*(d +
    hidden)) without ``need_weights`` (``sparse_forward``: the edges scored in chunks of
    queries without gradient, the predictor recomputed with gradient on the k chosen edges,
    the only ones the gate passes a gradient to; the chosen edges' gathered rows are
    recomputed in the backward under an activation checkpoint), O(n*m*hidden) with it.
    Padding: padded keys are never chosen nor attended; a row with no valid key gives zeros.
    Causal: candidates restricted to j <= i before the top-k (scores of (i, j) depend on q_i
    and k_j only, so nothing leaks). Deviations: MLP predictor only (no LSTM); 16-bit inputs
    are computed in fp32. ``sac_attention`` is the functional form taking the edge scores.
    """

    example: ClassVar[str] = "sac(k=3, hidden=8)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="content", paper="Li et al. 2020", scope="head", causal_ok=True,
        key_mask_ok=True, exact=False, complexity="O(n*m*(d + hidden))",
    )

    def __init__(self, cfg: SACConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        d = dims.head_dim
        self.w_q = nn.Linear(d, cfg.hidden)  # W1's query half (with b1)
        self.w_k = nn.Linear(d, cfg.hidden, bias=False)  # W1's key half
        self.w_out = nn.Linear(cfg.hidden, 1)  # w2, b2

    def edge_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """e [b,h,n,m] = w2 . relu(W1 [q_i; k_j] + b1) + b2, computed in q's dtype."""
        dt = q.dtype
        hq, hk = self.hidden_parts(q, k)  # [b,h,n,H], [b,h,m,H]
        hid = torch.relu(hq[..., :, None, :] + hk[..., None, :, :])  # [b,h,n,m,H]
        return F.linear(hid, self.w_out.weight.to(dt), self.w_out.bias.to(dt))[..., 0]

    def hidden_parts(self, q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(W1_q q + b1 [b,h,n,H], W1_k k [b,h,m,H]): e_ij = w2 . relu(sum of rows i, j) + b2."""
        dt = q.dtype
        return (F.linear(q, self.w_q.weight.to(dt), self.w_q.bias.to(dt)),
                F.linear(k, self.w_k.weight.to(dt)))

    def select_edges(self, hq: torch.Tensor, hk: torch.Tensor, allowed: torch.Tensor
                     ) -> torch.Tensor:
        """The top-k allowed edges of each query by the predictor's score, [b,h,n,kk]
        (kk = min(k, m)), from ``hidden_parts``' hq [b,h,n,H] and hk [b,h,m,H], scored in
        chunks of queries without gradient: the [c, m, H] hidden layer of one chunk at a
        time instead of [n, m, H]. allowed [b,1|h,n,m]."""
        b, h, n, H = hq.shape
        m = hk.shape[2]
        kk = min(self.cfg.k, m)
        rows = max(1, SCORE_CHUNK_ELEMS // max(1, b * h * m * H))
        idx = torch.empty(b, h, n, kk, dtype=torch.long, device=hq.device)
        with torch.no_grad():
            hq, hk = hq.detach(), hk.detach()
            w2, b2 = self.w_out.weight.to(hq.dtype), self.w_out.bias.to(hq.dtype)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                hid = torch.relu(hq[:, :, r0:r1, None, :] + hk[:, :, None, :, :])  # [b,h,c,m,H]
                e = F.linear(hid, w2, b2)[..., 0]  # [b,h,c,m]
                e.masked_fill_(~allowed[:, :, r0:r1], float("-inf"))
                idx[:, :, r0:r1] = e.topk(kk, dim=-1).indices
        return idx

    def sparse_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       ctx: AttnContext) -> torch.Tensor:
        """``sac_attention``'s output over the k chosen edges alone, [b,h,n,dv]: the
        predictor scored in chunks without gradient (``select_edges``), then recomputed
        with gradient on the chosen edges only, the only ones the straight-through gate
        passes a gradient to. Memory O(n*k*(d + H)) instead of O(n*m*H)."""
        b, h, n, d = q.shape
        m = k.shape[2]
        allowed = torch.ones(b, 1, n, m, dtype=torch.bool, device=q.device)  # [b,1,n,m]
        if ctx.causal:
            allowed = allowed & causal_mask(n, m, q.device)
        if ctx.key_mask is not None:
            allowed = allowed & ctx.key_mask[:, None, None, :].to(torch.bool)
        hq, hk = self.hidden_parts(q, k)  # [b,h,n,H], [b,h,m,H]
        idx = self.select_edges(hq, hk, allowed)  # [b,h,n,kk]
        kk = idx.shape[-1]
        ok = allowed.expand(b, h, n, m).gather(3, idx)  # chosen and allowed [b,h,n,kk]
        drop = self.training and ctx.dropout > 0

        def rows(x: torch.Tensor) -> torch.Tensor:  # x [b,h,m,e] -> chosen rows [b,h,n,kk,e]
            flat = idx.reshape(b, h, n * kk, 1).expand(-1, -1, -1, x.shape[-1])
            return x.gather(2, flat).view(b, h, n, kk, x.shape[-1])

        def edges(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hq: torch.Tensor,
                  hk: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
            scores = torch.einsum("bhnd,bhnkd->bhnk", q, rows(k)) * ctx.scale_for(d)
            probs = masked_softmax(scores, ok)  # [b,h,n,kk]
            hid = torch.relu(hq[..., None, :] + rows(hk))  # [b,h,n,kk,H]
            e = F.linear(hid, w2.to(q.dtype), b2.to(q.dtype))[..., 0]
            s = torch.sigmoid(e)  # [b,h,n,kk]
            gate = ok.to(s.dtype) + s - s.detach()  # value M, gradient d s
            p = F.dropout(probs, ctx.dropout, training=True) if drop else probs
            return torch.einsum("bhnk,bhnke->bhne", p * gate, rows(v))  # [b,h,n,dv]

        args = (q, k, v, hq, hk, self.w_out.weight, self.w_out.bias)
        if not torch.is_grad_enabled():
            return edges(*args)
        # the chosen rows of k, v and hk ([b,h,n,kk,*] each) are gathered again in the
        # backward instead of kept: training keeps q, k, v, hq, hk and the indices
        return checkpoint(edges, *args, use_reentrant=False, preserve_rng_state=drop)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        dtype = q.dtype
        work = accumulation_dtype(dtype)
        qw, kw, vw = q.to(work), k.to(work), v.to(work)
        # in fp32 under autocast too: bf16 edge scores change the top-k edges
        with torch.autocast(q.device.type, enabled=False):
            if not ctx.need_weights:
                return AttnOutput(self.sparse_forward(qw, kw, vw, ctx).to(dtype))
            out, probs = sac_attention(
                qw, kw, vw, self.edge_scores(qw, kw), top_k=self.cfg.k, key_mask=ctx.key_mask,
                causal=ctx.causal, scale=ctx.scale_for(q.shape[3]), dropout=ctx.dropout,
                training=self.training,
            )
        return AttnOutput(out.to(dtype), probs.to(dtype) if ctx.need_weights else None)
