"""Attention over the union of two block patterns that live in different position orders,
on torch's CPU flash kernels (``_blockflash``): Sparse Transformer's strided pattern.

Why: the strided pattern, |i - j| < l or (i - j) % l == 0, is a band in the sequence's own
order and, in residue-major order (the positions of each residue class mod l side by
side), a block-local pattern (every query sees its class). No one order makes both parts
windows, so each part runs in its own order and the parts are merged by their row
log-sum-exp, as the blocked engine merges its window with extra keys: o = sum_p w_p o_p,
w_p = exp(lse_p - lse). In the backward each part's flash kernel gets the *joint* lse and
output (in its order), so it recomputes that part's joint probabilities and returns
exactly its share of the gradient. The parts must not share a key: the class part leaves
out the query itself, which the band has.

The permuted part runs in groups of whole units (residue classes), which are independent
of each other: its gathered copies of q, k, v, dO and the output are a group's rows, not
the sequence's, so it adds a fraction of [b*h, n, d] to the peak.

Runs when the flash kernels do (``_blockflash.usable``: no attention dropout, float32 or
float64 on the CPU); the caller falls back otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _blockflash
from ._blockbias import Pattern, build_block_bias
from ._blocklayout import _KeyRows, _Layout, _QueryRows, _within_sequences

# The permuted part's groups: about this fraction of the sequence each.
GROUPS = 8


@dataclass(frozen=True)
class Part:
    """One block pattern in one position order.

    ``perm`` [n_p] long: the original position at each place of this order (None: the
    sequence's own order; places holding a position >= n are padding); ``unit``: with a
    perm, the order splits into independent runs of ``unit`` places (no query sees a key
    of another run), and ``pattern`` must depend on places only through their offset
    within a run of whole units (it is applied to each group of runs from place 0).
    ``pattern(i, j)`` on places; block, left, width as ``blocked_attention``'s;
    ``causal``: the engine's j <= i rule, valid in the own order only (a permuted part
    states causality in its pattern); ``key``: names the pattern for the bias cache."""

    perm: torch.Tensor | None
    unit: int
    pattern: Pattern
    block: int
    left: int
    width: int
    causal: bool
    key: tuple


def _lay(part: Part, n: int, S: int) -> _Layout:
    return _Layout(n, part.block, part.left, part.width, S)


def _rows(lay: _Layout, x: torch.Tensor, fill: float) -> torch.Tensor:
    """[S, n, c] -> the layout's query rows [T, B, c], ``fill`` at padded rows."""
    if lay.np == lay.n:
        return x.contiguous().view(lay.T, lay.B, x.shape[-1])
    out = x.new_full((lay.S, lay.np, x.shape[-1]), fill)
    out[:, : lay.n] = x
    return out.view(lay.T, lay.B, x.shape[-1])


def _forward(lay: _Layout, bias, q, k, v, scale: float):
    """One part on its own rows: out [S, n, dv], lse [S, n, 1]."""
    inside = _within_sequences(lay)
    qr, kr, vr = (_QueryRows(lay, q, inside), _KeyRows.of(lay, k, inside),
                  _KeyRows.of(lay, v, inside))
    out = q.new_empty(lay.T, lay.B, v.shape[-1])
    lse = _blockflash.forward(lay, qr, kr, vr, bias, None, None, out, scale)
    return out.view(lay.S, lay.np, -1)[:, : lay.n], lse.view(lay.S, lay.np, 1)[:, : lay.n]


def _backward(lay: _Layout, bias, q, k, v, g, out, lse, scale: float, dq: torch.Tensor,
              dkv: torch.Tensor) -> None:
    """One part's share of the gradient on its own rows: dq [T, B, d] written, dkv
    [2, rows, d] (the flat layout) added to."""
    inside = _within_sequences(lay)
    qr, kr, vr = (_QueryRows(lay, q, inside), _KeyRows.of(lay, k, inside),
                  _KeyRows.of(lay, v, inside))
    _blockflash.backward(lay, qr, kr, vr, _QueryRows(lay, g, inside), _rows(lay, out, 0.0),
                         _rows(lay, lse, _blockflash.NO_ROW), bias, None, None, scale, dq,
                         dkv, (lay.seq_view(dkv[0]), lay.seq_view(dkv[1])))


class _Union(torch.autograd.Function):
    """q, k, v [S, n, d] -> [S, n, dv] over ``own`` (a Part in the sequence's order, with
    its bias and live rows) and ``other`` (a permuted Part and its groups: (places, bias,
    live) per group)."""

    @staticmethod
    def forward(ctx, q, k, v, own, other, scale: float):
        S, n = q.shape[:2]
        part, bias, live = own
        out, lse = _forward(_lay(part, n, S), bias, q, k, v, scale)  # merged into below
        live = live.reshape(live.shape[0], -1)[:, :n].clone()  # [b|1,n]
        opart, groups = other
        for places, gbias, glive in groups:
            pos, ok = places.clamp(max=n - 1), places < n  # [n_g]
            o_g, l_g = _forward(_lay(opart, places.shape[0], S), gbias, q[:, pos], k[:, pos],
                                v[:, pos], scale)
            at = pos[ok]
            o_g, l_g = o_g[:, ok], l_g[:, ok]
            cur_o, cur_l = out[:, at], lse[:, at]
            new_l = torch.logaddexp(cur_l, l_g)
            out[:, at] = cur_o.mul_((cur_l - new_l).exp_()).addcmul_(o_g, (l_g - new_l).exp_())
            lse[:, at] = new_l
            glive = glive.reshape(glive.shape[0], -1)[:, : places.shape[0]][:, ok]
            if live.shape[0] < glive.shape[0]:
                live = live.expand(glive.shape[0], -1).clone()
            live[:, at] |= glive
        live = live[..., None]  # [b|1,n,1]: rows with any allowed key in either part
        ctx.all_live = bool(live.all())
        if not ctx.all_live:
            out.view(live.shape[0], -1, n, out.shape[-1]).mul_(live[:, None])
        ctx.save_for_backward(q, k, v, out, lse, live)
        ctx.own, ctx.other, ctx.scale = own, other, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, live = ctx.saved_tensors
        S, n = q.shape[:2]
        if not ctx.all_live:  # rows with no allowed key get no gradient
            grad = (grad.reshape(live.shape[0], -1, n, grad.shape[-1]) * live[:, None]
                    ).view(out.shape)
        part, bias, _ = ctx.own
        lay = _lay(part, n, S)
        dq = q.new_empty(lay.T, lay.B, q.shape[-1])
        dkv = k.new_zeros(2, lay.rows, k.shape[-1])
        _backward(lay, bias, q, k, v, grad, out, lse, ctx.scale, dq, dkv)
        dq = dq.view(S, lay.np, -1)[:, :n]
        dk, dv = lay.seq_view(dkv[0])[:, :n], lay.seq_view(dkv[1])[:, :n]
        opart, groups = ctx.other
        for places, gbias, _ in groups:
            pos, ok = places.clamp(max=n - 1), places < n
            glay = _lay(opart, places.shape[0], S)
            gq = q.new_empty(glay.T, glay.B, q.shape[-1])
            gkv = k.new_zeros(2, glay.rows, k.shape[-1])
            g_g = grad[:, pos].mul_(ok[:, None])  # padding places: no gradient
            l_g = lse[:, pos].masked_fill_(~ok[:, None], _blockflash.NO_ROW)
            _backward(glay, gbias, q[:, pos], k[:, pos], v[:, pos], g_g, out[:, pos], l_g,
                      ctx.scale, gq, gkv)
            at = pos[ok]
            dq.index_add_(1, at, gq.view(S, glay.np, -1)[:, : places.shape[0]][:, ok])
            dk.index_add_(1, at, glay.seq_view(gkv[0])[:, : places.shape[0]][:, ok])
            dv.index_add_(1, at, glay.seq_view(gkv[1])[:, : places.shape[0]][:, ok])
        return dq, dk, dv, None, None, None


def union_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own: Part,
                    other: Part, *, key_mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """softmax over the union of ``own`` (the sequence's order) and ``other`` (a permuted
    order of independent units), whose key sets are disjoint; q, k, v [b,h,n,d] ->
    [b,h,n,dv]. Needs ``_blockflash.usable(q, 0.0)``."""
    b, h, n, d = q.shape
    assert own.perm is None and other.perm is not None
    bias, _, live = build_block_bias(n, own.block, own.left, own.width, own.pattern, None,
                                     key_mask, own.causal, q.dtype, q.device, key=own.key)
    n_p = other.perm.shape[0]
    km = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    km = torch.nn.functional.pad(km.to(torch.bool), (0, max(0, n_p - n)))[:, other.perm]
    step = max(1, n_p // other.unit // GROUPS) * other.unit  # places per group
    groups = []
    for p0 in range(0, n_p, step):
        places = other.perm[p0 : p0 + step]
        gbias, _, glive = build_block_bias(
            places.shape[0], other.block, other.left, other.width, other.pattern, None,
            km[:, p0 : p0 + step], other.causal, q.dtype, q.device, key=other.key)
        groups.append((places, gbias, glive))
    out = _Union.apply(q.reshape(b * h, n, d), k.reshape(b * h, n, d),
                       v.reshape(b * h, n, v.shape[-1]), (own, bias, live), (other, groups),
                       scale)
    return out.reshape(b, h, n, -1)
