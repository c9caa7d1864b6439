"""Jump-link counts and the GCN adjacency of Jump Self-attention, without the n^3 tensor.

The official JAT code (github zhouhaoyi/JAT2022, ``get_attn_adj``) builds, per head, the
jump strength of every pair of queries (i, j) through every key k,

    U_k[i, j] = ((S[i, k] * S[j, k]) / len_k) / d,      len_k = max(||K_k||_2, 1),

as a [b, h, n, n, n] tensor (zeroed where both scores are negative when ``sign``), keeps
B_k = 1[U_k >= rho] and averages over k. Here the same integer counts
C[i, j] = sum_k B_k[i, j] are computed exactly, bit for bit, in O(n^2 + P) time when the
links are sparse (P candidate pairs, below) and O(n^2 log n + min(E, n^3)) otherwise, in
O(n^2) memory, where E is the number of jump links.

Why it is exact. For a fixed key k and query i, write a = S[i, k]. The strength, computed
with the very same float expression as the official code (``jump_strength``), is a
monotone function of b = S[j, k]: rounding is monotone, the divisors are positive, and the
``sign`` rule only moves values to 0 in the direction the monotonicity already goes. So,
with column k sorted, the j that pass the threshold form a suffix of the sorted column
(a > 0) or a prefix (a <= 0). Every boundary is decided *by the exact float predicate
itself*: ranges that are empty or full are settled at the two ends of the sorted column;
for the rest the position of the real-number threshold rho * d * len_k / a is only a
guess, kept where the predicate confirms it on both sides, and the few it misses (ties,
last-ulp rounding) get a binary search on the predicate. So ties at the threshold and
rounding are decided exactly as the naive form decides them.

Before any sort, the same monotonicity bounds each (i, k) by the column's extreme: the
strongest partner of a = S[i, k] > 0 is the column's largest score, of a <= 0 its
smallest, so i can link through k only if the exact predicate holds against that extreme
(a "candidate"). A linked pair (i, j) through k makes both i and j candidates of column k
(the strength is symmetric: a * b == b * a in floating point), so the links are found
among the candidate pairs of each column:

* ``pairs`` (``_jat_pairs``): evaluate the exact predicate on every pair of candidates of
  a column; O(n^2) for the bounds and O(P) for the P = sum_k m_k^2 pairs (m_k candidates
  in column k), no sort. With sparse links, the regime the threshold rho is meant for, P
  is tiny; ``auto`` takes it whenever P <= ``_PAIRS_PER_SCORE`` x the number of scores,
  else the sorted ranges below.

Counting the links from the sorted ranges has two exact back ends:

* ``enumerate``: list every j of every range (or of its complement, whichever is shorter)
  and ``bincount`` them; O(E) with E <= n^3 / 2. Fast when links are sparse, which is
  the regime the threshold rho is meant for.
* ``compare``: compare each key's rank of j against the range bound: n^3 / 2 integer
  comparisons (the counts are symmetric) in cache-sized blocks; O(n^3) time with a small
  constant, O(n^2) memory.
* ``auto`` picks ``enumerate`` when it lists fewer than ``_ENUM_FRACTION`` * n^3 entries.

Off the CPU one more back end exists: ``direct`` evaluates the official predicate on every
(k, i, j) in blocks of whole heads (O(n^3) work, O(block) memory, no sort and no
host-device synchronisation). The sorted-range path issues data-dependent sizes
(``nonzero``, a binary search loop), each a GPU -> host sync, which dominate a short
training batch on a GPU. ``auto`` takes ``direct`` on non-CPU devices for n <=
``_DIRECT_MAX_N``. It is the naive expression itself, so it is exact by construction.

Non-finite scores: NaN counts as 0 (as in the official code). The guarantee is for finite
scores and keys: with an infinite score the official strength of a zero score is
0 * inf = NaN, which no sorted range can express (seen in a check, not handled).

Shape glossary: g = flattened batch x heads, n = length (queries = keys = nodes).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from ._jat_compare import count_compare
from ._jat_pairs import _candidates, _count_pairs
from ._jat_strength import _clean, jump_strength
from ._jat_strength import key_length as key_length  # re-exported for jat and the tests

CountMethod = Literal["auto", "pairs", "enumerate", "compare", "direct"]

# ``auto`` enumerates links when that lists fewer entries than this fraction of n^3: on
# one core the two back ends cross between 0.3% and 1.7% of n^3 at n = 256 and 512
# (``scripts/jat_count_crossover.py``; ``compare`` costs about 0.5 ns per (i, j, k)).
_ENUM_FRACTION = 0.01
# Entries per enumeration chunk (int64 arrays of this length are the peak memory).
_ENUM_CHUNK = 1 << 22
# ``auto`` counts by candidate pairs when there are at most this many pairs per score entry
# (g x n x n): on one core (n = 256-1024, d = 64; ``scripts/jat_counter_costs.py``) a pair
# cost 38-63 ns and the sorted ranges 103-178 ns per score entry (sort, boundaries, links).
_PAIRS_PER_SCORE = 2.0
# Elements per comparison chunk ([rows, n, n] integers, or [heads, n, n, n] for short
# inputs): small, so that a block stays in cache.
_CMP_CHUNK = 1 << 19
# The same off the CPU: GPUs want few large kernels, not cache-sized blocks (not tuned: no
# GPU measurement of this value exists; 64 Mi int16 entries, ~0.3 GB temp).
_CMP_CHUNK_GPU = 1 << 26
# ``direct`` (GPU): elements of the [heads, k, i, j] strength block per kernel, and the
# longest input ``auto`` sends there (beyond it the O(n^2 log n + E) path wins on work).
_DIRECT_CHUNK = 1 << 25
_DIRECT_MAX_N = 256
# Score entries (g x n x n) handled per group of heads; bounds the working memory.
_GROUP = 1 << 22
# Use numpy for sorting and listing on CPU (faster; same integers). Tests switch it off to
# check the torch path that other devices take.
_NUMPY_ON_CPU = True


# ------------------------------------------------------------------------ naive reference


def naive_jump_counts(
    scores: torch.Tensor,
    key_len: torch.Tensor,
    head_dim: int,
    rho: float,
    sign: bool = False,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The official n^3 form: sum_k B_k as int64 [..., n, n] (the oracle of jump_counts).

    scores [..., n, n] (queries x keys), key_len [..., n], valid [..., n] bool or None
    (False = padding: excluded as key k and as row/column i, j).
    """
    x = _clean(scores)
    prod = torch.einsum("...yk,...zk->...kyz", x, x)  # [..., k, n, n]
    u = prod / key_len[..., :, None, None]
    if sign:
        neg = (x < 0).int()
        both = torch.einsum("...yk,...zk->...kyz", neg, neg).bool()
        u = u.masked_fill(both, 0.0)
    u = u / head_dim
    links = u >= rho  # B_k [..., k, n, n]
    if valid is not None:
        links = links & valid[..., :, None, None] & valid[..., None, :, None]
        links = links & valid[..., None, None, :]
    return links.sum(-3)


def naive_adjacency(
    scores: torch.Tensor, k: torch.Tensor, rho: float, sign: bool = False
) -> torch.Tensor:
    """Line-by-line port of the official ``get_attn_adj`` ([b, h, n, n, n] memory).

    Kept as the benchmark's baseline and a second oracle; no padding option (the official
    code has none).
    """
    a2 = _clean(scores)
    bs, he, lq, lk = a2.shape
    len_key = torch.clamp_min(torch.linalg.vector_norm(k.detach(), dim=-1, keepdim=True), 1.0)
    ak2 = torch.einsum("bhyk,bhzk->bhkyz", a2, a2) / len_key.unsqueeze(-1)
    if sign:
        sgn = (a2 < 0).int()
        ak2[torch.einsum("bhyk,bhzk->bhkyz", sgn, sgn).bool()] = 0
    ak2 = ak2 / k.shape[-1]
    index_1 = ak2 >= rho
    ak2[ak2 < rho] = 0
    ak2[index_1] = 1
    a2 = torch.mean(ak2, dim=2)
    dev = a2.device
    diag = torch.arange(lk, device=dev)
    a2[torch.arange(bs, device=dev)[:, None, None], torch.arange(he, device=dev)[None, :, None],
       torch.arange(lq, device=dev)[None, None, :], diag] = 1
    deg = a2.sum(-1)
    deg[deg <= 1e-4] = 1e-4
    dinv = torch.reciprocal(torch.sqrt(deg)).unsqueeze(-1)
    return torch.mul(torch.mul(dinv, a2), dinv.transpose(-1, -2))


# ----------------------------------------------------------------------- exact fast path


def _sort_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of ``a`` sorted along the last axis.

    On CPU, fp32/fp64 go through numpy's SIMD argsort (~10 ns per element on AVX-512
    against ~100 ns for ``torch.sort``). Order among equal values is irrelevant here: a
    range boundary never falls inside a run of equal values.
    """
    if _NUMPY_ON_CPU and a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64):
        perm = torch.from_numpy(np.argsort(a.numpy(), axis=-1))
        return a.gather(-1, perm), perm
    return a.sort(dim=-1)


def _boundaries(
    x: torch.Tensor, key_len: torch.Tensor, head_dim: int, rho: float, sign: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact range boundary per (g, k, i).

    x [g, n, n] scores (rows i, columns k), key_len [g, n]. Returns
    (p [g, k, i] int64, prefix [g, k, i] bool, perm [g, k, t]): the j linked to i through k
    are the sorted positions [p, n) of column k when not prefix, [0, p) when prefix;
    perm[g, k, t] is the row j at sorted position t of column k.

    The exact predicate is first evaluated at both ends of each sorted column: a range that
    is empty or full is settled there. For the rest, the position of the real-number
    threshold is a guess that is kept only where the exact predicate confirms it on both
    sides; the few it misses (ties, last-ulp rounding) get a binary search on the exact
    predicate. Every decision is the exact predicate's, whatever the guess.
    """
    g, n, _ = x.shape
    a = x.transpose(1, 2).contiguous()  # [g, k, i]: a[g, k, i] = S[i, k]
    col, perm = _sort_rows(a)  # [g, k, t] column k ascending, and its rows
    prefix = a <= 0  # a <= 0: strength non-increasing in b, links form a prefix
    lk = key_len[:, :, None]  # [g, k, 1]
    # f(t) = link(i, j at sorted position t) XOR prefix is non-decreasing in t; the
    # boundary p is the first t with f(t) true (n if none).
    f_lo = (jump_strength(a, col[..., :1], lk, head_dim, sign) >= rho) ^ prefix
    f_hi = (jump_strength(a, col[..., -1:], lk, head_dim, sign) >= rho) ^ prefix
    p = torch.where(f_lo, 0, n)  # f true everywhere -> 0; false everywhere -> n
    idx = (f_hi & ~f_lo).view(-1).nonzero().squeeze(-1)  # boundary strictly inside
    if idx.numel():
        flat_col = col.view(-1)  # column r = g * n + k starts at r * n
        rows = idx // n
        av, lv, pre = a.view(-1)[idx], key_len.reshape(-1)[rows], prefix.view(-1)[idx]
        base = rows * n

        def f(pos: torch.Tensor) -> torch.Tensor:
            b = flat_col.take(base + pos)
            return (jump_strength(av, b, lv, head_dim, sign) >= rho) ^ pre

        # Guess from the real-number threshold b* = rho * d * len_k / a (first b >= b*),
        # kept only where the exact predicate confirms it: f(p - 1) false and f(p) true.
        # The thresholds are taken in the column's sorted order (the same values: col is a
        # gathered), where they run monotone on each sign: consecutive binary searches then
        # take nearly the same path, which the CPU's branch predictor rewards.
        wide = torch.float64 if col.dtype == torch.float64 else torch.float32
        cw = col if col.dtype == wide else col.to(wide)
        t = torch.nan_to_num((rho * head_dim) * lk.to(wide) / cw)  # [g, k, t]
        guess = torch.empty_like(perm).scatter_(-1, perm, torch.searchsorted(cw, t))
        guess = guess.view(-1)[idx].clamp(1, n - 1)  # the boundary is in [1, n - 1]
        ok = f(guess) & ~f(guess - 1)
        p.view(-1)[idx[ok]] = guess[ok]
        miss = (~ok).nonzero().squeeze(-1)  # ties and last-ulp rounding: binary search
        if miss.numel():
            idx, base, av, lv, pre = idx[miss], base[miss], av[miss], lv[miss], pre[miss]
            lo = torch.ones_like(idx)  # f(0) is false, f(n - 1) is true: p in [1, n - 1]
            hi = torch.full_like(idx, n - 1)
            while bool((lo < hi).any()):
                mid = (lo + hi) >> 1
                f_mid = f(mid)
                hi = torch.where(f_mid, mid, hi)
                lo = torch.where(f_mid, lo, mid + 1)
            p.view(-1)[idx] = lo
    return p, prefix, perm


def jump_counts(
    scores: torch.Tensor,
    key_len: torch.Tensor,
    head_dim: int,
    rho: float,
    sign: bool = False,
    valid: torch.Tensor | None = None,
    method: CountMethod = "auto",
) -> torch.Tensor:
    """Exact sum_k B_k as int32 [..., n, n], equal to ``naive_jump_counts`` bit for bit.

    scores [..., n, n] (queries x keys, a square self-attention block), key_len [..., n]
    (``key_length(k)``), valid [..., n] bool or None (False = padding: excluded as key k and
    its rows/columns zeroed). NaN scores count as 0, as in the official code. Heads are
    processed in groups of about ``_GROUP`` score entries, which bounds the working memory
    beyond the int32 output to O(_GROUP) whatever the batch.
    """
    counts = jump_counts_or_none(scores, key_len, head_dim, rho, sign, valid, method)
    if counts is None:
        return torch.zeros(scores.shape, dtype=torch.int32, device=scores.device)
    return counts


def jump_counts_or_none(
    scores: torch.Tensor,
    key_len: torch.Tensor,
    head_dim: int,
    rho: float,
    sign: bool = False,
    valid: torch.Tensor | None = None,
    method: CountMethod = "auto",
) -> torch.Tensor | None:
    """``jump_counts``, or None when it finds that no head has a jump link (every count 0):
    then nothing is allocated, and a caller can write A_hat = I directly. The ``direct``
    counter returns its counts, zero or not.

    Under ``torch.compile`` it runs eagerly, outside the graph: integer work with no
    gradient, whose Python loops step by data-dependent sizes (traced with a symbolic n,
    their unrolled index arithmetic takes Dynamo minutes at n = 300)."""
    if torch.compiler.is_compiling():  # disabled here, not by a decorator, which would
        # import torch._dynamo (seconds) with attnlab
        return torch.compiler.disable(jump_counts_or_none)(scores, key_len, head_dim, rho,
                                                           sign, valid, method)
    if method not in ("auto", "pairs", "enumerate", "compare", "direct"):
        raise ValueError(f"unknown count method {method!r}; use 'auto', 'pairs', 'enumerate', "
                         "'compare' or 'direct'")
    *batch, n, m = scores.shape
    if n != m:
        raise ValueError(f"jump links need square scores (queries = keys), got {n} x {m}")
    x = _clean(scores).reshape(-1, n, n)  # [g, n, n]
    g = x.shape[0]
    lk = key_len.detach().to(x.dtype).expand(*batch, n).reshape(g, n)  # [g, n]
    ok = None if valid is None else valid.to(torch.bool).expand(*batch, n).reshape(g, n)
    if method == "direct" or (method == "auto" and direct_applies(x.device, n)):
        return _count_direct(x, lk, head_dim, rho, sign, ok).view(*batch, n, n)
    counts = None  # [g, n, n] int32, allocated at the first head group with a link
    # with rho <= 0 every pair may link: candidate pairs would be all n^3 triples
    pairs = method == "pairs" or (method == "auto" and rho >= 1e3 * torch.finfo(x.dtype).tiny)
    step = max(1, _GROUP // max(1, n * n))
    for g0 in range(0, g, step):
        sl = slice(g0, g0 + step)
        ok_sl = None if ok is None else ok[sl]
        if pairs:
            limit = None if method == "pairs" else _PAIRS_PER_SCORE * x[sl].numel()
            cand = _candidates(x[sl], lk[sl], head_dim, rho, sign, ok_sl, limit)  # (g, i, k)
            if cand is not None and not cand[0].numel():
                continue  # no jump link in these heads: their counts stay 0
            if counts is None:
                counts = torch.zeros(g, n, n, dtype=torch.int32, device=x.device)
            if cand is not None and _count_pairs(counts[sl], x[sl], lk[sl], cand, head_dim,
                                                 rho, sign, limit, _ENUM_CHUNK):
                continue
            del cand  # too many pairs: the sorted ranges
        elif not may_link(x[sl], lk[sl], head_dim, rho, sign):
            continue  # no jump link in these heads: their counts stay 0, nothing sorted
        if counts is None:
            counts = torch.zeros(g, n, n, dtype=torch.int32, device=x.device)
        p, prefix, perm = _boundaries(x[sl], lk[sl], head_dim, rho, sign)  # [gc, k, i]
        empty = None
        if ok_sl is not None:  # padding key k or padding row i: no links
            empty = ~(ok_sl[:, :, None] & ok_sl[:, None, :])
        how = method
        if how == "auto":
            size = _enum_size(p, prefix, empty, n)
            how = "enumerate" if size <= _ENUM_FRACTION * p.shape[0] * n**3 else "compare"
        if how == "enumerate":
            counts[sl] = _count_enumerate(p, prefix, perm, empty)
        else:
            chunk = _CMP_CHUNK if x.device.type == "cpu" else _CMP_CHUNK_GPU
            counts[sl] = count_compare(p, prefix, perm, empty, chunk)
    if counts is None:
        return None
    if ok is not None:
        counts *= ok[:, :, None] & ok[:, None, :]
    return counts.view(*batch, n, n)


def may_link(scores: torch.Tensor, key_len: torch.Tensor, head_dim: int, rho: float,
             sign: bool = False) -> bool:
    """False only if no (k, i, j) passes the threshold: then every count is 0.

    scores [..., n, n] (queries x keys; NaN counts as 0), key_len [..., n]. Through key k
    the strongest pair is the column's largest value with itself or its smallest with
    itself: with rho > 0 only a product of two scores of one sign can pass, and
    ``jump_strength`` is monotone in each factor (rounding included), so no pair of the
    column is stronger than max(U(max, max), U(min, min)) evaluated with the same float
    expression. Heads at initialisation, whose scores are small, have no link: their sort
    is skipped. With rho <= 0 every pair may pass and this says True.
    """
    if not rho > 0:
        return True
    x = scores.detach()
    if bool(torch.isnan(x).any()):
        x = _clean(x)
    top, low = x.amax(dim=-2), x.amin(dim=-2)  # [..., k] column extremes over the rows i
    lk = key_len.detach().to(x.dtype)
    strongest = torch.maximum(jump_strength(top, top, lk, head_dim, sign),
                              jump_strength(low, low, lk, head_dim, sign))
    return bool((strongest >= rho).any())


def _lengths(p: torch.Tensor, prefix: torch.Tensor, empty: torch.Tensor | None, n: int):
    length = torch.where(prefix, p, n - p)  # [g, k, i] size of the linked range
    if empty is not None:
        length = length.masked_fill(empty, 0)
    return length


def _enum_size(p, prefix, empty, n) -> int:
    length = _lengths(p, prefix, empty, n)
    return int(torch.minimum(length, n - length).sum())


def link_census(
    scores: torch.Tensor, key_len: torch.Tensor, head_dim: int, rho: float, sign: bool = False
) -> tuple[int, CountMethod]:
    """(jump links, the counter ``method="auto"`` picks) for one square score block.

    scores [n, n] (queries x keys; one head), key_len [n] (``key_length(k)``). The links are
    the (k, i, j) with B_k[i, j] = 1, from the same exact ranges as ``jump_counts``; the
    counter is "direct", "pairs", "enumerate" or "compare", as ``jump_counts`` decides it for this
    head on this device. For benchmarks and diagnostics (the sparsity the threshold gives).
    """
    n = scores.shape[-1]
    x = _clean(scores).reshape(1, n, n)  # [1, n, n]
    lk = key_len.detach().to(x.dtype).reshape(1, n)  # [1, n]
    p, prefix, _ = _boundaries(x, lk, head_dim, rho, sign)  # [1, k, i]
    links = int(_lengths(p, prefix, None, n).sum())
    if direct_applies(x.device, n):
        return links, "direct"
    limit = _PAIRS_PER_SCORE * n * n
    cand = _candidates(x, lk, head_dim, rho, sign, None, limit) if (
        rho >= 1e3 * torch.finfo(x.dtype).tiny) else None
    if cand is not None:
        _, m = torch.unique_consecutive(cand[0] * n + cand[2], return_counts=True)
        if int((m * m).sum()) <= limit:
            return links, "pairs"
    sparse = _enum_size(p, prefix, None, n) <= _ENUM_FRACTION * n**3
    return links, "enumerate" if sparse else "compare"


def _count_enumerate(p, prefix, perm, empty) -> torch.Tensor:
    """O(E) counts: list the linked j of every (k, i), or the unlinked j when fewer.

    A complemented (k, i) adds 1 to every j of row i and -1 to each unlinked j.
    Per listed entry the work is a handful of int64 passes (repeat, gather, bincount).
    """
    g, n, _ = p.shape
    length = _lengths(p, prefix, empty, n)  # [g, k, i]
    comp = length > n // 2
    counts = comp.sum(1, dtype=torch.int32)[:, :, None].expand(g, n, n).clone()  # [g, i, j]
    flat_counts = counts.view(-1)
    flat_perm = perm.reshape(-1)  # perm[g, k, t] at (g * n + k) * n + t
    # the listed range is a prefix [0, p) when prefix XOR comp, else a suffix [p, n)
    start = torch.where(prefix ^ comp, torch.zeros_like(p), p)  # [g, k, i]
    size = torch.where(comp, n - length, length)  # [g, k, i]
    dev = p.device
    owners = size.view(-1).nonzero().squeeze(-1)  # flat (g, k, i) ids with entries to list
    sizes, comps = size.view(-1)[owners], comp.view(-1)[owners]
    perm_start = (owners // n) * n + start.view(-1)[owners]  # (g n + k) n + first position
    row_start = ((owners // (n * n)) * n + owners % n) * n  # (g n + i) n: row i of counts
    for sgn, sel in ((1, ~comps), (-1, comps)):
        sz, pa, ra = sizes[sel], perm_start[sel], row_start[sel]
        cum = sz.cumsum(0)
        lo = 0
        while lo < sz.numel():  # chunks of about _ENUM_CHUNK listed entries
            done = int(cum[lo - 1]) if lo else 0
            cut = torch.tensor(done + _ENUM_CHUNK, device=dev)
            hi = int(torch.searchsorted(cum, cut, right=True))
            hi = max(hi, lo + 1)
            s, pc, rc = sz[lo:hi], pa[lo:hi], ra[lo:hi]
            lo = hi
            r0 = int(rc.min())
            span = int(rc.max()) + n - r0
            hits = _list_and_count(flat_perm, s, pc, rc - r0, span)
            if sgn > 0:
                flat_counts[r0 : r0 + span] += hits
            else:
                flat_counts[r0 : r0 + span] -= hits
    return counts


def _list_and_count(flat_perm, sizes, perm_start, row_start, span) -> torch.Tensor:
    """Histogram [span] int32 of row_start[o] + flat_perm[perm_start[o] + t], t < sizes[o].

    One owner o is one (g, k, i) range. On CPU numpy runs these passes ~3x faster than
    torch (repeat ~2.5 vs 11 ns, gather ~6 vs 22 ns per entry, measured); same integers.
    """
    if _NUMPY_ON_CPU and flat_perm.device.type == "cpu":
        sz, fp = sizes.numpy(), flat_perm.numpy()
        first_np = np.cumsum(sz) - sz  # entry offset of each owner
        pos_np = np.repeat(perm_start.numpy() - first_np, sz)
        pos_np += np.arange(pos_np.size)  # flat_perm index of each listed entry
        idx_np = np.repeat(row_start.numpy(), sz)
        idx_np += np.take(fp, pos_np)  # + j
        return torch.from_numpy(np.bincount(idx_np, minlength=span).astype(np.int32))
    total = int(sizes.sum())
    first = sizes.cumsum(0) - sizes
    pos = torch.repeat_interleave(perm_start - first, sizes, output_size=total)
    pos += torch.arange(total, device=sizes.device)
    idx = torch.repeat_interleave(row_start, sizes, output_size=total)
    idx += flat_perm.take(pos)
    return torch.bincount(idx, minlength=span).to(torch.int32)


def direct_applies(device: torch.device, n: int) -> bool:
    """Whether ``method="auto"`` counts with ``direct``: off the CPU, n <= _DIRECT_MAX_N."""
    return device.type != "cpu" and n <= _DIRECT_MAX_N


def _count_direct(x, lk, head_dim, rho, sign, ok) -> torch.Tensor:
    """The official predicate on every (k, i, j): int32 [g, i, j].

    x [g, i, k] clean scores, lk [g, k], ok [g, n] bool or None (False = padding: no
    links through that key, its row and column zeroed). B_k[i, j] = 1[U >= rho] with U =
    ``jump_strength(S[i, k], S[j, k])`` exactly as ``naive_jump_counts`` evaluates it.
    Blocks of about ``_DIRECT_CHUNK`` strengths bound the memory: several whole heads per
    block when a head fits, else row slices of one head.
    """
    g, n, _ = x.shape
    a = x.transpose(1, 2)  # [g, k, i]
    klen = lk[:, :, None, None]  # [g, k, 1, 1]
    key_ok = None if ok is None else ok[:, :, None, None]  # [g, k, 1, 1]
    heads = max(1, _DIRECT_CHUNK // n**3)
    rows = n if n**3 <= _DIRECT_CHUNK else max(1, _DIRECT_CHUNK // (n * n))
    counts = torch.empty(g, n, n, dtype=torch.int32, device=x.device)
    for g0 in range(0, g, heads):
        sl = slice(g0, g0 + heads)
        av = a[sl]  # [gc, k, i]
        for i0 in range(0, n, rows):
            ri = slice(i0, i0 + rows)
            u = jump_strength(av[..., ri, None], av[..., None, :], klen[sl], head_dim, sign)
            links = u >= rho  # [gc, k, rows, j]
            if key_ok is not None:
                links &= key_ok[sl]
            counts[sl, ri] = links.sum(1, dtype=torch.int32)
    if ok is not None:
        counts *= ok[:, :, None] & ok[:, None, :]
    return counts


# ------------------------------------------------------------------------- normalisation


def normalized_adjacency(
    counts: torch.Tensor, valid: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A_hat = D^-1/2 A D^-1/2 with A = counts / n_keys, diag(A) = 1, D clamped >= 1e-4.

    counts [..., n, n] int; valid [..., n] bool or None. n_keys is n (the official mean over
    all keys) or, with padding excluded, the number of valid keys, so that a padded sequence
    gets exactly the adjacency of the unpadded one.
    """
    n = counts.shape[-1]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if valid is None:
        a = counts.to(wide) / n
    else:
        n_keys = valid.sum(-1, keepdim=True).clamp_min(1).to(wide)  # [..., 1]
        a = counts.to(wide) / n_keys[..., None]
    a = a.to(dtype)
    a.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    deg = a.sum(-1)
    deg = torch.where(deg <= 1e-4, torch.full((), 1e-4, dtype=deg.dtype), deg)
    dinv = torch.reciprocal(torch.sqrt(deg)).unsqueeze(-1)  # [..., n, 1]
    return dinv * a * dinv.transpose(-1, -2)


def normalized_adjacency_coo(
    counts: torch.Tensor, valid: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
    max_nonzero: float | None = None,
) -> torch.Tensor | None:
    """``normalized_adjacency`` as a coalesced sparse COO [g, n, n], the same values bit for
    bit, without its dense passes; None when it would hold more than ``max_nonzero``
    nonzeros.

    counts [g, n, n] int (at most a few linked pairs per row), valid [g, n] bool or None.
    Every step is the dense form's on the nonzero entries alone: A = counts / n_keys cast
    to ``dtype`` at the linked pairs, 1 on the diagonal; D's row sums are the dense form's
    own sum over rows, taken only for the rows with a link (a row holding only its
    diagonal sums to 1 exactly); A_hat = (D^-1/2 A) D^-1/2 per entry, in that order.
    Zeros of the dense form are the entries left out.
    """
    g, n, _ = counts.shape
    gi, ii, jj = counts.nonzero(as_tuple=True)  # [E] linked pairs
    off = ii != jj  # the diagonal is 1 whatever its count
    gi, ii, jj = gi[off], ii[off], jj[off]
    if max_nonzero is not None and gi.numel() + g * n > max_nonzero:
        return None
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    c = counts[gi, ii, jj].to(wide)
    if valid is None:
        a = c / n
    else:
        a = c / valid.sum(-1).clamp_min(1).to(wide)[gi]
    a = a.to(dtype)  # A at the linked pairs [E]
    row = gi * n + ii  # flat row of each entry
    linked, slot = torch.unique(row, return_inverse=True)  # rows with a link [R]
    dense = torch.zeros(linked.numel(), n, dtype=dtype, device=counts.device)  # their A rows
    dense[slot, jj] = a
    dense[torch.arange(linked.numel(), device=counts.device), linked % n] = 1.0
    deg = torch.ones(g * n, dtype=dtype, device=counts.device)
    deg[linked] = dense.sum(-1)
    deg = torch.where(deg <= 1e-4, torch.full((), 1e-4, dtype=deg.dtype), deg)
    dinv = torch.reciprocal(torch.sqrt(deg))  # [g n]
    diag = torch.arange(g * n, device=counts.device)
    values = torch.cat([dinv[row] * a * dinv[gi * n + jj], dinv * 1.0 * dinv])
    index = torch.cat([torch.stack([gi, ii, jj]),
                       torch.stack([diag // n, diag % n, diag % n])], 1)  # [3, E + g n]
    return torch.sparse_coo_tensor(index, values, (g, n, n), check_invariants=True).coalesce()
