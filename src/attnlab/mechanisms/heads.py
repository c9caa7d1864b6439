"""Multi-head changes: heads that talk to each other, and heads that share K/V."""

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
)
from ._rowchunks import allowed_pairs, draws_dropout, in_row_chunks
from .heads_structure import GroupedQuery, GroupedQueryConfig

# ----------------------------------------------------------------------------- talking heads


@dataclass(frozen=True, kw_only=True)
class TalkingHeadsConfig(MechanismConfig):
    name: ClassVar[str] = "talking_heads"
    init: Literal["identity", "random"] = "identity"  # init of P_l, P_w [h,h]


@register_mechanism(TalkingHeadsConfig)
class TalkingHeads(nn.Module):
    """Talking-heads attention: learned mixing across heads before and after the softmax.

    Paper: Shazeer, Lan, Cheng, Ding, Hou, "Talking-Heads Attention", arXiv 2003.02436,
    2020.
    Formula: J = Q K^T / sqrt(d) [b,h,n,m]; J' = einsum(J, P_l) (J'_g = sum_h J_h P_l[h,g]);
    W = softmax(J' + mask); W' = einsum(W, P_w); out = W' V. P_l, P_w are [h,h] (the
    paper allows h_k, h, h_v to differ; here all equal the host's head count so the
    host's projections are unchanged). Complexity O(n*m*h) per head (O(h^2*n*m) per
    layer for the two mixes on top of softmax attention's O(h*n*m*d)).
    Init (deviation): ``init="identity"`` (default) sets P_l = P_w = I so that inserting
    the mechanism into a pretrained model leaves it unchanged until P_l, P_w are trained;
    the paper learns P_l, P_w from a random init. ``init="random"`` follows the TF Model
    Garden implementation (Glorot-uniform on each [h,h] matrix).
    Masks apply to J' before the softmax, so padded keys get W = 0 and hence W' = 0;
    rows with no visible key give 0. Dropout ``ctx.dropout`` applies to W' (the weights
    that multiply V, as in TF Model Garden). ``need_weights`` returns W' [b,h,n,m], which
    need not be positive or sum to 1. Scope "layer": it mixes every head of its layer.
    Memory: without ``need_weights`` the rows run in chunks under activation checkpoints
    (``_rowchunks``), so training keeps no [b, h, n, m] tensor; each row's arithmetic is
    unchanged.
    """

    example: ClassVar[str] = "talking_heads"
    caps: ClassVar[Capabilities] = Capabilities(
        family="heads", paper="Shazeer et al. 2020", scope="layer", exact=False,
        complexity="O(n*m*h)",
    )

    def __init__(self, cfg: TalkingHeadsConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h = dims.num_heads
        self.P_l = nn.Parameter(torch.empty(h, h))  # [h,h] pre-softmax (logits) mix
        self.P_w = nn.Parameter(torch.empty(h, h))  # [h,h] post-softmax (weights) mix
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in (self.P_l, self.P_w):
                if self.cfg.init == "identity":
                    nn.init.eye_(p)
                else:
                    nn.init.xavier_uniform_(p)

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
              first_row: int, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [b,h,c,dv], W' [b,h,c,m]) of query rows first_row .. of num_queries (q
        [b,h,c,d]: those rows)."""
        logits = (q @ k.transpose(-1, -2)) * ctx.scale_for(q.shape[-1])  # J [b,h,c,m]
        logits = torch.einsum("bhnm,hg->bgnm", logits, self.P_l.to(logits.dtype))  # J'
        allowed = allowed_pairs(ctx, logits.shape, q.device, first_row, num_queries)
        w = masked_softmax(logits, allowed)  # W [b,h,c,m]
        w = torch.einsum("bhnm,hg->bgnm", w, self.P_w.to(w.dtype))  # W' [b,h,c,m]
        wd = F.dropout(w, ctx.dropout, training=True) if self.training and ctx.dropout else w
        return wd @ v.to(wd.dtype), w  # [b,h,c,dv]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        n, m = q.shape[-2], k.shape[-2]
        if ctx.need_weights:
            out, w = self._rows(q, k, v, ctx, 0, n)
            return AttnOutput(out, w)
        # the query rows in checkpointed chunks: training keeps no [b,h,n,m] (_rowchunks)
        out = in_row_chunks(lambda r0, qc: self._rows(qc, k, v, ctx, r0, n)[0], q, m,
                            dropout=draws_dropout(ctx, self.training))
        return AttnOutput(out)


# ------------------------------------------------------------------------- multi-query


@dataclass(frozen=True, kw_only=True)
class MultiQueryConfig(MechanismConfig):
    name: ClassVar[str] = "mqa"


@register_mechanism(MultiQueryConfig)
class MultiQuery(nn.Module):
    """Multi-query attention: every query head attends over one shared K/V head.

    Paper: Shazeer, "Fast Transformer Decoding: One Write-Head is All You Need", arXiv
    1911.02150, 2019. Conversion of a multi-head checkpoint: Ainslie et al., "GQA:
    Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints",
    EMNLP 2023 (mean-pool the K/V projection heads, then "uptrain").
    Formula: out_i = softmax(q_i K^T / sqrt(d)) V with one K [b,1,m,d], V [b,1,m,dv]
    shared by all h query heads. Complexity O(n*m) per head; K/V projections and cache
    shrink h-fold.
    This is ``gqa`` with g = 1 (heads_structure.GroupedQuery does the work): scope
    "module" with ``caps.kv_heads = 1``, surgery shrinks the host's K/V projections to one
    head (weights mean-pooled over heads), so k, v arrive with one head; k, v with h heads
    are accepted too and mean-pooled over heads, the same conversion applied to the
    projected tensors (the projection is linear).
    """

    example: ClassVar[str] = "mqa"
    caps: ClassVar[Capabilities] = Capabilities(
        family="heads", paper="Shazeer 2019", scope="module", kv_heads=1, exact=False,
        complexity="O(n*m)",
    )

    def __init__(self, cfg: MultiQueryConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.attend = GroupedQuery(GroupedQueryConfig(kv_heads=1), dims)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return self.attend(q, k, v, ctx)  # [b,h,n,dv]
