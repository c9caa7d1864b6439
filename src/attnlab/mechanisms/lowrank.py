"""Low-rank attention: keys and values compressed along the length axis (Linformer), and
low-rank attention scores with a band for local dependencies (Guo et al. 2019).

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.4. The Nyström
landmark methods of the same family (Nyströmformer, CSALR) live in ``landmarks.py``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
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
from ..core.slicing import over_head_groups
from .dense import Softmax, SoftmaxConfig
from .sparse import Band, BandConfig

Sharing = Literal["none", "kv", "headwise", "layerwise"]


@dataclass(frozen=True, kw_only=True)
class LinformerConfig(MechanismConfig):
    name: ClassVar[str] = "linformer"
    k: int = 64  # k: projected length (rows of E_i, F_i in R^{k x n})
    share: Sharing = "headwise"  # sharing of E_i, F_i: none / kv (E = F) / headwise / layerwise

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
    Sharing (``share``, the paper's §4 "parameter sharing" modes):
    "none": E_i, F_i per head, [h, k, N] each; "headwise" (default, as in the official
    fairseq code, whose compression acts on the whole layer input): one E and one F [k, N]
    for all heads of this instance; "kv": additionally E = F (one [k, N] matrix);
    "layerwise": one [k, N] matrix for keys and values, all heads and every layer — the
    instances that surgery builds from one ``share="layerwise"`` config in one
    ``apply_plan`` hold the same ``nn.Parameter`` (:meth:`tie`, called by surgery), so it
    trains once with the gradient of every layer, is saved once and reloads tied.
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
        # "kv", "layerwise": no F of its own; E serves both (its gradient sums both uses)
        own_f = cfg.share in ("none", "headwise")
        self.F = nn.Parameter(torch.empty(shape)) if own_f else None
        self.reset_parameters()

    @classmethod
    def tie(cls, instances: Sequence[nn.Module]) -> None:
        """Layerwise sharing: the instances (built from one config by one ``apply_plan``,
        in layer order) all take the first one's E. Other sharing modes tie nothing."""
        layerwise = [m for m in instances
                     if isinstance(m, Linformer) and m.cfg.share == "layerwise"]
        if len(layerwise) < 2:
            return
        shared = layerwise[0].E
        for m in layerwise[1:]:
            if m.E.shape != shared.shape:
                raise ValueError(
                    f"linformer(share='layerwise') instances differ in shape ({tuple(m.E.shape)}"
                    f" vs {tuple(shared.shape)}); build them with one max_len"
                )
            m.E = shared

    @property
    def value_proj(self) -> torch.Tensor:
        """F (E itself under ``share="kv"`` or ``"layerwise"``)."""
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
        key_mask, scale, drop = ctx.key_mask, ctx.scale_for(q.shape[-1]), ctx.dropout
        training, need_weights = self.training, ctx.need_weights

        def heads(q, k, v, e, f) -> AttnOutput:  # a group of g heads; e, f [k,N] or [g,k,N]
            if key_mask is not None:
                keep = key_mask[:, None, :, None].to(k.dtype)  # [b,1,m,1]
                k, v = k * keep, v * keep
            kp, vp = self._project(e, k), self._project(f, v)  # [b,g,k,d], [b,g,k,dv]
            p = torch.softmax((q @ kp.transpose(-1, -2)) * scale, dim=-1)  # [b,g,n,k]
            pd = F.dropout(p, drop, training=True) if training and drop else p
            probs = None
            if need_weights:
                probs = p @ f[..., :m].to(p.dtype)  # [b,g,n,k] @ [k,m] or [g,k,m]
                if key_mask is not None:
                    probs = probs * key_mask[:, None, None, :].to(probs.dtype)
            return AttnOutput(pd @ vp, probs)  # out [b,g,n,dv]

        # heads are independent: a few at a time keeps [b,g,n,k] small (core/slicing.py)
        per_head = q.shape[0] * q.shape[2] * self.cfg.k * q.element_size()
        if self.E.dim() == 3:  # one E, F per head: cut them with the heads
            return over_head_groups(heads, (q, k, v), per_head,
                                    per_head=(self.E, self.value_proj))
        e, f = self.E, self.value_proj
        return over_head_groups(lambda q, k, v: heads(q, k, v, e, f), (q, k, v), per_head)


# ------------------------------------------------------------------------- low rank + band


@dataclass(frozen=True, kw_only=True)
class LowRankBandConfig(MechanismConfig):
    name: ClassVar[str] = "lowrank_band"
    rank: int = 8  # r: key/query dimension of the low-rank attention (its rank bound)
    window: int = 8  # w: one-sided width of the band attention, |i - j| <= w

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lowrank_band rank must be >= 1, got {self.rank}")
        if self.window < 0:
            raise ValueError(f"lowrank_band window must be >= 0, got {self.window}")


@register_mechanism(LowRankBandConfig)
class LowRankBand(nn.Module):
    """Low-rank attention for non-local dependencies plus band attention for local ones.

    Paper: Guo, Qiu, Xue, Zhang, "Low-Rank and Locality Constrained Self-Attention for
    Sequence Modeling", IEEE/ACM Transactions on Audio, Speech, and Language Processing
    27(12), 2019 (summarised in Lin et al.'s survey, §4.4.1: the attention matrix is
    decomposed into a low-rank attention module with a small key dimension, capturing
    non-local interactions, and a band attention module, capturing local ones).
    Formula (per head; W^Q_r, W^K_r in R^{d x r} learned, per layer and head):
        A_low  = softmax((Q W^Q_r)(K W^K_r)^T / sqrt(r))            rank(logits) <= r
        A_band = softmax(Q K^T / sqrt(d) over |i - j| <= w)         band-sparse
        out    = (A_low + A_band) / 2 @ V
    i.e. the attention matrix is the sum of a low-rank-parameterised and a band component,
    each row-normalised and weighted 1/2 so that rows still sum to 1.
    Parameters: ``wq``, ``wk`` [h, d, r] (Xavier-uniform per [d, r] matrix, from the
    global torch RNG). The band part is the exact ``band`` mechanism (blocked engine from
    256 positions, FlexAttention on CUDA); the low-rank part is the ``softmax`` mechanism on
    the r-dimensional queries and keys. Complexity O(n*m*r + n*w*d) (the low-rank part
    is a dense n x m softmax of rank-r logits: it constrains, it does not save time).
    Deviations: the paper is closed access and was not read; the combination (equal
    weights 1/2 of the two normalised components) is our reading of the survey's
    "decompose into a low-rank and a band module" and the paper's abstract (self-attention
    as a matrix decomposition problem). The projections act on the host's projected q, k
    (a factorised W^Q W^Q_r, W^K W^K_r), so a pretrained encoder keeps its Q/K weights.
    The low-rank scores use 1/sqrt(r) whatever ``ctx.scale`` says (the band part uses
    ``ctx.scale``). ``need_weights`` returns (A_low + A_band) / 2; ``ctx.dropout`` drops
    each component's probabilities independently. Causal needs n == m (refused otherwise:
    the band reads raw positions, the low-rank softmax aligns queries to the last keys).
    """

    example: ClassVar[str] = "lowrank_band(rank=2, window=2)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="lowrank", paper="Guo et al. 2019", keys_are_tokens=True,
        complexity="O(n*m*r + n*w)",
    )

    def __init__(self, cfg: LowRankBandConfig, dims: HeadDims) -> None:
        super().__init__()
        if cfg.rank >= dims.head_dim:
            warnings.warn(
                f"lowrank_band rank={cfg.rank} >= head_dim={dims.head_dim}: the scores are not "
                f"constrained below the head's own rank; use rank < {dims.head_dim}",
                stacklevel=2)
        self.cfg, self.dims = cfg, dims
        shape = (dims.num_heads, dims.head_dim, cfg.rank)
        self.wq = nn.Parameter(torch.empty(shape))  # [h,d,r]
        self.wk = nn.Parameter(torch.empty(shape))  # [h,d,r]
        self.lowrank = Softmax(SoftmaxConfig(), HeadDims(dims.num_heads, cfg.rank))
        self.band = Band(BandConfig(window=cfg.window), dims)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform per [d, r] projection: U(-a, a), a = sqrt(6 / (d + r))."""
        bound = math.sqrt(6.0 / (self.dims.head_dim + self.cfg.rank))
        with torch.no_grad():
            self.wq.uniform_(-bound, bound)
            self.wk.uniform_(-bound, bound)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if ctx.causal and q.shape[2] != k.shape[2]:
            # the band part reads raw positions (j <= i, as ``band``), the low-rank part the
            # softmax convention (queries aligned to the last keys): they would disagree
            raise ValueError(
                f"lowrank_band is causal only over one sequence (n == m, keys_are_tokens), "
                f"got n={q.shape[2]} queries and m={k.shape[2]} keys; pass the whole "
                "sequence's queries, or use it without causal"
            )
        qr = q @ self.wq.to(q.dtype)  # [b,h,n,d] @ [h,d,r] -> [b,h,n,r]
        kr = k @ self.wk.to(k.dtype)  # [b,h,m,r]
        low = self.lowrank(qr, kr, v, dataclasses.replace(ctx, scale=self.cfg.rank**-0.5))
        band = self.band(q, k, v, ctx)
        out = (low.out + band.out) * 0.5  # [b,h,n,dv]
        probs = None
        if ctx.need_weights and low.probs is not None and band.probs is not None:
            probs = (low.probs + band.probs) * 0.5  # [b,h,n,m]
        return AttnOutput(out, probs)
