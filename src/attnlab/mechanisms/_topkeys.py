"""Attention of each query over its own k gathered keys, with a backward that gathers again.

``improved_clustered`` (Vyas et al. 2020, "Fast Transformers with Clustered Attention",
§3.3) re-weights, for every query, the top-k keys of its cluster: out_i = sum_k w_ik
v_(idx_ik), w_i = mass_i * softmax_k(q_i . k_(idx_ik) * scale) over the allowed k.
Written with autograd, the gathered keys and values [b, h, n, k, d] are saved for the
backward: at n = 16384, k = 32, d = 64 and 12 heads that is 3.2 GB (4-byte floats),
and the forward+backward peak was 3522 MB. Here the forward saves only the weights'
softmax [b, h, n, k] and the indices; the backward gathers the keys and values again (one
gather each, the forward's cost) for the group of heads it runs on: 462 MB (the map
section of docs/benchmarks.md).

Shapes: b batch, h heads (a group of them), n queries, m keys, k keys per query, d key
and dv value head dims.
"""

from __future__ import annotations

import torch

from ..core import masked_softmax


def _rows(idx: torch.Tensor, m: int) -> torch.Tensor:
    """idx [b, h, n, k] (rows of each [m, e] slice) -> the same rows of the flat
    [b*h*m, e] view, [b, h, n, k]."""
    b, h = idx.shape[:2]
    return idx + torch.arange(0, b * h * m, m, device=idx.device).view(b, h, 1, 1)


def _gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` [b, h, n, k] (``_rows``) of x [b, h, m, e] -> [b, h, n, k, e]: whole
    rows copied with ``index_select`` (an element-wise ``gather`` with an expanded index
    was ~4x slower)."""
    e = x.shape[-1]
    return x.reshape(-1, e).index_select(0, rows.view(-1)).view(*rows.shape, e)


def _scatter_add(like: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Adjoint of ``_gather``: zeros like ``like`` [b, h, m, e] with vals [b, h, n, k, e]
    added at ``rows`` (``index_add_`` of whole rows)."""
    e = vals.shape[-1]
    out = like.new_zeros(like.numel() // e, e)
    out.index_add_(0, rows.view(-1), vals.reshape(-1, e))
    return out.view(like.shape)


class TopKeysAttention(torch.autograd.Function):
    """out [b, h, n, dv] = sum_k (mass * softmax_ok(q . K_top * scale) * keep)_k V_top,k.

    Inputs: q [b, h, n, d], k [b, h, m, d], v [b, h, m, dv]; idx [b, h, n, k] long (the
    keys of each query); ok [b, h, n, k] bool (allowed: a row with none gets 0); mass
    [b, h, n, 1] (differentiable); scale; keep [b, h, n, k] or None (the attention-dropout
    keep-mask divided by 1 - p, drawn by the caller). Gradients for q, k, v and mass.
    """

    @staticmethod
    def forward(ctx, q, k, v, idx, ok, mass, scale: float, keep):
        idx = _rows(idx, k.shape[2])  # [b,h,n,k] rows of the flat [b*h*m, d] views
        s = torch.einsum("bhnd,bhnkd->bhnk", q, _gather(k, idx)) * scale  # [b,h,n,k]
        sm = masked_softmax(s, ok)  # [b,h,n,k]
        a = sm * mass
        if keep is not None:
            a = a * keep
        out = torch.einsum("bhnk,bhnke->bhne", a, _gather(v, idx))
        ctx.save_for_backward(q, k, v, idx, sm, mass, keep)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, idx, sm, mass, keep = ctx.saved_tensors
        da = torch.einsum("bhne,bhnke->bhnk", g, _gather(v, idx))  # dL/d(weights used)
        a = sm * mass
        if keep is not None:
            a, da = a * keep, da * keep  # the weights that multiplied V; dL/d(sm * mass)
        dv = _scatter_add(v, idx, a[..., None] * g[:, :, :, None, :])
        dmass = (da * sm).sum(-1, keepdim=True)
        dsm = da * mass
        ds = sm * (dsm - (dsm * sm).sum(-1, keepdim=True)) * ctx.scale  # masked: sm = 0
        dq = torch.einsum("bhnk,bhnkd->bhnd", ds, _gather(k, idx))
        dk = _scatter_add(k, idx, ds[..., None] * q[:, :, :, None, :])
        return dq, dk, dv, None, None, dmass, None, None
