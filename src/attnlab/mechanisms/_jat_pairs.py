"""Exact jump-link counts on candidate pairs, without sorting (``_jat_adjacency``'s
``pairs`` counter; decision 42).

For key k and row i the strongest partner of a = S[i, k] in column k is the column's
largest score (a > 0) or its smallest (a <= 0): the strength is monotone in the partner,
rounding and ``sign`` included. So i can link through k only if the exact predicate holds
against that extreme (a candidate), and two linked rows are both candidates of k
(a * b == b * a in floating point): the links are decided on each column's candidate
pairs. Shape glossary: g = flattened batch x heads, n = length, C candidates, P pairs.
"""

from __future__ import annotations

import torch

from ._jat_strength import jump_strength


def _candidates(x: torch.Tensor, key_len: torch.Tensor, head_dim: int, rho: float,
                sign: bool, ok: torch.Tensor | None, limit: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The (g, i, k) where row i may link to some row through key k (module docstring):
    three int64 [C] index tensors (head, row i, key k), ordered by column (g, k), then i.
    None when the entries past the bounds below would make more than ``limit`` pairs
    (sum over columns of their count squared; those that fail the exact test are few).

    x [g, n, n] clean scores (rows i, columns k), key_len [g, n], ok [g, n] bool or None
    (padding is never a candidate, as key or as row). The strongest partner of a = S[i, k]
    in column k is its largest score when a > 0 and its smallest when a <= 0
    (``jump_strength`` is monotone in b, rounding and ``sign`` included), so a candidate is
    one where the exact predicate holds against that partner. With rho > 0 the exact test
    runs only on the entries past a per-column bound on a: |a| >= rho d len_k / |partner|
    relaxed by 1/16, which holds wherever the predicate does (three roundings of at most
    2^-8 each, in bfloat16; at most the overflow of a * b to infinity, hence the cap at the
    dtype's largest value; normal numbers throughout, as rho >= 1e3 x the smallest normal),
    so the O(n^2) part is two comparisons per score entry.
    """
    g, n, _ = x.shape
    top = x.amax(dim=1, keepdim=True)  # [g, 1, k] each column's largest score
    low = x.amin(dim=1, keepdim=True)  # [g, 1, k] and its smallest
    info = torch.finfo(x.dtype)
    if rho >= 1e3 * info.tiny:  # only a > 0 with top, or a < 0 with low < 0, can link
        lk = key_len[:, None, :]
        strongest = torch.maximum(jump_strength(top, top, lk, head_dim, sign),
                                  jump_strength(low, low, lk, head_dim, sign))
        if not bool((strongest >= rho).any()):  # as ``may_link``: no column can link
            none = torch.empty(0, dtype=torch.long, device=x.device)
            return none, none, none
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        need = (rho * head_dim) * key_len[:, None, :].to(wide) * (1 - 1 / 16)  # [g, 1, k]
        need = need.clamp(max=info.max * (1 - 1 / 16))  # a * b past it rounds to inf
        inf = torch.full((), float("inf"), dtype=wide, device=x.device)
        hi = torch.where(top > 0, need / top.to(wide), inf).to(x.dtype)
        lo = -inf if sign else torch.where(low < 0, need / low.to(wide), -inf)
        near = (x >= hi) | (x <= lo.to(x.dtype))  # a superset of the candidates
        if limit is not None and int(torch.count_nonzero(near)) ** 2 > limit * g * n:
            return None  # even spread evenly over the g n columns: too many pairs
        gi, ii, ki = near.nonzero(as_tuple=True)
        if limit is not None:
            per_column = torch.bincount(gi * n + ki, minlength=g * n)  # [g n]
            if int((per_column * per_column).sum()) > limit:
                return None  # dense links: the sorted ranges cost less
    else:  # every entry may link (and subnormal strengths round too coarsely to bound)
        gi, ii, ki = (t.reshape(-1) for t in torch.meshgrid(
            *(torch.arange(s, device=x.device) for s in (g, n, n)), indexing="ij"))
    a = x[gi, ii, ki]  # S[i, k]
    partner = torch.where(a > 0, top[gi, 0, ki], low[gi, 0, ki])
    keep = jump_strength(a, partner, key_len[gi, ki], head_dim, sign) >= rho
    if ok is not None:
        keep &= ok[gi, ii] & ok[gi, ki]
    gi, ii, ki = gi[keep], ii[keep], ki[keep]
    order = torch.argsort((gi * n + ki) * n + ii)  # by column, then row
    return gi[order], ii[order], ki[order]


def _count_pairs(out: torch.Tensor, x: torch.Tensor, key_len: torch.Tensor,
                 cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor], head_dim: int,
                 rho: float, sign: bool, limit: float | None, chunk: int) -> bool:
    """Adds the links among each column's candidates into ``out`` [g, n, n] int32.

    x [g, n, n] clean scores, key_len [g, n], cand from ``_candidates`` (not empty). Every
    pair (i, j) of candidates of column k (i == j included) is decided by the exact
    predicate ``jump_strength(S[i, k], S[j, k]) >= rho``; pairs that are not both
    candidates cannot link (module docstring). Returns False, leaving ``out`` untouched,
    when the pairs number more than ``limit``. Work and memory: O(pairs) in chunks of
    about ``chunk`` pairs (whole columns).
    """
    n = x.shape[-1]
    dev = x.device
    gi, ii, ki = cand
    _, m = torch.unique_consecutive(gi * n + ki, return_counts=True)  # per column [R]
    ends = (m * m).cumsum(0)  # pairs up to and including each column
    if limit is not None and int(ends[-1]) > limit:
        return False
    a = x[gi, ii, ki]  # S[i, k] of each candidate [C]
    klen = key_len[gi, ki]  # len_k [C]
    row = (gi * n + ii) * n  # start of row i of ``out``, flattened [C]
    start = m.cumsum(0) - m  # first candidate of each column [R]
    flat = out.view(-1)
    r0 = 0
    while r0 < m.numel():  # whole columns, about ``chunk`` pairs at a time
        done = int(ends[r0 - 1]) if r0 else 0
        cut = torch.tensor(done + chunk, device=dev)
        r1 = max(int(torch.searchsorted(ends, cut, right=True)), r0 + 1)
        mc = m[r0:r1]
        c0, c1 = int(start[r0]), int(start[r1 - 1] + m[r1 - 1])
        reps = torch.repeat_interleave(mc, mc)  # size of each candidate's column [Cc]
        first = torch.repeat_interleave(torch.arange(c0, c1, device=dev), reps,
                                        output_size=int(ends[r1 - 1]) - done)  # [Pc]
        offset = (reps.cumsum(0) - reps)[first - c0]  # first pair of ``first`` [Pc]
        own = torch.repeat_interleave(start[r0:r1], mc)[first - c0]  # its column's start
        second = own + torch.arange(first.numel(), device=dev) - offset  # [Pc]
        r0 = r1
        link = jump_strength(a[first], a[second], klen[first], head_dim, sign) >= rho
        idx = row[first[link]] + ii[second[link]]  # (g, i, j) of each link, flattened
        flat.index_put_((idx,), torch.ones_like(idx, dtype=flat.dtype), accumulate=True)
    return True
