"""The sparse families' calls into the blocked engine (``_blocksparse.blocked_attention``):
a local window with global tokens (band, Longformer, BigBird, star, global tokens), a
dilated window (the sequence split into interleaved subsequences) and Sparse Transformer's
fixed pattern (its own block plus shared summary columns) and its strided pattern (a band
and, in residue-major order, block-local classes: ``_blockunion``)."""

from __future__ import annotations

import torch

from . import _blocksparse as bs
from ._blockunion import Part, union_attention


def local_global_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    global_tokens: tuple[int, ...] = (),
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout: float,
    block: int = bs.DEFAULT_BLOCK,
) -> torch.Tensor:
    """|i - j| <= window OR i in G OR j in G, never building n x m: [b,h,n,dv].

    The band is the block window; global key columns are extra keys of every block (and
    removed from the window so no key counts twice); global query rows are the engine's
    dense rows.
    """
    n = q.shape[2]
    glob = sorted({t for t in global_tokens if 0 <= t < n})
    gpos = torch.tensor(glob, dtype=torch.long, device=q.device)  # [G]
    if glob:
        is_global = torch.zeros(n + 1, dtype=torch.bool, device=q.device)
        is_global[gpos] = True

        def pattern(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return ((i - j).abs() <= window) & ~is_global[j.clamp(0, n)]
    else:

        def pattern(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return (i - j).abs() <= window

    nqb = -(-n // block)
    extra = gpos.expand(nqb, -1) if glob else None  # [nqb,G]
    width = bs.window_width(block, window, 0 if causal else window)
    return bs.blocked_attention(
        q, k, v, block=block, left=window, width=width, pattern=pattern, extra=extra,
        key_mask=key_mask, causal=causal, scale=scale, dropout=dropout,
        rows=gpos if glob else None, pattern_key=("local_global", window, tuple(glob), block),
    )


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    dilation: int,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """|i - j| <= w*r and (i - j) % r == 0 as a band of width w on each residue class mod r.

    Positions with the same residue form a sequence of length n/r in which the dilated
    pattern is a plain band; the classes are moved into the batch, run through the band
    engine, and moved back (two O(n*d) copies).
    """
    b, h, n, _ = q.shape
    r = dilation
    n2 = -(-n // r) * r
    if key_mask is None and n2 != n:
        key_mask = torch.ones(b, n, dtype=torch.bool, device=q.device)
    if key_mask is not None:
        key_mask = torch.nn.functional.pad(key_mask.to(torch.bool), (0, n2 - n), value=False)
        key_mask = key_mask.view(b, n2 // r, r).transpose(1, 2).reshape(b * r, n2 // r)

    def split(x: torch.Tensor) -> torch.Tensor:  # [b,h,n,d] -> [b*r,h,n/r,d]
        x = torch.nn.functional.pad(x, (0, 0, 0, n2 - n))
        return x.view(b, h, n2 // r, r, -1).permute(0, 3, 1, 2, 4).reshape(b * r, h, n2 // r, -1)

    out = local_global_attention(
        split(q), split(k), split(v), window=window, key_mask=key_mask, causal=causal,
        scale=scale, dropout=dropout,
    )  # [b*r,h,n/r,dv]
    out = out.view(b, r, h, n2 // r, -1).permute(0, 2, 3, 1, 4).reshape(b, h, n2, -1)
    return out[:, :, :n]


def fixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    summary: int,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """Sparse Transformer's fixed pattern, i // l == j // l or j % l >= l - c, as the query's
    own block of l keys (its window) plus the summary columns (the last c positions of every
    block) as extra keys that every query block shares: O(n * (l + c n / l)) work."""
    n = q.shape[2]
    l, c = stride, summary
    qblock = l * -(-bs.DEFAULT_BLOCK // l)  # a multiple of the pattern's block

    def pattern(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        # the own block without its summary columns (those come as extra keys)
        return (i // l == j // l) & (j.remainder(l) < l - c)

    cols = torch.arange(n, device=q.device)
    cols = cols[cols.remainder(l) >= l - c]  # [R] summary positions
    return bs.blocked_attention(
        q, k, v, block=qblock, left=0, width=qblock, pattern=pattern,
        extra=cols.expand(-(-n // qblock), -1), key_mask=key_mask, causal=causal,
        scale=scale, dropout=dropout, pattern_key=("sparse_fixed", l, c, qblock),
    )


def strided_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Sparse Transformer's strided pattern, |i - j| < l or (i - j) % l == 0, as two block
    patterns merged by log-sum-exp (``_blockunion``): the band |i - j| < l in the sequence's
    order, and each query's residue class mod l (itself left out) as block-local attention
    in residue-major order, where a class is C = ceil(n / l) consecutive places. O(n*(l + n/l))
    work; needs the flash kernels (no attention dropout)."""
    n, l = q.shape[2], stride
    C = -(-n // l)  # places per residue class
    width = bs.window_width(bs.DEFAULT_BLOCK, l - 1, 0 if causal else l - 1)

    def near(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (i - j).abs() < l

    # residue-major order: place p = a*C + x holds position x*l + a (>= n: padding, which
    # the key mask covers); a class is one unit of C places
    perm = torch.arange(C * l, device=q.device).view(C, l).t().reshape(-1)
    qblock = C * -(-bs.DEFAULT_BLOCK // C)  # a multiple of the class size

    def same_class(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        ok = (i // C == j // C) & (i % C != j % C)  # x_j = j % C: position x_j * l + a
        return ok & (j % C <= i % C) if causal else ok

    own = Part(None, 0, near, bs.DEFAULT_BLOCK, l - 1, width, causal, ("strided_near", l))
    other = Part(perm, C, same_class, qblock, 0, qblock, False, ("strided_class", C, causal))
    return union_attention(q, k, v, own, other, key_mask=key_mask, scale=scale)
