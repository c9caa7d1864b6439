"""The dense-link back end of JAT's exact counts (``_jat_adjacency``'s ``compare``):
every (i, j, k) decided from the sorted ranges by integer arithmetic on ranks, O(n^3)
time with a small constant and O(n^2) memory. Returns int32 counts [g, i, j].

Shape glossary: g = flattened batch x heads, n = length (queries = keys), k key, t sorted
position of a column.
"""

from __future__ import annotations

import torch


def count_compare(p: torch.Tensor, prefix: torch.Tensor, perm: torch.Tensor,
                  empty: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """O(n^3) integer comparisons: j is linked to i through k iff rank_k(j) is in range.

    j is in i's range of column k iff rank_k(j) >= p (a suffix) or rank_k(j) < p (a
    prefix); an empty range (padding) is the suffix from n. With s = clamp(rank - p, -1,
    0), -1 where rank < p and 0 elsewhere, ``s ^ -1`` (suffix) or ``s`` (prefix) is -1
    exactly where linked, so the counts are minus their sum over k, summed in the ranks'
    own integer type (a count is at most n): a subtraction, two in-place ops and a sum,
    with no bool tensor and no widening copy. The counts are symmetric (S[i,k] S[j,k] ==
    S[j,k] S[i,k] in floating point, and the ranges are decided by that exact
    predicate): rows i0.. compare only the columns j >= i0, half the comparisons, and the
    lower triangle is the upper's transpose.

    p [g, k, i] range starts, prefix [g, k, i] bool, perm [g, k, t] (``_boundaries``),
    empty [g, k, i] bool or None (no range). Blocks hold about ``chunk`` elements: on the
    CPU small, so that each stays in cache; on a GPU large, few kernels.
    When a whole head fits a chunk (short inputs) several heads go in one block, so a batch
    of short sentences is a handful of operations rather than a loop over b x h heads.
    """
    g, n, _ = p.shape
    rdt = torch.int16 if n < 2**15 else torch.int32
    dev = p.device
    ranks = torch.empty(g, n, n, dtype=rdt, device=dev)  # ranks[g, k, j]: position of j in k
    ranks.scatter_(2, perm, torch.arange(n, dtype=rdt, device=dev).expand(g, n, n))
    flip = torch.where(prefix, 0, -1).to(rdt)  # XOR mask: -1 for a suffix
    start = p
    if empty is not None:
        flip = flip.masked_fill(empty, -1)
        start = start.masked_fill(empty, n)
    flip = flip.transpose(1, 2).contiguous()[..., None]  # [g, i, k, 1]
    start = start.to(rdt).transpose(1, 2).contiguous()[..., None]  # [g, i, k, 1]

    def minus_linked(r: torch.Tensor, at: tuple) -> torch.Tensor:
        x = r - start[at]  # r [..., k, j] against the rows' starts [..., c, k, 1]
        x.clamp_(-1, 0).bitwise_xor_(flip[at])  # -1 where linked, else 0
        return x

    counts = torch.empty(g, n, n, dtype=torch.int32, device=dev)
    if n**3 <= chunk:  # short sequences: whole heads per block, few (GPU: few kernels) blocks
        heads = chunk // n**3
        for g0 in range(0, g, heads):
            sl = slice(g0, g0 + heads)
            x = minus_linked(ranks[sl, None], (sl,))  # [gc, i, k, j]
            counts[sl] = x.sum(2, dtype=rdt).neg_()
        return counts
    for gi in range(g):
        r = ranks[gi][None]  # [1, k, j]
        i0 = 0
        while i0 < n:
            i1 = min(n, i0 + max(1, chunk // (n * (n - i0))))
            x = minus_linked(r[..., i0:], (gi, slice(i0, i1)))  # [c, k, j >= i0]
            counts[gi, i0:i1, i0:] = x.sum(1, dtype=rdt).neg_()
            i0 = i1
        upper = counts[gi].triu()
        counts[gi] = upper + upper.triu(1).T
    return counts
