"""Low-rank attention: keys and values compressed along the length axis."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    check_qkv,
    register_mechanism,
)

Sharing = Literal["headwise", "kv", "none"]


@dataclass(frozen=True, kw_only=True)
class LinformerConfig(MechanismConfig):
    name: ClassVar[str] = "linformer"
    k: int = 64  # k: projected length (rows of E_i, F_i in R^{k x n})
    share: Sharing = "headwise"  # sharing of E_i, F_i: across heads / also E = F / none

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k (the projected length) must be >= 1, got {self.k}")


@register_mechanism(LinformerConfig)
class Linformer(nn.Module):
    """Linformer: keys and values projected to k rows along the sequence axis.

    Paper: Wang, Li, Khabsa, Fang, Ma, "Linformer: Self-Attention with Linear
    Complexity", arXiv 2006.04768, 2020.
    Formula: head_i = softmax(Q (E_i K)^T / sqrt(d)) (F_i V), with E_i, F_i in R^{k x N},
    N = dims.max_len. For a sequence of m < N keys only the first m columns of E_i, F_i
    are used, which equals the paper's zero padding of K, V to N rows (tested).
    Complexity O(n*k) (plus O(m*k*d) for the projections).
    Sharing (``share``): "headwise" (default, as in the official fairseq code, whose
    compression acts on the whole layer input): one E and one F for all heads of this
    instance; "kv": additionally E = F; "none": E_i, F_i per head. The paper's layerwise
    sharing (one matrix across layers) is not offered: instances do not share parameters.
    Init: as the official fairseq code (examples/linformer, ``reset_parameters``):
    Xavier-uniform with gain 1/sqrt(2) on each [k, N] matrix.
    Deviations: E, F act on the host's projected K, V (the paper's formula, E K W^K);
    fairseq compresses the layer input before k_proj, which differs only in where the
    K/V projection bias enters. Padded keys (and values) are zeroed before the projection
    so that they are invisible (fairseq ignores key padding). A row whose keys are all
    padding therefore sees K' = V' = 0 and gives 0. Not causal: every compressed slot
    mixes all positions. ``need_weights`` returns the effective weights over the original
    keys, P F[:, :m] [b,h,n,m] (out = that matrix @ V exactly); rows need not be positive
    or sum to 1. Dropout ``ctx.dropout`` applies to P (the [b,h,n,k] probabilities).
    """

    example: ClassVar[str] = "linformer(k=8)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="lowrank", paper="Wang et al. 2020", causal_ok=False, needs_max_len=True,
        keys_are_tokens=True,
        exact=False, complexity="O(n*k)",
    )

    def __init__(self, cfg: LinformerConfig, dims: HeadDims) -> None:
        super().__init__()
        if dims.max_len is None:
            raise ValueError(
                "linformer needs HeadDims.max_len: E and F have one column per position"
            )
        if cfg.k >= dims.max_len:
            warnings.warn(
                f"linformer k={cfg.k} >= max_len={dims.max_len}: the projection does not "
                f"shorten the keys, so this is not low-rank attention; use k < {dims.max_len}",
                stacklevel=2)
        self.cfg, self.dims = cfg, dims
        shape = (cfg.k, dims.max_len) if cfg.share != "none" else (dims.num_heads, cfg.k,
                                                                     dims.max_len)
        self.E = nn.Parameter(torch.empty(shape))  # [k,N] or [h,k,N]
        # "kv": no F of its own; E serves both (its gradient sums both uses)
        self.F = None if cfg.share == "kv" else nn.Parameter(torch.empty(shape))
        self.reset_parameters()

    @property
    def value_proj(self) -> torch.Tensor:
        """F (E itself under ``share="kv"``)."""
        return self.E if self.F is None else self.F

    def reset_parameters(self) -> None:
        """Xavier-uniform, gain 1/sqrt(2), per [k, N] matrix (fairseq's Linformer init)."""
        assert self.dims.max_len is not None  # __init__ refuses dims without max_len
        bound = math.sqrt(6.0 / (self.cfg.k + self.dims.max_len)) / math.sqrt(2.0)
        with torch.no_grad():
            self.E.uniform_(-bound, bound)
            if self.F is not None:
                self.F.uniform_(-bound, bound)

    def _project(self, proj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """proj [k,N] or [h,k,N], x [b,h,m,d] -> [b,h,k,d] using the first m columns."""
        m = x.shape[-2]
        if proj.dim() == 2:
            return torch.einsum("km,bhmd->bhkd", proj[:, :m].to(x.dtype), x)
        return torch.einsum("hkm,bhmd->bhkd", proj[:, :, :m].to(x.dtype), x)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        m = k.shape[-2]
        if m > self.dims.max_len:
            raise ValueError(
                f"linformer got a sequence of {m} keys but its E, F projections cover "
                f"max_len={self.dims.max_len} positions; build it with a larger max_len "
                f"(HeadDims.max_len >= {m}) or truncate inputs to {self.dims.max_len} tokens"
            )
        if ctx.causal:
            raise ValueError(
                "linformer cannot be causal (each compressed slot mixes all positions); "
                "use it in encoders only"
            )
        if ctx.key_mask is not None:
            keep = ctx.key_mask[:, None, :, None].to(k.dtype)  # [b,1,m,1]
            k, v = k * keep, v * keep
        kp = self._project(self.E, k)  # [b,h,k,d]
        vp = self._project(self.value_proj, v)  # [b,h,k,dv]
        scores = (q @ kp.transpose(-1, -2)) * ctx.scale_for(q.shape[-1])  # [b,h,n,k]
        p = torch.softmax(scores, dim=-1)  # [b,h,n,k]
        pd = F.dropout(p, ctx.dropout, training=True) if self.training and ctx.dropout else p
        out = pd @ vp  # [b,h,n,dv]
        probs = None
        if ctx.need_weights:
            fm = self.value_proj[..., :m].to(p.dtype)  # [k,m] or [h,k,m]
            probs = p @ fm  # [b,h,n,m]
            if ctx.key_mask is not None:
                probs = probs * ctx.key_mask[:, None, None, :].to(probs.dtype)
        return AttnOutput(out, probs)
