"""The extra keys of the blocked sparse-attention engine (``_blocksparse``): R key
positions per query block beyond its window (Longformer's global keys, BigBird's random and
global blocks), their gather and their products with the chunk's rows."""

from __future__ import annotations

from typing import Any

import torch


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
