"""Blocked sparse-attention engine: exact softmax over a local window plus per-block extra keys.

Why this exists: band-like patterns (band, dilated, block-local, Longformer, BigBird) touch
O(n*w) of the n x m score matrix. Dense code with a mask still pays O(n*m) time and memory;
this engine never builds n x m. Queries are cut into blocks of B rows. Query block u sees

* a *window*: the L consecutive keys starting at position u*B - P (L a multiple of B), and
* R *extra* keys given by position (global tokens, BigBird random blocks), the same for
  every query of the block;
* and G *dense rows* (global queries) attend every key instead.

An element mask inside each block's L + R keys (the pattern, bounds, causal, key mask) is
computed from indices, so the result equals dense masked softmax exactly (up to float
reordering). Memory: O(b*h*n*d) for the gradients (and for padded copies of K and V, made
only when n is not a multiple of B: ``_KeyRows``), O(b*n*(L+R)) for the additive mask
(shared by the heads; one copy when there is no padding) and a few chunk buffers of
CHUNK_ELEMS scores. The backward saves q, k, v (the inputs themselves where no copy is
needed), the output, with extra keys each query's window share and log-sum-exp, and the
probabilities of up to ``_KEEP_ROWS_MAX`` dense rows.

Speed notes (2-core CPU, fp32; see docs/benchmarks.md and docs/benchmarks-history.md):
* All sequences (b*h) and their padded positions are laid out in one flat [rows, d] array,
  so every block's key window is a strided *view* (``unfold``) of K or V: no gather
  copies, and no copy of K and V at all when n is a multiple of B (``_KeyRows``); q and
  the output's gradient are read in place the same way (``_QueryRows``).
* The work runs in chunks of whole blocks (~CHUNK_ELEMS scores) so intermediate scores
  stay in cache. The forward keeps no probabilities (flash-attention style); the
  hand-written backward (``_BlockedAttention``) recomputes them chunk by chunk.
* Without attention dropout, on the CPU, each chunk's windows go through torch's fused
  flash-attention kernels (``_blockflash``: the windows as strided key views, the bias as
  a mask); band(128) forward+backward at n = 4096 took 10-15% less time that way
  (docs/benchmarks-history.md, "The window on torch's CPU flash kernels"). Otherwise
  (``_explicit_forward``) the scores are built per chunk and the window's dK and dV are
  L/B GEMMs, each accumulating into the B key rows of one shifted slice in place (no
  [Tc, L, d] gradient buffer: 118 MB instead of 148 MB for band(128) forward+backward at
  n = 4096, 12 heads; 98 MB with 1 Mi-score chunks, 62 MB without copies of K, V, q and
  dO).
* Window and extra keys are two parts of one softmax merged by their log-sum-exp, never
  one [.., L+R] buffer: a GEMM into a column slice falls back to one small GEMM per block,
  and copying the keys into one operand costs a pass over the window per chunk. Extra
  keys shared by every block (global keys) take one GEMM per sequence. With the dense
  rows inside the engine too, a global token costs O(n*d) extra work and no copy of the
  output or its gradients (docs/benchmarks-history.md, "Global tokens", "Extra keys").
* Attention dropout masks are regenerated in the backward from a per-call seed.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from . import _blockflash
from ._blockbias import Pattern, _neg, build_block_bias, row_bias
from ._blockextras import ExtraKeys, joint_lse
from ._blocklayout import (
    CHUNK_ENV_ERROR,
    _chunks,
    _KeyRows,
    _Layout,
    _QueryRows,
    _span,
    _within_sequences,
)

# Inputs shorter than this use the dense masked path (blocking does not pay off).
DENSE_FALLBACK_MAX_LEN = 256
# Query block size B of the band-like patterns (tuned for d=64 fp32 on CPU; see the benchmark).
DEFAULT_BLOCK = 64
def use_blocked(n: int, m: int, need_weights: bool, same_head_dims: bool = True) -> bool:
    """Whether the blocked engine runs (else the dense masked path): the one rule.

    Needs n == m (self-attention), no materialised weights, v's head dim == q's, and at
    least DENSE_FALLBACK_MAX_LEN positions."""
    return n == m and same_head_dims and not need_weights and n >= DENSE_FALLBACK_MAX_LEN


def window_width(block: int, left: int, right: int) -> int:
    """L: keys u*B - left .. u*B + B - 1 + right, rounded up to a multiple of B."""
    span = block + left + right
    return -(-span // block) * block


def _add_window_grads(lay: _Layout, flat: torch.Tensor, c, a: torch.Tensor, b: torch.Tensor,
                      alpha: float = 1.0) -> None:
    """Adjoint of the window view for one of dK, dV (flat [rows, d]): add alpha * a^T b
    (a [Tc, B, L], b [Tc, B, d]) into the window keys: one GEMM per B-key slice,
    accumulated in place into the B rows it covers (no [Tc, L, d] buffer, no overlap-add
    pass)."""
    t0, t1 = _span(lay, c)
    B = lay.B
    blocks = flat.view(-1, B, flat.shape[-1])  # [rows/B,B,d]
    for o in range(lay.L // B):
        blocks[t0 + o : t1 + o].baddbmm_(a[:, :, o * B : (o + 1) * B].transpose(1, 2), b,
                                         alpha=alpha)


def _scores(lay: _Layout, bias: tuple[torch.Tensor, torch.Tensor | None], q: torch.Tensor,
            kwin: torch.Tensor, ex: ExtraKeys | None, xk: torch.Tensor | None, c, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bias + scale * Q K^T of chunk c: the window's [Tc, B, L] and the extra keys'
    [Tc, B, R] (or None), each a fresh contiguous buffer. One [.., L+R] buffer would let one
    softmax cover both, but a batched GEMM into its column slice runs as one small GEMM
    per block (torch's CPU bmm takes a contiguous result only): measured, that cost more
    in the backward than the merge saves (docs/benchmarks-history.md, "Extra keys")."""
    gi, s0, s1, u0, u1 = c
    s = bias[0][gi, u0:u1].repeat(s1 - s0, 1, 1)  # a fresh copy [Tc,B,L]
    s.baddbmm_(q, kwin.transpose(1, 2), alpha=scale)
    if ex is None:
        return s, None
    assert xk is not None and bias[1] is not None
    return s, ex.scores(bias[1], q, xk, c, scale)


def _window_lse(s: torch.Tensor, p: torch.Tensor, own: int | None) -> torch.Tensor:
    """The log-sum-exp [Tc, B, 1] of the window scores s [Tc, B, L] from their softmax p,
    with no exp pass of our own (torch's fused softmax is ~3x faster than ``exp_`` here):
    lse = s_j - log p_j for any column j whose p_j is a normal float (then the log is exact
    to float precision).

    ``own``: row r's own key is column r + own (the window's diagonal, a strided view: no
    pass over s); the few rows where its p_j < 1e-30 (a masked or far-off own key), and
    ``own=None``, take j = argmax, found with two ``amax`` passes (``max`` with indices
    took 6x as long)."""
    if own is None:
        return s.amax(-1, keepdim=True) - p.amax(-1, keepdim=True).log_()
    pj = p.diagonal(own, 1, 2).unsqueeze(-1)  # [Tc,B,1]
    lse = s.diagonal(own, 1, 2).unsqueeze(-1) - pj.log()
    bad = (pj < 1e-30).view(-1).nonzero().squeeze(1)
    if bad.numel():
        width = s.shape[-1]
        sb, pb = s.view(-1, width)[bad], p.view(-1, width)[bad]  # [k,width]
        lse.view(-1)[bad] = sb.amax(-1) - pb.amax(-1).log_()
    return lse


def _dropout_mask(like: torch.Tensor, p: float, seed: int, chunk: int) -> torch.Tensor:
    """Keep-mask / (1 - p) shaped like ``like``; regenerated identically in the backward."""
    g = torch.Generator(device=like.device).manual_seed(seed * 1_000_003 + chunk)
    keep = torch.empty_like(like).bernoulli_(1.0 - p, generator=g)
    return keep.div_(1.0 - p)


def _chunk_rows(lay: _Layout, rows: torch.Tensor, c) -> torch.Tensor:
    """Flat indices into chunk c's [Tc*B] query rows of the dense rows' positions."""
    _, s0, s1, u0, u1 = c
    lo, hi = u0 * lay.B, u1 * lay.B
    inside = rows[(rows >= lo) & (rows < hi)] - lo  # [G']
    per_seq = hi - lo
    return (torch.arange(s1 - s0, device=rows.device)[:, None] * per_seq + inside).view(-1)


class _BlockedAttention(torch.autograd.Function):
    """softmax(Q K^T * scale + bias) V over the block layout, with a hand-written backward.

    q, k, v: [S, n, d] (S = b*h sequences); bias [b|1, nqb, B, L] and bias_x [b|1, nqb, B, R]
    (None without extras); live [b|1, nqb, B]; ex: the extra keys (``ExtraKeys``) or None;
    rows [G] long: query rows that attend every key instead (global queries) with their
    bias rbias [b|1, G, n], or None. Returns [S, n, dv].

    The window keys (a strided view) and the extra keys (a small gather) are two parts of
    one softmax: the window's is computed on its own (by torch's CPU flash kernels,
    ``_blockflash``, or explicitly, ``_explicit_forward``) and merged with the extras'
    exponentials by the log-sum-exp (the flash-attention merge): P_window = w * softmax,
    P_extra = exp(s_extra - lse), w = exp(lse_window - lse). So no [.., L+R] buffer or key
    copy is made and extra keys cost O(R) per query plus one pass over the chunk's output.
    The forward keeps no probabilities, only per query the joint lse (flash) or (w, lse)
    (explicit); the backward recomputes them. Dense rows are computed after the blocks and
    written over theirs; the backward gives them no blocked gradient (their lse is
    ``_blockflash.NO_ROW``, or their rows of the recomputed probabilities are zeroed), so
    no [S, n, d] copy or sum is made. Their own probabilities (G x n per sequence) are kept
    for the backward when G <= ``_KEEP_ROWS_MAX``.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, bias_x, live, ex, lay: _Layout, scale: float, p: float,
                seed: int, rows=None, rbias=None):
        B, nqb = lay.B, lay.nqb
        inside = _within_sequences(lay)
        qr = _QueryRows(lay, q, inside)  # q as blocks [T,B,d], uncopied where it can be
        qp = qr.seq  # [S,np,d]
        kr, vr = _KeyRows.of(lay, k, inside), _KeyRows.of(lay, v, inside)  # in the layout
        ks, vs = kr.seq, vr.seq  # [S,np,d]
        out = q.new_empty(lay.T, B, v.shape[-1])  # [T,B,dv]
        flash = _blockflash.usable(q, p)
        stats: torch.Tensor | None  # the joint lse per query (flash), or (w, lse) with extras
        if flash:
            stats = _blockflash.forward(lay, qr, kr, vr, bias, bias_x, ex, out, scale)
        else:
            stats = _explicit_forward(lay, qr, kr, vr, bias, bias_x, ex, out, scale, p, seed)
        rprob = rkeep = None  # the dense rows' probabilities, kept for the backward
        if rows is not None:
            dense, prob_rows, keep_rows = _dense_rows(qp, ks, vs, rows, rbias, lay, scale, p,
                                                      seed)
            out.view(lay.S, lay.np, -1)[:, rows] = dense
            if flash:
                assert stats is not None
                stats.view(lay.S, lay.np)[:, rows] = _blockflash.NO_ROW
            if rows.shape[0] <= _KEEP_ROWS_MAX:
                rprob, rkeep = prob_rows, keep_rows
            live = live.clone()  # a dense row lives if it has any allowed key
            live.view(live.shape[0], -1)[:, rows] = (rbias > _neg(rbias.dtype) / 2).any(-1)
        ctx.all_live = bool(live.all())
        if not ctx.all_live:  # rows with no allowed key (softmax over NEG only) -> 0
            out.view(live.shape[0], -1, nqb, B, out.shape[-1]).mul_(live[:, None, ..., None])
        ctx.save_for_backward(qp, kr.x, vr.x, out, stats, bias, bias_x, live, rows, rbias,
                              rprob, rkeep)
        ctx.cfg = (lay, scale, p, seed, kr.form, vr.form, inside, ex, rprob is not None,
                   flash)
        res = out.view(lay.S, lay.np, -1)
        return res[:, : lay.n] if lay.np != lay.n else res

    @staticmethod
    def backward(ctx, grad):
        qp, kx, vx, out, stats, bias, bias_x, live, rows, rbias, rprob, rkeep = ctx.saved_tensors
        lay, scale, p, seed, kform, vform, inside, ex, kept, flash = ctx.cfg
        kr, vr = _KeyRows(lay, kx, kform), _KeyRows(lay, vx, vform)
        qr = _QueryRows(lay, qp, inside)
        B = lay.B
        if not ctx.all_live:  # dead rows (no allowed key) get no gradient
            grad = lay.pad_queries(grad).view(live.shape[0], -1, lay.nqb, B, grad.shape[-1])
            grad = (grad * live[:, None, ..., None]).view(lay.S, lay.np, -1)
        gr = _QueryRows(lay, grad, inside)  # dO as blocks, uncopied where it can be
        out_seq = out.view(lay.S, lay.np, -1)
        delta = None  # rowsum(dO * O) [T,B,1] (the flash path takes it per chunk)
        if not flash:
            delta = (gr.seq * out_seq).sum(-1, keepdim=True).view(lay.T, B, 1)
        dq = qp.new_empty(lay.T, B, qp.shape[-1])  # [T,B,d]
        dkv = kx.new_zeros(2, lay.rows, kx.shape[-1])  # [2,rows,d]: dK and dV, padded
        dkvs = lay.seq_view(dkv[0]), lay.seq_view(dkv[1])  # [S,np,d] views
        if flash:
            _blockflash.backward(lay, qr, kr, vr, gr, out, stats, bias, bias_x, ex, scale, dq,
                                 dkv, dkvs)
        else:
            assert delta is not None
            _explicit_backward(lay, qr, kr, vr, gr, stats, bias, bias_x, ex, rows, delta,
                               scale, p, seed, dq, dkv, dkvs)
        n = lay.n
        dq = dq.view(lay.S, lay.np, -1)
        if rows is not None:
            delta_rows = ((gr.seq[:, rows] * out_seq[:, rows]).sum(-1, keepdim=True)
                          if delta is None else delta.view(lay.S, lay.np, 1)[:, rows])
            _dense_rows_backward(qp, kr.seq, vr.seq, rows, rbias, lay, scale, p, seed,
                                 gr.seq, delta_rows, dq, dkvs, (rprob, rkeep) if kept else None)
        return (dq[:, :n], dkvs[0][:, :n], dkvs[1][:, :n], None, None, None, None, None,
                None, None, None, None, None)


def _explicit_forward(lay: _Layout, qr: _QueryRows, kr: _KeyRows, vr: _KeyRows,
                      bias: torch.Tensor, bias_x: torch.Tensor | None, ex: ExtraKeys | None,
                      out: torch.Tensor, scale: float, p: float, seed: int
                      ) -> torch.Tensor | None:
    """The forward's chunk loop with the scores in hand (attention dropout, or no flash
    kernel): fills out [T, B, dv]; returns (w, lse) per query [T, B, 2] with extra keys."""
    B = lay.B
    q = qr.seq
    # each query's own key in its block's window (a likely large p for _window_lse)
    own = lay.P if lay.P + B <= lay.L else None
    stats = None if ex is None else q.new_empty(lay.T, B, 2)  # (w, lse) per query
    for ci, c in enumerate(_chunks(lay, bias.shape[0])):
        t0, t1 = _span(lay, c)
        xk, xv = (None, None) if ex is None else (ex.keys(kr, c), ex.keys(vr, c))
        s, sx = _scores(lay, (bias, bias_x), qr.blocks(t0, t1),
                        kr.window_t(t0, t1).transpose(1, 2), ex, xk, c, scale)
        prob = torch.softmax(s, dim=-1)  # [Tc,B,L]
        o = out[t0:t1]
        if ex is not None:
            assert sx is not None and xv is not None and stats is not None
            st = stats[t0:t1]
            lse_w = _window_lse(s, prob, own)  # [Tc,B,1]
            lse = joint_lse(lse_w, sx)
            st[..., :1] = lse_w.sub_(lse).exp_()  # w: the window's share
            st[..., 1:] = lse
            px = sx.sub_(lse).exp_()  # the extras' joint probabilities [Tc,B,R]
        del s
        if p > 0:
            prob.mul_(_dropout_mask(prob, p, seed, 2 * ci))
        torch.bmm(prob, vr.window_t(t0, t1).transpose(1, 2), out=o)
        del prob
        if ex is not None:  # o = w * P_window V_window + P_extra V_extra
            assert xv is not None
            if p > 0:
                px.mul_(_dropout_mask(px, p, seed, 2 * ci + 1))
            o.mul_(st[..., :1])
            ex.mm(o, px, xv, transpose=False, alpha=1.0, beta=1.0)
    return stats


def _explicit_backward(lay: _Layout, qr: _QueryRows, kr: _KeyRows, vr: _KeyRows,
                       gr: _QueryRows, stats: torch.Tensor | None, bias: torch.Tensor,
                       bias_x: torch.Tensor | None, ex: ExtraKeys | None, rows,
                       delta: torch.Tensor, scale: float, p: float, seed: int,
                       dq: torch.Tensor, dkv: torch.Tensor,
                       dkvs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The backward's chunk loop of ``_explicit_forward``: writes dq [T, B, d], adds into
    dK, dV (``dkv`` [2, rows, d], ``dkvs`` their [S, np, d] views)."""
    for ci, c in enumerate(_chunks(lay, bias.shape[0])):
        t0, t1 = _span(lay, c)
        q, g, d0 = qr.blocks(t0, t1), gr.blocks(t0, t1), delta[t0:t1]  # [Tc,B,d|dv|1]
        kwin = kr.window_t(t0, t1).transpose(1, 2)  # [Tc,L,d]
        xk, xv = (None, None) if ex is None else (ex.keys(kr, c), ex.keys(vr, c))
        s, sx = _scores(lay, (bias, bias_x), q, kwin, ex, xk, c, scale)
        prob = torch.softmax(s, dim=-1)  # recomputed [Tc,B,L]
        del s
        dense = None if rows is None else _chunk_rows(lay, rows, c)
        if dense is not None:  # dense rows: their gradient comes from their own part
            prob.view(-1, prob.shape[-1]).index_fill_(0, dense, 0.0)
        gw, dw = g, d0  # P_window = w * prob: fold w into dO and delta
        if ex is not None:
            assert sx is not None and xk is not None and xv is not None and stats is not None
            st = stats[t0:t1]
            gw, dw = g * st[..., :1], d0 * st[..., :1]
        dprob = torch.bmm(gw, vr.window_t(t0, t1))  # [Tc,B,L]
        pv = prob  # the probabilities that multiplied V
        if p > 0:
            pv = _dropout_mask(prob, p, seed, 2 * ci)
            dprob.mul_(pv)
            pv.mul_(prob)
        _add_window_grads(lay, dkv[1], c, pv, gw)
        del pv
        ds = dprob.sub_(dw).mul_(prob)  # dS without the scale
        del prob
        torch.baddbmm(dq[t0:t1], ds, kwin, beta=0, alpha=scale, out=dq[t0:t1])
        _add_window_grads(lay, dkv[0], c, ds, q, alpha=scale)
        del ds, dprob, gw, dw
        if ex is not None:  # the extras' joint probabilities, recomputed
            assert sx is not None and xk is not None and xv is not None
            px = sx.sub_(st[..., 1:]).exp_()  # [Tc,B,R]
            if dense is not None:
                px.view(-1, px.shape[-1]).index_fill_(0, dense, 0.0)
            ex.backward(c, px, g, q, d0, xk, xv, dq[t0:t1], dkvs, scale,
                        _dropout_mask(px, p, seed, 2 * ci + 1) if p > 0 else None)


# Dense rows whose probabilities [S, G, n] the forward keeps for the backward (G x n per
# sequence: at most a quarter of a [S, n, d] tensor for d = 64); more are recomputed.
_KEEP_ROWS_MAX = 16
_ROWS_CHUNK = 1 << 30  # dropout-mask id of the dense rows (chunk ids count from 0)


def _dense_rows(qp, ks, vs, rows, rbias, lay: _Layout, scale: float, p: float, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dense rows of the engine: softmax(rbias + scale * Q_rows K^T) V over all n keys.
    Returns the output [S, G, dv], the probabilities [S, G, n] and the dropout keep-mask."""
    n, groups = lay.n, rbias.shape[0]
    s = torch.bmm(qp[:, rows], ks[:, :n].transpose(1, 2))  # [S,G,n]
    s.view(groups, -1, *s.shape[1:]).mul_(scale).add_(rbias[:, None])
    prob = torch.softmax(s, dim=-1)
    keep = _dropout_mask(prob, p, seed, _ROWS_CHUNK) if p > 0 else None
    return torch.bmm(prob if keep is None else prob * keep, vs[:, :n]), prob, keep


def _dense_rows_backward(qp, ks, vs, rows, rbias, lay: _Layout, scale: float, p: float,
                         seed: int, go, delta, dq, dkvs, kept=None) -> None:
    """Adjoint of ``_dense_rows``: writes dQ of the rows, adds into dK and dV [S, np, d];
    delta [S, G, 1]: rowsum(dO * O) of the rows.
    ``kept``: the forward's (probabilities, keep-mask), else they are recomputed."""
    n = lay.n
    if kept is None:
        _, prob, keep = _dense_rows(qp, ks, vs, rows, rbias, lay, scale, p, seed)
    else:
        prob, keep = kept
    g = go[:, rows]  # [S,G,dv]
    dprob = torch.bmm(g, vs[:, :n].transpose(1, 2))  # [S,G,n]
    pk = prob if keep is None else prob * keep
    if keep is not None:
        dprob.mul_(keep)
    dkvs[1][:, :n].baddbmm_(pk.transpose(1, 2), g)
    ds = dprob.sub_(delta).mul_(prob)  # dS without the scale
    dq[:, rows] = torch.bmm(ds, ks[:, :n]).mul_(scale)
    dkvs[0][:, :n].baddbmm_(ds.transpose(1, 2), qp[:, rows], alpha=scale)


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
    rows: torch.Tensor | None = None,
    pattern_key: Hashable | None = None,
) -> torch.Tensor:
    """Exact masked softmax attention over a block layout; q, k, v [b,h,n,d] -> [b,h,n,dv].

    block B, left P, width L (multiple of B): query block u sees keys u*B-P .. u*B-P+L-1
    where ``pattern(i, j)`` allows them, plus the ``extra`` [nqb, R] key positions (-1 =
    unused; must not repeat a key the window already allows). ``dropout`` > 0 applies
    attention dropout (the caller passes 0 in eval mode). ``rows`` [G]: query positions
    that attend every key (global queries; causal and padding still apply), computed
    densely in O(G*n*d). Rows with no allowed key -> 0. ``pattern_key``: a hashable naming
    ``pattern`` and ``extra`` completely, to cache the bias (``build_block_bias``).
    """
    if CHUNK_ENV_ERROR:
        raise ValueError(CHUNK_ENV_ERROR)
    b, h, n, d = q.shape
    if k.shape[2] != n:
        raise ValueError(f"blocked attention needs n == m (got {n} and {k.shape[2]})")
    if width % block:
        raise ValueError(f"window width {width} must be a multiple of the block {block}")
    if v.shape[-1] != d:
        raise ValueError(f"blocked attention needs v's head dim ({v.shape[-1]}) == d ({d})")
    bias, bias_x, live = build_block_bias(
        n, block, left, width, pattern, extra, key_mask, causal, q.dtype, q.device,
        key=pattern_key,
    )
    lay = _Layout(n, block, left, width, b * h, 0 if bias_x is None else bias_x.shape[-1])
    ex = (None if extra is None or extra.shape[-1] == 0
          else ExtraKeys(extra.clamp(0, n - 1).to(q.device)))
    seed = int(torch.randint(0, 2**31 - 1, ())) if dropout > 0 else 0
    out = _BlockedAttention.apply(
        q.reshape(b * h, n, d), k.reshape(b * h, n, d), v.reshape(b * h, n, v.shape[-1]),
        bias, bias_x, live, ex, lay, scale, dropout, seed, rows,
        None if rows is None else row_bias(rows, n, key_mask, causal, q.dtype),
    )
    return out.reshape(b, h, n, -1)
