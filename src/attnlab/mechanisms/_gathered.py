"""Exact softmax attention over per-query key sets given by index, in O(n * K) memory.

Query i attends the K keys ``keys[idx[i, x]]`` (x = 0..K-1) where ``allowed[i, x]``. A
plain implementation gathers [b, h, n, K, d] copies of the keys and values and autograd
keeps them for the backward: at n = 8192, K = 69, h = 12 that is 1.7 GB per tensor.
Here queries run in chunks of rows, the gathers of one chunk stay small (``CHUNK_BYTES``),
and the backward (``_GatheredAttention``) recomputes them chunk by chunk from q, keys,
values, the output and the row log-sum-exp (flash-attention style), adding the key and
value gradients into one buffer with ``index_add_``. Used by ``bp_tree`` and by the sparse
patterns whose keys differ per query (``random``, ``sparse_transformer``: ``sparse.py``);
tested against autograd through the gathered computation (tests/mechanisms/test_gathered.py)
and, through those patterns, against the dense reference (tests/mechanisms/test_sparse.py).
"""

from __future__ import annotations

import torch

from ._blockbias import _neg

# Bytes of one chunk's gathered keys (b*h*rows*K*d fp32): small enough for the cache and
# below glibc's mmap threshold, large enough that the per-chunk overhead does not matter.
CHUNK_BYTES = 8 << 20


def _rows(b: int, h: int, n: int, k: int, d: int) -> int:
    return max(1, min(n, CHUNK_BYTES // max(1, 4 * b * h * k * d)))


def _keep_mask(like: torch.Tensor, p: float, seed: int, chunk: int) -> torch.Tensor:
    """Dropout keep-mask / (1 - p), regenerated identically in the backward."""
    g = torch.Generator(device=like.device).manual_seed(seed * 1_000_003 + chunk)
    return torch.empty_like(like).bernoulli_(1.0 - p, generator=g).div_(1.0 - p)


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[:, :, idx] for x [b,h,M,e] and idx [c,K]: [b,h,c,K,e]. A contiguous x (bp_tree's
    node keys) is copied as whole rows of its flat [b*h*M, e] view with ``index_select``
    (~5x faster than advanced indexing on dim 2 at 4096 keys); a strided one (a host's
    heads, [b, n, h, d] transposed) keeps advanced indexing, which is as fast there."""
    b, h, m, e = x.shape
    if not x.is_contiguous():  # not copied: the caller's tensors are saved as they are
        return x[:, :, idx]
    base = torch.arange(0, b * h * m, m, device=idx.device).view(b * h, 1)
    rows = (idx.reshape(1, -1) + base).view(-1)  # [b*h*c*K]
    return x.view(b * h * m, e).index_select(0, rows).view(b, h, *idx.shape, e)


def _probs(q, keys, idx, allowed, scale: float, lse=None):
    """Scores of one chunk [b,h,c,K] -> (probs with dead rows zeroed, lse, gathered keys)."""
    kx = _take(keys, idx)  # [b,h,c,K,d]
    s = (q.unsqueeze(-2) @ kx.transpose(-1, -2)).squeeze(-2).mul_(scale)  # [b,h,c,K]
    s.masked_fill_(~allowed, _neg(s.dtype))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)  # [b,h,c]
    prob = torch.exp(s.sub_(lse.unsqueeze(-1)))
    prob.mul_(allowed.any(-1, keepdim=True))  # rows with no allowed key -> 0
    return prob, lse, kx


def _rows_major(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w [b,h,c,K], x [b,h,c,e] -> w[..., None] * x[..., None, :] as contiguous rows
    [c*K, b, h, e] (the layout index_add_ over dim 0 adds fastest)."""
    b, h, c, k = w.shape
    out = x.new_empty(c, k, b, h, x.shape[-1])  # [c,K,b,h,e]
    torch.mul(w.permute(2, 3, 0, 1)[..., None], x.permute(2, 0, 1, 3)[:, None], out=out)
    return out.view(c * k, b, h, -1)


class _GatheredAttention(torch.autograd.Function):
    """q [b,h,n,d], keys [b,h,M,d], vals [b,h,M,dv], idx [n,K] long in [0, M), allowed
    [b|1,1,n,K] bool -> out [b,h,n,dv]."""

    @staticmethod
    def forward(ctx, q, keys, vals, idx, allowed, scale: float, p: float, seed: int):
        b, h, n, d = q.shape
        rows = _rows(b, h, n, idx.shape[1], max(d, vals.shape[-1]))
        out = q.new_empty(b, h, n, vals.shape[-1])  # [b,h,n,dv]
        lse = q.new_empty(b, h, n)  # [b,h,n]
        for ci, r0 in enumerate(range(0, n, rows)):
            r1 = min(n, r0 + rows)
            ix = idx[r0:r1]  # [c,K]
            prob, lse[:, :, r0:r1], _ = _probs(q[:, :, r0:r1], keys, ix, allowed[:, :, r0:r1],
                                               scale)
            if p > 0:
                prob.mul_(_keep_mask(prob, p, seed, ci))
            out[:, :, r0:r1] = (prob.unsqueeze(-2) @ _take(vals, ix)).squeeze(-2)
        ctx.save_for_backward(q, keys, vals, idx, allowed, out, lse)
        ctx.cfg = (rows, scale, p, seed)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, keys, vals, idx, allowed, out, lse = ctx.saved_tensors
        rows, scale, p, seed = ctx.cfg
        b, h, n, _ = q.shape
        dq = torch.empty_like(q)
        # key/value gradients accumulate row-major, [M, b, h, d]: index_add_ over dim 0 then
        # adds whole contiguous rows (over dim 2 of [b,h,M,d] its slices are strided and it
        # falls back to a far slower scatter)
        dkeys = keys.new_zeros(keys.shape[2], b, h, keys.shape[3])  # [M,b,h,d]
        dvals = vals.new_zeros(vals.shape[2], b, h, vals.shape[3])  # [M,b,h,dv]
        for ci, r0 in enumerate(range(0, n, rows)):
            r1 = min(n, r0 + rows)
            ix, qc, g = idx[r0:r1], q[:, :, r0:r1], grad[:, :, r0:r1]  # g [b,h,c,dv]
            prob, _, kx = _probs(qc, keys, ix, allowed[:, :, r0:r1], scale, lse[:, :, r0:r1])
            vx = _take(vals, ix)  # [b,h,c,K,dv]
            dprob = (g.unsqueeze(-2) @ vx.transpose(-1, -2)).squeeze(-2)  # [b,h,c,K]
            used = prob
            if p > 0:
                keep = _keep_mask(prob, p, seed, ci)
                dprob.mul_(keep)
                used = prob * keep
            delta = (g * out[:, :, r0:r1]).sum(-1, keepdim=True)  # [b,h,c,1]
            ds = dprob.sub_(delta).mul_(prob).mul_(scale)  # [b,h,c,K]
            dq[:, :, r0:r1] = (ds.unsqueeze(-2) @ kx).squeeze(-2)
            flat = ix.reshape(-1)  # [c*K]
            dkeys.index_add_(0, flat, _rows_major(ds, qc))
            dvals.index_add_(0, flat, _rows_major(used, g))
        return (dq, dkeys.permute(1, 2, 0, 3), dvals.permute(1, 2, 0, 3),
                None, None, None, None, None)


def gathered_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                       idx: torch.Tensor, allowed: torch.Tensor, *, scale: float,
                       dropout: float = 0.0) -> torch.Tensor:
    """softmax_x(q_i . keys[idx[i, x]] * scale | allowed) @ vals[idx[i, x]]: [b,h,n,dv].

    idx [n, K] (entries must be valid indices; mask unused slots with ``allowed``), allowed
    [b|1, 1, n, K]. Rows with no allowed key give 0. ``dropout`` > 0 drops probabilities
    (the caller passes 0 in eval mode).
    """
    seed = int(torch.randint(0, 2**31 - 1, ())) if dropout > 0 else 0
    return _GatheredAttention.apply(q, keys, vals, idx, allowed, scale, dropout, seed)
