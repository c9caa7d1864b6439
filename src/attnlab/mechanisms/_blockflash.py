"""The blocked engine's window part on torch's fused CPU flash-attention kernels.

Why: per chunk the explicit path (``_blocksparse``) builds the scores [Tc, B, L] (a bias
copy, a GEMM), takes their softmax and multiplies by V, four passes over the chunk's
scores, and its backward as many again. ``aten::_scaled_dot_product_flash_attention_for_cpu``
(the kernel behind CPU ``F.scaled_dot_product_attention``) does the same work tiled in
cache, takes the key windows as they are (strided views of K and V, [hc, uc, L, d]), an
additive mask broadcast over sequences (the cached bias [1, uc, B, L]), and returns the
row log-sum-exp, which the extra keys' merge needs anyway; its backward
(``..._backward``) recomputes the probabilities from that log-sum-exp and returns the
window keys' gradients [Tc, L, d], added here into dK and dV block by block.

With extra keys the saved log-sum-exp is the joint one (window and extras), so the
kernel's backward recomputes the window's *joint* probabilities and, given the joint output
for ``delta = rowsum(dO * O)``, returns exactly the window's share of the gradient. A dense
row gets the log-sum-exp ``NO_ROW``: its blocked probabilities are 0 in the backward.

Used when nothing needs the explicit path: no attention dropout (the kernel has none on
CPU), float32 or float64 on the CPU, and the operators present in this torch (``usable``).
Tested against the explicit path (``tests/mechanisms/test_sparse.py``).
"""

from __future__ import annotations

import torch

from . import _blocklayout
from ._blockextras import ExtraKeys, joint_lse
from ._blocklayout import _chunks, _KeyRows, _Layout, _QueryRows, _span

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

# Tests switch it off to run the explicit path on the same inputs.
ENABLED = True
# The log-sum-exp given to dense rows: exp(score - NO_ROW) is 0 for every finite score.
NO_ROW = 1e30
# The backward's chunks are this many times smaller than the forward's (they need not
# match: no dropout masks to redraw): the kernel returns each window's dK and dV, two
# [Tc, L, d] buffers, which at the forward's chunk size raised band(128)'s peak by ~8 MB.
BACKWARD_CHUNK_DIV = 4


def usable(q: torch.Tensor, p: float) -> bool:
    """Whether the flash kernels run the window part (else the explicit path)."""
    return (ENABLED and p == 0 and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64)
            and _FWD is not None and _BWD is not None)


def _views(lay: _Layout, rows: _QueryRows | _KeyRows, c, window: bool) -> torch.Tensor:
    """Chunk c's query rows [hc, uc, B, d] or key windows [hc, uc, L, d] (views: the
    chunk is whole sequences or blocks of one sequence, hc x uc = Tc)."""
    _, s0, s1, u0, u1 = c
    t0, t1 = _span(lay, c)
    if window:
        assert isinstance(rows, _KeyRows)
        x = rows.window_t(t0, t1).transpose(1, 2)  # [Tc,L,d]
    else:
        assert isinstance(rows, _QueryRows)
        x = rows.blocks(t0, t1)  # [Tc,B,d]
    return x.view(s1 - s0, u1 - u0, *x.shape[1:])


def forward(lay: _Layout, qr: _QueryRows, kr: _KeyRows, vr: _KeyRows, bias: torch.Tensor,
            bias_x: torch.Tensor | None, ex: ExtraKeys | None, out: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Fills out [T, B, dv]; returns each query's (joint) log-sum-exp [T, B, 1]."""
    assert _FWD is not None
    B = lay.B
    lse_all = out.new_empty(lay.T, B, 1)
    for c in _chunks(lay, bias.shape[0]):
        gi, s0, s1, u0, u1 = c
        t0, t1 = _span(lay, c)
        o4, l4 = _FWD(_views(lay, qr, c, False), _views(lay, kr, c, True),
                      _views(lay, vr, c, True), 0.0, False,
                      attn_mask=bias[gi, u0:u1].unsqueeze(0), scale=scale)
        o = out[t0:t1]  # [Tc,B,dv]
        o_seq = o.view(o4.shape)  # [hc,uc,B,dv]
        lse_w = l4.reshape(t1 - t0, B, 1)
        if ex is None:
            o_seq.copy_(o4)
            lse_all[t0:t1] = lse_w
            continue
        assert bias_x is not None
        xk, xv = ex.keys(kr, c), ex.keys(vr, c)
        sx = ex.scores(bias_x, qr.blocks(t0, t1), xk, c, scale)  # [Tc,B,R]
        lse = joint_lse(lse_w, sx)
        # o = w * O_window + P_extra V_extra, w = exp(lse_window - lse)
        torch.mul(o4, (lse_w - lse).exp_().view(*o4.shape[:-1], 1), out=o_seq)
        ex.mm(o, sx.sub_(lse).exp_(), xv, transpose=False, alpha=1.0, beta=1.0)
        lse_all[t0:t1] = lse
    return lse_all


def backward(lay: _Layout, qr: _QueryRows, kr: _KeyRows, vr: _KeyRows, gr: _QueryRows,
             out: torch.Tensor, lse_all: torch.Tensor, bias: torch.Tensor,
             bias_x: torch.Tensor | None, ex: ExtraKeys | None, scale: float,
             dq: torch.Tensor, dkv: torch.Tensor,
             dkvs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Writes dq [T, B, d] and adds into dK, dV (``dkv`` [2, rows, d] in the flat layout,
    ``dkvs`` their [S, np, d] views). out: the forward's output [T, B, dv] (joint)."""
    assert _BWD is not None
    B, L = lay.B, lay.L
    for c in _chunks(lay, bias.shape[0], _blocklayout.CHUNK_ELEMS // BACKWARD_CHUNK_DIV):
        gi, s0, s1, u0, u1 = c
        t0, t1 = _span(lay, c)
        q4 = _views(lay, qr, c, False)
        gq, gk, gv = _BWD(_views(lay, gr, c, False), q4, _views(lay, kr, c, True),
                          _views(lay, vr, c, True), out[t0:t1].view(*q4.shape[:-1], -1),
                          lse_all[t0:t1].view(q4.shape[:-1]), 0.0, False,
                          attn_mask=bias[gi, u0:u1].unsqueeze(0), scale=scale)
        dq[t0:t1].view(gq.shape).copy_(gq)
        for j, gx in enumerate((gk, gv)):  # window gradients [hc,uc,L,d] -> the key rows
            blocks = dkv[j].view(-1, B, dkv.shape[-1])  # [rows/B,B,d]
            gx = gx.reshape(t1 - t0, L // B, B, -1)
            for o in range(L // B):
                blocks[t0 + o : t1 + o].add_(gx[:, o])
    if ex is None:
        return
    assert bias_x is not None
    for c in _chunks(lay, bias.shape[0]):  # the extra keys' part, in the forward's chunks
        t0, t1 = _span(lay, c)  # (bigger: their ops are small, their count is what costs)
        q, g = qr.blocks(t0, t1), gr.blocks(t0, t1)
        delta = (g * out[t0:t1]).sum(-1, keepdim=True)  # rowsum(dO * O) [Tc,B,1]
        xk, xv = ex.keys(kr, c), ex.keys(vr, c)
        px = ex.scores(bias_x, q, xk, c, scale).sub_(lse_all[t0:t1]).exp_()  # [Tc,B,R]
        ex.backward(c, px, g, q, delta, xk, xv, dq[t0:t1], dkvs, scale)
