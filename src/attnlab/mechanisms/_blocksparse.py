"""Blocked sparse-attention engine: exact softmax over a local window plus per-block extra keys.

Why this exists: band-like patterns (band, dilated, block-local, Longformer, BigBird) touch
O(n*w) of the n x m score matrix. Dense code with a mask still pays O(n*m) time and memory;
this engine never builds n x m. Queries are cut into blocks of B rows. Query block u sees

* a *window*: the L consecutive keys starting at position u*B - P (L a multiple of B), and
* R *extra* keys given by position (global tokens, BigBird random blocks), the same for
  every query of the block.

An element mask inside each block's L + R keys (the pattern, bounds, causal, key mask) is
computed from indices, so the result equals dense masked softmax exactly (up to float
reordering). Memory: O(b*h*n*d) for padded copies and gradients, O(b*n*(L+R)) for the
additive mask (shared by the heads; one copy when there is no padding) and a few chunk
buffers of CHUNK_ELEMS scores.

Speed notes (2-core CPU, fp32; see docs/benchmarks.md):
* All sequences (b*h) and their padded positions are laid out in one flat [rows, d] array,
  so every block's key window is a strided *view* (``unfold``): no gather copies.
* The work runs in chunks of whole blocks (~CHUNK_ELEMS scores) so intermediate scores
  stay in cache. The forward keeps no probabilities (flash-attention style); the
  hand-written backward (``_BlockedAttention``) recomputes them chunk by chunk, does 5
  small GEMMs per chunk and overlap-adds the window gradients with L/B shifted slices.
* Few, large ops per chunk: on a busy machine every parallel region waits for the
  slowest thread, so op count matters as much as FLOPs.
* Attention dropout masks are regenerated in the backward from a per-call seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core import masked_softmax

# Inputs shorter than this use the dense masked path (blocking does not pay off).
DENSE_FALLBACK_MAX_LEN = 256
# Query block size B of the band-like patterns (tuned for d=64 fp32 on CPU; see the benchmark).
DEFAULT_BLOCK = 64
# Target number of score elements per chunk (fp32: 16 MiB). Smaller chunks stay in cache
# (2 Mi elements were 15-30% faster single-threaded or on an idle CPU), larger ones mean fewer
# parallel regions, and on a busy machine each region waits for a descheduled thread: 4 Mi
# was about 2x faster than 2 Mi there. Memory grows by ~4 chunk buffers.
CHUNK_ELEMS = 1 << 22

Pattern = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def use_blocked(n: int, m: int, need_weights: bool, same_head_dims: bool = True) -> bool:
    """Whether the blocked engine runs (else the dense masked path): the one rule.

    Needs n == m (self-attention), no materialised weights, v's head dim == q's, and at
    least DENSE_FALLBACK_MAX_LEN positions."""
    return n == m and same_head_dims and not need_weights and n >= DENSE_FALLBACK_MAX_LEN


def window_width(block: int, left: int, right: int) -> int:
    """L: keys u*B - left .. u*B + B - 1 + right, rounded up to a multiple of B."""
    span = block + left + right
    return -(-span // block) * block


def _neg(dtype: torch.dtype) -> float:
    # A finite "minus infinity": fully masked rows give a finite uniform softmax (then
    # zeroed), never NaN; exp(NEG - lse) underflows to exactly 0 elsewhere.
    return torch.finfo(dtype).min / 2


def build_block_bias(
    n: int,
    block: int,
    left: int,
    width: int,
    pattern: Pattern,
    extra: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive bias [b|1, nqb, B, L+R] (0 / NEG) and live rows [b|1, nqb, B] (bool).

    ``pattern(i, j)`` gets query positions i [nqb, B, 1] and window key positions
    j [nqb, 1, L] and returns which pairs the pattern allows inside the window. Extra keys
    (``extra`` [nqb, R] positions, -1 = unused) are allowed for every query of their block.
    Bounds (0 <= j < n, i < n), ``causal`` (j <= i) and ``key_mask`` [b, n] are added here.
    """
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None  # no padding: one bias for the whole batch
    nqb = -(-n // block)
    u = torch.arange(nqb, device=device)
    i = (u[:, None] * block + torch.arange(block, device=device))[:, :, None]  # [nqb,B,1]
    jw = (u * block - left)[:, None, None] + torch.arange(width, device=device)  # [nqb,1,L]
    allowed = pattern(i, jw) & (jw >= 0) & (jw < n)  # [nqb,B,L]
    j = jw
    if extra is not None and extra.shape[-1] > 0:
        jx = extra.to(device)[:, None, :]  # [nqb,1,R]
        ax = ((jx >= 0) & (jx < n)).expand(nqb, block, -1)
        allowed = torch.cat([allowed.expand(nqb, block, width), ax], dim=-1)
        j = torch.cat([jw, jx], dim=-1)  # [nqb,1,L+R]
    allowed = allowed & (i < n)
    if causal:
        allowed = allowed & (j <= i)
    if key_mask is not None:
        km = key_mask.to(device=device, dtype=torch.bool)[:, j.clamp(0, n - 1)]  # [b,nqb,1,L+R]
        allowed = allowed[None] & km
    else:
        allowed = allowed[None]
    live = allowed.any(-1)  # [b|1,nqb,B]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, _neg(dtype))
    return bias, live


class _Layout:
    """Flat padded layout shared by forward and backward (all sizes in rows)."""

    def __init__(self, n: int, block: int, left: int, width: int, seqs: int) -> None:
        self.n, self.B, self.P, self.L, self.S = n, block, left, width, seqs
        self.nqb = -(-n // block)
        self.np = self.nqb * block
        self.T = seqs * self.nqb  # total query blocks
        self.rows = (self.T + width // block - 1) * block  # flat key rows incl. pads

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n, d] -> [S, np, d] (contiguous; a view when n == np)."""
        if self.np == self.n:
            return x.contiguous()
        out = x.new_zeros(self.S, self.np, x.shape[-1])
        out[:, : self.n] = x
        return out

    def pad_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n, d] -> flat [rows, d] with sequence s at rows P + s*np .. (zeros elsewhere)."""
        out = x.new_empty(self.rows, x.shape[-1])
        out[: self.P].zero_()  # pads must be finite: masked keys still enter the GEMMs
        out[self.P + self.S * self.np :].zero_()
        seq = self.seq_view(out)
        seq[:, self.n :].zero_()
        seq[:, : self.n] = x
        return out

    def seq_view(self, flat: torch.Tensor) -> torch.Tensor:
        """Flat [rows, d] -> [S, np, d] view of the real sequence rows."""
        return flat[self.P : self.P + self.S * self.np].view(self.S, self.np, flat.shape[-1])

    def window_t(self, flat: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Transposed key windows of blocks t0..t1: [t1-t0, d, L] view (no copy)."""
        return flat[t0 * self.B : t1 * self.B + self.L - self.B].unfold(0, self.L, self.B)


def _chunks(lay: _Layout, bias: torch.Tensor):
    """(gi, s0, s1, u0, u1): whole sequences s0..s1 of bias group gi, or blocks u0..u1 of
    one sequence. A group is a batch element when the bias depends on it (key mask), else
    all b*h sequences form one group."""
    groups, nqb = bias.shape[0], lay.nqb
    per_group, per_block = lay.S // groups, lay.B * bias.shape[-1]
    per_seq = nqb * per_block
    if per_seq <= CHUNK_ELEMS:
        sc = max(1, CHUNK_ELEMS // per_seq)
        for gi in range(groups):
            for s0 in range(gi * per_group, (gi + 1) * per_group, sc):
                yield gi, s0, min(s0 + sc, (gi + 1) * per_group), 0, nqb
    else:
        uc = max(1, CHUNK_ELEMS // per_block)
        for gi in range(groups):
            for s in range(gi * per_group, (gi + 1) * per_group):
                for u0 in range(0, nqb, uc):
                    yield gi, s, s + 1, u0, min(u0 + uc, nqb)


def _keys(lay: _Layout, flat: torch.Tensor, seq: torch.Tensor, extra, c) -> torch.Tensor:
    """Keys of chunk c as [Tc, L+R, d]: the window view, or window + extras (one copy)."""
    _, s0, s1, u0, u1 = c
    t0, t1 = _span(lay, c)
    win = lay.window_t(flat, t0, t1).transpose(1, 2)  # [Tc,L,d]
    if extra is None:
        return win
    xk = seq[s0:s1][:, extra[u0:u1]]  # [hc,uc,R,d]
    return torch.cat([win, xk.reshape(t1 - t0, -1, xk.shape[-1])], dim=1)


def _scatter_keys(lay: _Layout, flat, seqs, extra, c, grad: torch.Tensor) -> None:
    """Adjoint of ``_keys`` for K and V at once: add grad [2, Tc, L+R, d] into
    flat [2, rows, d] (overlap-add of the windows; index-add of the extras)."""
    _, s0, s1, u0, u1 = c
    t0, t1 = _span(lay, c)
    blocks = flat.view(2, -1, lay.B, flat.shape[-1])  # [2,rows/B,B,d]
    win = grad[:, :, : lay.L].view(2, t1 - t0, lay.L // lay.B, lay.B, -1)  # [2,Tc,L/B,B,d]
    for o in range(lay.L // lay.B):  # B-row shifted slices: ~10x faster than unfold_backward
        blocks[:, t0 + o : t1 + o] += win[:, :, o]
    if extra is not None:
        idx = extra[u0:u1].reshape(-1)
        for seq, gx in zip(seqs, grad[:, :, lay.L :], strict=True):
            seq[s0:s1].index_add_(1, idx, gx.reshape(s1 - s0, idx.shape[0], -1))


def _span(lay: _Layout, c) -> tuple[int, int]:
    """First and one-past-last flat query block of chunk c."""
    _, s0, s1, u0, u1 = c
    return s0 * lay.nqb + u0, (s1 - 1) * lay.nqb + u1


def _probs(lay: _Layout, bias, qb, kc, c, scale: float) -> torch.Tensor:
    """softmax(bias + scale * Q K^T) of chunk c: [Tc, B, L+R] (one fresh buffer)."""
    gi, s0, s1, u0, u1 = c
    t0, t1 = _span(lay, c)
    s = bias[gi, u0:u1].repeat(s1 - s0, 1, 1)  # a fresh copy [Tc,B,L+R]
    s.baddbmm_(qb[t0:t1], kc.transpose(1, 2), alpha=scale)
    return torch.softmax(s, dim=-1)


def _dropout_mask(like: torch.Tensor, p: float, seed: int, chunk: int) -> torch.Tensor:
    """Keep-mask / (1 - p) shaped like ``like``; regenerated identically in the backward."""
    g = torch.Generator(device=like.device).manual_seed(seed * 1_000_003 + chunk)
    keep = torch.empty_like(like).bernoulli_(1.0 - p, generator=g)
    return keep.div_(1.0 - p)


class _BlockedAttention(torch.autograd.Function):
    """softmax(Q K^T * scale + bias) V over the block layout, with a hand-written backward.

    q, k, v: [S, n, d] (S = b*h sequences); bias [b|1, nqb, B, L+R]; live [b|1, nqb, B];
    extra [nqb, R] long (clamped positions) or None. Returns [S, n, dv].
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, live, extra, lay: _Layout, scale: float, p: float,
                seed: int):
        B, nqb = lay.B, lay.nqb
        qp = lay.pad_queries(q)  # [S,np,d]
        kf, vf = lay.pad_keys(k), lay.pad_keys(v)  # [rows,d]
        ks, vs = lay.seq_view(kf), lay.seq_view(vf)  # [S,np,d] views
        qb = qp.view(lay.T, B, -1)  # [T,B,d]
        out = q.new_empty(lay.T, B, v.shape[-1])  # [T,B,dv]
        for ci, c in enumerate(_chunks(lay, bias)):
            t0, t1 = _span(lay, c)
            prob = _probs(lay, bias, qb, _keys(lay, kf, ks, extra, c), c, scale)
            if p > 0:
                prob.mul_(_dropout_mask(prob, p, seed, ci))
            torch.bmm(prob, _keys(lay, vf, vs, extra, c), out=out[t0:t1])
            del prob
        ctx.all_live = bool(live.all())
        if not ctx.all_live:  # rows with no allowed key (softmax over NEG only) -> 0
            out.view(live.shape[0], -1, nqb, B, out.shape[-1]).mul_(live[:, None, ..., None])
        ctx.save_for_backward(qp, kf, vf, out, bias, live, extra)
        ctx.cfg = (lay, scale, p, seed)
        res = out.view(lay.S, lay.np, -1)
        return res[:, : lay.n] if lay.np != lay.n else res

    @staticmethod
    def backward(ctx, grad):
        qp, kf, vf, out, bias, live, extra = ctx.saved_tensors
        lay, scale, p, seed = ctx.cfg
        B = lay.B
        go = lay.pad_queries(grad)  # [S,np,dv]
        if not ctx.all_live:  # dead rows (no allowed key) get no gradient
            go = go.view(live.shape[0], -1, lay.nqb, B, go.shape[-1]) * live[:, None, ..., None]
        go = go.view(lay.T, B, -1)  # [T,B,dv]
        delta = (go * out).sum(-1, keepdim=True)  # [T,B,1] = rowsum(P * dP)
        ks, vs = lay.seq_view(kf), lay.seq_view(vf)
        qb = qp.view(lay.T, B, -1)
        dq = torch.empty_like(qb)  # [T,B,d]
        dkv = kf.new_zeros(2, *kf.shape)  # [2,rows,d]: dK and dV, scattered together
        dkvs = lay.seq_view(dkv[0]), lay.seq_view(dkv[1])  # [S,np,d] views
        for ci, c in enumerate(_chunks(lay, bias)):
            t0, t1 = _span(lay, c)
            kc, vc = _keys(lay, kf, ks, extra, c), _keys(lay, vf, vs, extra, c)
            prob = _probs(lay, bias, qb, kc, c, scale)  # recomputed [Tc,B,L+R]
            g = go[t0:t1]  # [Tc,B,dv]
            dprob = torch.bmm(g, vc.transpose(1, 2))  # [Tc,B,L+R]
            dkvc = prob.new_empty(2, t1 - t0, prob.shape[-1], kf.shape[-1])  # [2,Tc,L+R,d]
            if p > 0:
                keep = _dropout_mask(prob, p, seed, ci)
                dprob.mul_(keep)
                keep.mul_(prob)  # the dropped-out probabilities
                torch.bmm(keep.transpose(1, 2), g, out=dkvc[1])
                del keep
            else:
                torch.bmm(prob.transpose(1, 2), g, out=dkvc[1])
            ds = dprob.sub_(delta[t0:t1]).mul_(prob)  # dS without the scale
            del prob
            torch.baddbmm(dq[t0:t1], ds, kc, beta=0, alpha=scale, out=dq[t0:t1])
            torch.baddbmm(dkvc[0], ds.transpose(1, 2), qb[t0:t1], beta=0, alpha=scale,
                          out=dkvc[0])
            del ds, dprob
            _scatter_keys(lay, dkv, dkvs, extra, c, dkvc)
        n = lay.n
        dq = dq.view(lay.S, lay.np, -1)[:, :n]
        return (dq, dkvs[0][:, :n], dkvs[1][:, :n], None, None, None, None, None, None, None)


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block: int,
    left: int,
    width: int,
    pattern: Pattern,
    extra: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Exact masked softmax attention over a block layout; q, k, v [b,h,n,d] -> [b,h,n,dv].

    block B, left P, width L (multiple of B): query block u sees keys u*B-P .. u*B-P+L-1
    where ``pattern(i, j)`` allows them, plus the ``extra`` [nqb, R] key positions (-1 =
    unused; must not repeat a key the window already allows). ``dropout`` > 0 applies
    attention dropout (the caller passes 0 in eval mode). Rows with no allowed key -> 0.
    """
    b, h, n, d = q.shape
    if k.shape[2] != n:
        raise ValueError(f"blocked attention needs n == m (got {n} and {k.shape[2]})")
    if width % block:
        raise ValueError(f"window width {width} must be a multiple of the block {block}")
    if v.shape[-1] != d:
        raise ValueError(f"blocked attention needs v's head dim ({v.shape[-1]}) == d ({d})")
    bias, live = build_block_bias(
        n, block, left, width, pattern, extra, key_mask, causal, q.dtype, q.device
    )
    lay = _Layout(n, block, left, width, b * h)
    xi = None if extra is None or extra.shape[-1] == 0 else extra.clamp(0, n - 1).to(q.device)
    seed = int(torch.randint(0, 2**31 - 1, ())) if dropout > 0 else 0
    out = _BlockedAttention.apply(
        q.reshape(b * h, n, d), k.reshape(b * h, n, d), v.reshape(b * h, n, v.shape[-1]),
        bias, live, xi, lay, scale, dropout, seed,
    )
    return out.reshape(b, h, n, -1)


# ------------------------------------------------------------------ helpers for the families


def dense_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """Rows ``rows`` [G] of dense masked attention over all keys: [b,h,G,dv].

    Global query rows (Longformer, BigBird) attend every key; there are few of them, so
    computing them densely is O(G*m) and exact.
    """
    qg = q[:, :, rows]  # [b,h,G,d]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [b,h,G,m]
    m = k.shape[2]
    allowed = torch.ones(rows.shape[0], m, dtype=torch.bool, device=q.device)  # [G,m]
    if causal:
        allowed = torch.arange(m, device=q.device)[None, :] <= rows[:, None]
    allowed = allowed.expand(scores.shape)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].to(device=q.device, dtype=torch.bool)
    probs = masked_softmax(scores, allowed)
    if dropout > 0:
        probs = torch.nn.functional.dropout(probs, dropout, training=True)
    return torch.matmul(probs, v)


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
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """|i - j| <= window OR i in G OR j in G, never building n x m: [b,h,n,dv].

    The band is the block window; global key columns are extra keys of every block (and
    removed from the window so no key counts twice); global query rows are recomputed
    densely over all keys and written over the blocked rows.
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
    width = window_width(block, window, 0 if causal else window)
    out = blocked_attention(
        q, k, v, block=block, left=window, width=width, pattern=pattern, extra=extra,
        key_mask=key_mask, causal=causal, scale=scale, dropout=dropout,
    )
    if glob:
        rows = dense_rows(q, k, v, gpos, key_mask=key_mask, causal=causal, scale=scale,
                          dropout=dropout)
        out = out.index_copy(2, gpos, rows)
    return out


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
