"""The extra keys of the blocked sparse-attention engine (``_blocksparse``): R key
positions per query block beyond its window (Longformer's global keys, BigBird's random and
global blocks), their gather and their products with the chunk's rows."""

from __future__ import annotations

from typing import Any

import torch


def joint_lse(lse_w: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp of a row's window and its extra keys together: lse_w [..., 1], the
    extras' scores sx [..., R] -> [..., 1] (fresh). One fused logaddexp (with R = 1, as
    for one global token) instead of a logsumexp over their concatenation; -inf where
    both are empty."""
    sx_lse = sx if sx.shape[-1] == 1 else torch.logsumexp(sx, -1, keepdim=True)
    return torch.logaddexp(lse_w, sx_lse)


class ExtraKeys:
    """The extra keys of every query block: positions [nqb, R] (clamped), and whether all
    blocks share them (``shared``: Longformer's global keys), which turns their products
    into one GEMM per sequence instead of one small GEMM per block."""

    def __init__(self, pos: torch.Tensor) -> None:
        self.pos, self.R = pos, pos.shape[-1]  # [nqb,R]
        self.shared = bool((pos == pos[:1]).all())

    def keys(self, src: Any, c) -> torch.Tensor:
        """Extra keys (or values) of chunk c from ``src``, the engine's key rows
        (``_blocklayout._KeyRows``: ``src.seq`` [S, np, d]): [hc, R, d] if shared, else
        [Tc, R, d] (a small gather)."""
        _, s0, s1, u0, u1 = c
        if self.shared:
            return src.seq[s0:s1][:, self.pos[0]]  # [hc,R,d]
        xk = src.seq[s0:s1][:, self.pos[u0:u1]]  # [hc,uc,R,d]
        return xk.reshape(-1, self.R, xk.shape[-1])

    def mm(self, out: torch.Tensor, a: torch.Tensor, x: torch.Tensor, transpose: bool,
           alpha: float, beta: float) -> None:
        """out = beta * out + alpha * a @ (x^T if transpose else x), in place, for the rows
        of one chunk: out, a [Tc, B, .] (views; out must take ``view``), x from ``keys``."""
        if self.shared:  # the chunk's rows of one sequence against that sequence's keys
            hc = x.shape[0]
            out = out.view(hc, -1, out.shape[-1])
            a = a.reshape(hc, -1, a.shape[-1])
        out.baddbmm_(a, x.transpose(1, 2) if transpose else x, beta=beta, alpha=alpha)

    def add_grads(self, seq: torch.Tensor, c, a: torch.Tensor, b: torch.Tensor,
                  alpha: float) -> None:
        """Adjoint of ``keys`` for dK or dV ([S, np, d]): add alpha * a^T b (a [Tc, B, R],
        b [Tc, B, d]) into the extra keys' rows."""
        _, s0, s1, u0, u1 = c
        if self.shared:
            hc = s1 - s0
            gx = torch.bmm(a.reshape(hc, -1, self.R).transpose(1, 2),
                           b.reshape(hc, -1, b.shape[-1]))  # [hc,R,d]
            seq[s0:s1].index_add_(1, self.pos[0], gx, alpha=alpha)
            return
        idx = self.pos[u0:u1].reshape(-1)
        gx = torch.bmm(a.transpose(1, 2), b)  # [Tc,R,d]
        seq[s0:s1].index_add_(1, idx, gx.view(s1 - s0, idx.shape[0], -1), alpha=alpha)

    def scores(self, bias_x: torch.Tensor, q: torch.Tensor, xk: torch.Tensor, c,
               scale: float) -> torch.Tensor:
        """bias + scale * Q K^T of chunk c against the extra keys: [Tc, B, R] (fresh);
        bias_x [b|1, nqb, B, R], q [Tc, B, d], xk from ``keys``."""
        gi, s0, s1, u0, u1 = c
        if self.shared:  # one GEMM per sequence, the bias broadcast over the sequences
            hc, B = s1 - s0, q.shape[1]
            sx = torch.baddbmm(bias_x[gi, u0:u1].reshape(1, -1, self.R),
                               q.reshape(hc, -1, q.shape[-1]), xk.transpose(1, 2), alpha=scale)
            return sx.view(-1, B, self.R)  # fresh [Tc,B,R]
        sx = bias_x[gi, u0:u1].repeat(s1 - s0, 1, 1)  # a fresh copy [Tc,B,R]
        self.mm(sx, q, xk, transpose=True, alpha=scale, beta=1.0)
        return sx

    def backward(self, c, px: torch.Tensor, g: torch.Tensor, q: torch.Tensor,
                 delta: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, dq: torch.Tensor,
                 dkvs: tuple[torch.Tensor, torch.Tensor], scale: float,
                 keep: torch.Tensor | None = None) -> None:
        """The extra keys' part of the backward for chunk c: px [Tc, B, R] their joint
        probabilities (recomputed; overwritten), g = dO and delta = rowsum(dO * O) of the
        chunk's rows; adds into dq [Tc, B, d] (the chunk's rows) and dK, dV ``dkvs``
        ([S, np, d] each). ``keep``: the attention-dropout keep-mask / (1 - p) of the
        forward, or None."""
        dpx = px.new_empty(px.shape)  # dO V_extra^T [Tc,B,R]
        self.mm(dpx, g, xv, transpose=True, alpha=1.0, beta=0.0)
        pv = px  # the probabilities that multiplied V
        if keep is not None:
            dpx.mul_(keep)
            pv = keep.mul_(px)
        self.add_grads(dkvs[1], c, pv, g, alpha=1.0)
        ds = dpx.sub_(delta).mul_(px)  # dS without the scale
        self.mm(dq, ds, xk, transpose=False, alpha=scale, beta=1.0)
        self.add_grads(dkvs[0], c, ds, q, alpha=scale)
