"""Multi-head structure: per-head scales, routing of head outputs, shared K/V, head size.

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §3.6 (improved
multi-head mechanisms). Shape glossary: b batch, h (query) heads, g K/V heads, n query
length, m key length, d host head dim, dk query/key head dim, dv value head dim, w window.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    accumulation_dtype,
    check_qkv,
    pattern_bias,
    register_mechanism,
    require,
)
from ..core.masks import band_pattern
from .dense import Softmax, SoftmaxConfig
from .sparse import Band, BandConfig

FAMILY = "heads"
GLOBAL = -1  # a window (scale) that covers the whole sequence


# ----------------------------------------------------------------------------- multiscale


@dataclass(frozen=True, kw_only=True)
class MultiScaleConfig(MechanismConfig):
    name: ClassVar[str] = "multiscale"
    windows: tuple[int, ...] = ()  # w_1..w_h: one window per head (-1 = global); () = by layer
    scales: tuple[int, ...] = (1, 2, 4, 8, 16, GLOBAL)  # Omega: scales of the by-layer form
    spread: int = 2  # K_0: scales used by layer 0; layer l uses the first min(|Omega|, K_0 + l)

    def __post_init__(self) -> None:
        require(all(w >= GLOBAL for w in self.windows),
                f"multiscale windows must be >= 0 (or -1 for a global head), got "
                f"{list(self.windows)}")
        require(len(self.scales) > 0, "multiscale scales must list at least one scale, e.g. "
                "scales=[1, 4, -1]")
        finite = [s for s in self.scales if s != GLOBAL]
        require(all(s >= 0 for s in finite) and GLOBAL not in self.scales[:-1]
                and finite == sorted(set(finite)),
                f"multiscale scales must be distinct windows >= 0 in ascending order, "
                f"optionally ending with -1 (global), got {list(self.scales)}")
        require(self.spread >= 1, f"multiscale spread must be >= 1, got {self.spread}")
        default = MultiScaleConfig.__dataclass_fields__
        if self.windows and (self.scales != default["scales"].default
                             or self.spread != default["spread"].default):
            raise ValueError(
                "multiscale takes either windows=[...] (one window per head) or the by-layer "
                "scales=[...]/spread=..., not both; drop one of them")


def layer_windows(scales: tuple[int, ...], spread: int, num_heads: int,
                  layer_idx: int) -> tuple[int, ...]:
    """The by-layer rule: head i of layer l gets scale Omega[k_i] (see MultiScale)."""
    k_l = min(len(scales), spread + layer_idx)  # scales this layer uses: Omega[0:k_l]
    if num_heads == 1:
        return (scales[k_l - 1],)
    # spread the heads evenly over Omega[0:k_l], both ends included
    return tuple(scales[math.floor(i * (k_l - 1) / (num_heads - 1) + 0.5)]
                 for i in range(num_heads))


@register_mechanism(MultiScaleConfig)
class MultiScale(nn.Module):
    """Multi-scale multi-head self-attention: every head attends within its own window.

    Paper: Guo, Qiu, Liu, Xue, Zhang, "Multi-Scale Self-Attention for Text Classification",
    AAAI 2020 (the "Multi-Scale Transformer").
    Formula: head i with scale w_i is band attention softmax_j(q_i k_j / sqrt(d)) over
    |i - j| <= w_i (w_i = -1: every key), i.e. the ``band`` pattern of sparse.py with a
    window per head; heads of one window run together on band's paths (blocked engine from
    256 keys, FlexAttention on CUDA, dense masked softmax otherwise). Complexity O(n*w_i)
    per head. ``bias(n, m, layer_idx)`` is the [h, n, m] pattern (exact=True).
    Windows: listed (``windows=[...]``, one per head of the group, in head order) or by
    layer (``scales``/``spread``, read from ``ctx.layer_idx``): layer l spreads its heads
    evenly, in head order, over the smallest K_l = min(|Omega|, K_0 + l) scales of Omega,
    head i taking Omega[round(i * (K_l - 1) / (h - 1))] (a single head: Omega[K_l - 1]).
    Layer 0 thus has only small windows and each higher layer adds the next larger scale
    while keeping the small ones, so upper layers mix local and (near-)global heads. This
    follows the paper's principle, drawn from its analysis of BERT, of small scales in low
    layers and more large-scale heads in high layers.
    Deviations: the paper sets the number of heads per scale and layer with its own
    control factor; that formula could not be consulted here (no full text offline), so the
    schedule above is ours and documented as such; the listed form reproduces any
    per-layer assignment exactly (one plan rule per layer). With a plan on some heads of a
    layer, head i counts within that group.
    """

    example: ClassVar[str] = "multiscale"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Guo et al. 2020", exact=True, keys_are_tokens=True,
        complexity="O(n*w)",
    )

    def __init__(self, cfg: MultiScaleConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        if cfg.windows and len(cfg.windows) != dims.num_heads:
            raise ValueError(
                f"multiscale lists {len(cfg.windows)} windows but is built for "
                f"{dims.num_heads} heads; give exactly one window per head (windows=[...] of "
                f"length {dims.num_heads}) or use the by-layer form (no windows)")

    def windows(self, layer_idx: int = 0) -> tuple[int, ...]:
        """w_i per head (-1 = global) at layer ``layer_idx``."""
        c = self.cfg
        if c.windows:
            return c.windows
        return layer_windows(c.scales, c.spread, self.dims.num_heads, layer_idx)

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        """[h, n, m] additive bias (0 / -inf): head i's band |i - j| <= w_i."""
        full = torch.ones(n, m, dtype=torch.bool)
        pats = [full if w == GLOBAL else band_pattern(n, m, w) for w in self.windows(layer_idx)]
        return pattern_bias(torch.stack(pats))

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        n, m = q.shape[2], k.shape[2]
        reach = max(n, m)  # a window this wide sees every key
        groups: dict[int, list[int]] = {}  # effective window -> heads (GLOBAL: all keys)
        for i, w in enumerate(self.windows(ctx.layer_idx)):
            groups.setdefault(GLOBAL if w == GLOBAL or w >= reach - 1 else w, []).append(i)
        outs, probs, order = [], [], []
        for w, heads in groups.items():
            dims = HeadDims(len(heads), self.dims.head_dim, self.dims.max_len)
            if w == GLOBAL and (n == m or not ctx.causal):
                mech: nn.Module = Softmax(SoftmaxConfig(), dims)
            else:  # band; also a global head under causality with n != m (raw positions)
                mech = Band(BandConfig(window=reach if w == GLOBAL else w), dims)
            mech.train(self.training)
            if len(groups) == 1:
                return mech(q, k, v, ctx)
            idx = torch.tensor(heads, device=q.device)
            res = mech(q.index_select(1, idx), k.index_select(1, idx), v.index_select(1, idx),
                       ctx)
            outs.append(res.out)  # [b,hw,n,dv]
            probs.append(res.probs)
            order += heads
        inverse = torch.argsort(torch.tensor(order, device=q.device))
        out = torch.cat(outs, 1).index_select(1, inverse)  # [b,h,n,dv] in head order
        p = None
        if ctx.need_weights:
            p = torch.cat(probs, 1).index_select(1, inverse)  # [b,h,n,m]
        return AttnOutput(out, p)


# ------------------------------------------------------------------------ capsule routing


@dataclass(frozen=True, kw_only=True)
class CapsuleRoutingConfig(MechanismConfig):
    name: ClassVar[str] = "capsule_routing"
    iterations: int = 3  # r: dynamic-routing iterations

    def __post_init__(self) -> None:
        require(self.iterations >= 1,
                f"capsule_routing iterations must be >= 1, got {self.iterations}")


def squash(s: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Capsule non-linearity over the last dim: ||s||^2 / (1 + ||s||^2) * s / ||s||.

    Written as s * ||s|| / (1 + ||s||^2) with ||s|| = sqrt(sum s^2 + eps): exactly 0 at
    s = 0 with a finite gradient there."""
    sq = s.square().sum(-1, keepdim=True)  # [..., 1]
    return s * (sq + eps).sqrt() / (1 + sq)


@register_mechanism(CapsuleRoutingConfig)
class CapsuleRouting(nn.Module):
    """Routing-by-agreement over the head outputs (input capsules -> output capsules).

    Papers: Li, Yang, Dou, Wang, Lyu, Tu, "Information Aggregation for Multi-Head Attention
    with Routing-by-Agreement", NAACL 2019; Gu, Feng, "Improving Multi-head Attention with
    Capsule Networks", NLPCC 2019. Routing: Sabour, Frosst, Hinton, "Dynamic Routing
    Between Capsules", NeurIPS 2017.
    Formula, per token: input capsules u_i = head i's softmax attention output [d]
    (i = 1..h); votes u_{j|i} = W_ij u_i (W [h, h, d, d], one map per input/output pair);
    logits b_ij = 0; r times: c_ij = softmax_j(b_ij), s_j = sum_i c_ij u_{j|i},
    o_j = squash(s_j), and (except after the last) b_ij += u_{j|i} . o_j. The output
    capsules o_1..o_h [b,h,n,d] take the heads' place, so the host's output projection
    concatenates and projects them as before. Complexity O(h*n*m*d + r*h^2*n*d^2).
    Scope "layer": every output capsule reads every head. ``need_weights`` returns the
    input heads' softmax probabilities [b,h,n,m] (the maps being aggregated; routing is
    non-linear, so no effective [n, m] weights exist for an output capsule).
    Init: W_ij ~ N(0, 1/d), from the global RNG (each vote keeps its capsule's scale).
    Training memory: with gradients on, the routing runs under a non-reentrant activation
    checkpoint (the votes and each iteration's capsules, h times the output's size each,
    are recomputed in the backward instead of kept).
    Deviations: h output capsules of size d (Li et al. also vary their number; here it is
    tied to the host's output projection); EM routing is not implemented (dynamic routing
    only); gradients flow through every routing iteration; the host's output projection
    W_O still applies to the concatenated output capsules (it keeps the layer's shapes and
    pretrained weights).
    """

    example: ClassVar[str] = "capsule_routing"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Li et al. 2019; Gu & Feng 2019", scope="layer", exact=False,
        complexity="O(h*n*m*d + r*h^2*n*d^2)",
    )

    def __init__(self, cfg: CapsuleRoutingConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h, d = dims.num_heads, dims.head_dim
        self.W = nn.Parameter(torch.randn(h, h, d, d) * d**-0.5)  # [h_in,h_out,d_in,d_out]
        self.attend = Softmax(SoftmaxConfig(), dims)

    def route(self, u: torch.Tensor) -> torch.Tensor:
        """Input capsules u [b,h,n,d] -> output capsules [b,h,n,d] (dynamic routing), in the
        accumulation dtype for 16-bit u: in fp16 squash's eps is 0, so a zero capsule (a
        padded query's) had an infinite gradient, and the agreement logits overflow."""
        dtype = u.dtype
        u = u.to(accumulation_dtype(dtype))
        with torch.autocast(u.device.type, enabled=False):  # fp32 under autocast too
            votes = torch.einsum("bind,ijde->bnije", u, self.W.to(u.dtype))  # [b,n,h,h,d]
            logits = votes.new_zeros(votes.shape[:-1])  # b_ij [b,n,h_in,h_out]
            for r in range(self.cfg.iterations):
                c = logits.softmax(-1)  # c_ij over output capsules j
                out = squash(torch.einsum("bnij,bnije->bnje", c, votes))  # o_j [b,n,h,d]
                if r + 1 < self.cfg.iterations:
                    logits = logits + torch.einsum("bnije,bnje->bnij", votes, out)  # agreement
        return out.transpose(1, 2).to(dtype)  # [b,h,n,d]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        require(v.shape[-1] == self.dims.head_dim,
                f"capsule_routing was built for value head dim {self.dims.head_dim} but v has "
                f"{v.shape[-1]}; build it with HeadDims(head_dim={v.shape[-1]})")
        res = self.attend(q, k, v, ctx)  # input capsules [b,h,n,d] (+ probs)
        if not torch.is_grad_enabled():
            return AttnOutput(self.route(res.out), res.probs)
        # the votes and every iteration's capsules are recomputed in the backward instead of
        # kept (r+1 tensors of h times the output's size); routing draws no random numbers
        out = checkpoint(self.route, res.out, use_reentrant=False, preserve_rng_state=False)
        return AttnOutput(out, res.probs)


# ------------------------------------------------------------------------ grouped query


@dataclass(frozen=True, kw_only=True)
class GroupedQueryConfig(MechanismConfig):
    name: ClassVar[str] = "gqa"
    kv_heads: int = 1  # g: K/V heads; each serves a group of h/g consecutive query heads

    def __post_init__(self) -> None:
        require(self.kv_heads >= 1, f"gqa kv_heads must be >= 1, got {self.kv_heads}")


def group_kv_heads(x: torch.Tensor, num_heads: int, kv_heads: int) -> torch.Tensor:
    """[b,g|h,m,d] -> [b,h,m,d]: K/V head j serves query heads j*h/g .. (j+1)*h/g - 1.

    With h heads in, each group of h/g consecutive heads is mean-pooled first: the same
    conversion as mean-pooling the host's K/V projection weights per group (GQA
    "uptraining" init, ``hf.surgery``); the projection is linear, so both agree.
    """
    b, hk, m, d = x.shape
    if hk == kv_heads:
        pass
    elif hk == num_heads:
        x = x.view(b, kv_heads, num_heads // kv_heads, m, d).mean(2)  # [b,g,m,d]
    else:
        raise ValueError(f"k/v have {hk} heads; expected {kv_heads} or {num_heads}")
    if kv_heads == num_heads:
        return x
    rep = num_heads // kv_heads
    return x[:, :, None].expand(b, kv_heads, rep, m, d).reshape(b, num_heads, m, d)


@register_mechanism(GroupedQueryConfig)
class GroupedQuery(nn.Module):
    """Grouped-query attention: g K/V heads, each shared by a group of h/g query heads.

    Paper: Ainslie, Lee-Thorp, de Jong, Zemlyanskiy, Lebron, Sanghai, "GQA: Training
    Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", EMNLP 2023.
    Formula: out_i = softmax(q_i K_{g(i)}^T / sqrt(d)) V_{g(i)} with g(i) = floor(i*g/h);
    g = h is multi-head attention, g = 1 multi-query attention (``mqa`` is this with g = 1).
    Conversion (as the paper): each K/V projection head of a group is the mean of the
    pretrained heads of that group. Scope "module", ``caps.kv_heads = g`` on the instance:
    surgery shrinks the host's K/V projections to g heads (mean-pooled), so k, v arrive
    with g heads; k, v with h heads (a fused Q/K/V host, or standalone use) are
    mean-pooled per group here, the same conversion on the projected tensors. Then dense
    softmax (``softmax`` is reused). Complexity O(n*m) per head; K/V projections and cache
    shrink h/g-fold.
    """

    example: ClassVar[str] = "gqa(kv_heads=2)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Ainslie et al. 2023", scope="module", exact=False,
        complexity="O(n*m)",
    )

    def __init__(self, cfg: GroupedQueryConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h, g = dims.num_heads, cfg.kv_heads
        if h % g:
            ok = [x for x in range(1, h + 1) if h % x == 0]
            raise ValueError(
                f"gqa(kv_heads={g}) needs kv_heads to divide the {h} query heads; use one "
                f"of {ok}")
        vars(self)["caps"] = dataclasses.replace(type(self).caps, kv_heads=g)
        self.attend = Softmax(SoftmaxConfig(), dims)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        g = self.cfg.kv_heads
        check_qkv(q, k, v, self.dims, kv_heads_ok=(g,))
        h = q.shape[1]
        return self.attend(q, group_kv_heads(k, h, g), group_kv_heads(v, h, g), ctx)


# ---------------------------------------------------------------------------- head size


@dataclass(frozen=True, kw_only=True)
class HeadSizeConfig(MechanismConfig):
    name: ClassVar[str] = "head_size"
    dk: int | None = None  # d_p (query/key): head size of Q and K; None = the host's d
    dv: int | None = None  # d_p (value): head size of V; None = the host's d

    def __post_init__(self) -> None:
        for key in ("dk", "dv"):
            val = getattr(self, key)
            require(val is None or val >= 1, f"head_size {key} must be >= 1, got {val}")


@register_mechanism(HeadSizeConfig)
class HeadSize(nn.Module):
    """Head size decoupled from the number of heads: Q/K heads of size dk, V heads of dv.

    Paper: Bhojanapalli, Yun, Rawat, Reddi, Kumar, "Low-Rank Bottleneck in Multi-head
    Attention Models", ICML 2020. With d = hidden/h, each head's n x n score matrix has
    rank <= d < n; the paper fixes the head size independently of h (d_p, e.g. = n).
    Formula: out_i = softmax(q_i K_i^T / sqrt(dk)) V_i with q_i, k_i [dk], v_i [dv]:
    W_q, W_k [hidden -> h*dk], W_v [hidden -> h*dv], W_o [h*dv -> hidden].
    Scope "module", ``caps.head_dims = (dk, dv)`` on the instance: surgery re-sizes the
    host's Q/K/V projections and its output projection's input (``hf.surgery``), so q, k
    arrive as [b,h,n,dk] and v as [b,h,m,dv]; this module is then dense softmax (reused)
    at scale 1/sqrt(dk). Complexity O(n*m*(dk+dv)) per head.
    Conversion (ours; the paper trains from scratch): per head the first min(d, dk) rows of
    W_q/W_k and min(d, dv) rows of W_v (and columns of W_o) are the pretrained ones, W_q's
    scaled by sqrt(dk) times the host's old score scale; new K and V rows are random
    (N(0, std of the old weights)), new Q rows and W_o columns zero. So for dk, dv >= d the
    converted model computes exactly the pretrained function, and the new dimensions get
    gradients (the zero Q rows meet random K rows). dk, dv < d truncate each head.
    Standalone, q/k/v must already have these head sizes. ``example`` is the bare name
    (dk = dv = the host's d: no re-sizing, plain softmax), the one setting every host takes:
    the contract tests feed host-size heads, and a fused Q/K/V host (ModernBERT) is refused
    for any other dk, dv. Hosts: BERT layout and DistilBERT, with h*dk and h*dv multiples of
    d (the host still splits the projections into d-sized pieces).
    """

    example: ClassVar[str] = "head_size"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Bhojanapalli et al. 2020", scope="module", exact=False,
        complexity="O(n*m*(dk+dv))",
    )

    def __init__(self, cfg: HeadSizeConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.dk = cfg.dk or dims.head_dim  # resolved d_k
        self.dv = cfg.dv or dims.head_dim  # resolved d_v
        vars(self)["caps"] = dataclasses.replace(type(self).caps, head_dims=(self.dk, self.dv))
        self.attend = Softmax(SoftmaxConfig(), dims)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if q.shape[-1] != self.dk or v.shape[-1] != self.dv:
            raise ValueError(
                f"head_size(dk={self.dk}, dv={self.dv}) got q/k head dim {q.shape[-1]} and v "
                f"head dim {v.shape[-1]}; install it with attnlab.apply_plan (which re-sizes "
                "the Q/K/V projections) or pass tensors of those head sizes")
        return self.attend(q, k, v, ctx)  # scale: ctx.scale, else 1/sqrt(dk)
