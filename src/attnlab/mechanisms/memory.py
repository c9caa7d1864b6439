"""Compressed key-value memory: queries attend a short memory instead of every key.

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.4 (query
prototyping and memory compression). This file: ``mca`` (a strided convolution shortens K
and V), ``isab`` (learned inducing points summarise the keys), ``luna`` (a packed memory,
learned at the first layer and passed up the stack). ``poolingformer`` (pooled keys and
values in a second, wider window) lives in ``pooling.py``.

Head space. Every mechanism here receives the host's per-head q [b,h,n,d], k [b,h,m,d],
v [b,h,m,dv]. Where a paper attends a memory H with its own K/V projections (the Set
Transformer's MAB, Luna's unpack attention), the memory is here built with one attention
matrix A applied to both K and V: keys A K and values A V. That is exactly the paper's
H W_K, H W_V for H = A X (the attended inputs) with the host's own projections W_K, W_V,
i.e. the paper's second attention with its first attention's value/output projections set
to the identity.

Shape glossary: b batch, h heads, n query length, m key length, d head dim, dv value head
dim, c compression, S compressed slots, B local block, l memory / inducing points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple

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
    masked_softmax,
    register_mechanism,
    require,
)
from ._maskedsdpa import masked_sdpa

FAMILY = "memory"


def _keep(ctx: AttnContext, b: int, m: int, device: torch.device) -> torch.Tensor:
    """[b,m] bool: the keys that are not padding."""
    if ctx.key_mask is None:
        return torch.ones(b, m, dtype=torch.bool, device=device)
    return ctx.key_mask.to(device=device, dtype=torch.bool).expand(b, m)


def _dropout(probs: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(probs, p, training=True) if p > 0 else probs


# ------------------------------------------------------------------------------------- mca


@dataclass(frozen=True, kw_only=True)
class MCAConfig(MechanismConfig):
    name: ClassVar[str] = "mca"
    compression: int = 3  # c: kernel size = stride of the K/V convolution (the paper: 3)
    local_block: int = 0  # B: also attend the query's own block of B raw keys (0 = off)
    init: Literal["mean", "random"] = "mean"  # conv init: span mean (I/c per tap) or Conv1d's

    def __post_init__(self) -> None:
        require(self.compression >= 1, f"mca compression must be >= 1 (kernel = stride = c; "
                f"1 = no compression), got {self.compression}; the paper uses compression=3")
        require(self.local_block >= 0, f"mca local_block must be >= 0 (0 = no block-local "
                f"keys), got {self.local_block}; the paper's local layers use blocks of 256")
        require(self.init in ("mean", "random"), f"mca init must be 'mean' or 'random', got "
                f"{self.init!r}")


def compress(x: torch.Tensor, keep: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided convolution along the sequence, kernel = stride = c, one kernel per head.

    x [b,h,m,d] (the padded keys, keep False, are zeroed here), keep [b,m] bool,
    weight [h,o,d,c] (out channel, in channel, tap), bias [h,o]. The sequence is padded
    with zeros to S*c rows, S = ceil(m / c). Returns slots [b,h,S,o] and slot_ok [b,S]
    (True where the slot holds at least one kept key).
    """
    b, h, m, d = x.shape
    c = weight.shape[-1]
    S = -(-m // c)
    x = F.pad(x * keep[:, None, :, None].to(x.dtype), (0, 0, 0, S * c - m))  # [b,h,S*c,d]
    # row s: x_{s*c}, ..., x_{s*c+c-1} concatenated (a copy only when x is a strided view,
    # as the heads of a model's [b, m, h, d] projection are when m needs no padding)
    x = x.reshape(b, h, S, c * d)
    # Kc_s = sum_t W_t x_{s*c+t} + bias, as one matmul with the taps stacked [h,c*d,o]
    w = weight.to(x.dtype).permute(0, 3, 2, 1).reshape(h, c * d, -1)  # [h,c*d,o]
    slots = torch.baddbmm(bias.to(x.dtype)[:, None, :], x.transpose(0, 1).reshape(h, b * S, -1),
                          w)  # [h,b*S,o]
    slots = slots.view(h, b, S, -1).transpose(0, 1)  # [b,h,S,o]
    slot_ok = F.pad(keep, (0, S * c - m)).view(b, S, c).any(-1)  # [b,S]
    return slots, slot_ok


@register_mechanism(MCAConfig)
class MCA(nn.Module):
    """Memory-compressed attention: K and V shortened by a strided convolution.

    Paper: Liu, Saleh, Pot, Goodrich, Sepassi, Kaiser, Shazeer, "Generating Wikipedia by
    Summarizing Long Sequences", ICLR 2018 (§4.2.3; tensor2tensor
    ``multihead_self_attention_reduced`` with reduction "conv").
    Formula: Kc = Conv_c(K), Vc = Conv_c(V) with kernel = stride = c (S = ceil(m/c) slots,
    Kc_s = sum_{t<c} W^K_t k_{s*c+t} + b^K); out = softmax(Q Kc^T / sqrt(d)) Vc.
    Complexity O(n*m/c) (the paper divides the activations by c; still quadratic).
    ``local_block`` B > 0: one softmax over the union of the compressed slots and the B raw
    keys of the query's own block (j // B == i // B), out = P_loc V_blk + P_c Vc; complexity
    O(n*(m/c + B)). The paper combines local and memory-compressed attention by
    alternating layers (its "LMLML" decoder); that is a plan with ``block_local`` on some
    layers and ``mca`` on others. ``local_block`` joins both key sets inside one layer.
    Causal: slot s is visible to query i only when its whole span is at or before i,
    s*c + c - 1 <= i (queries aligned to the last n keys, as core.reference; the
    mesh-tensorflow ``multihead_self_attention_memory_compressed`` mask), so no slot mixes
    a future key. Queries i < c - 1 then see no slot: with ``local_block`` 0 they give 0.
    Convolution: one [d, d, c] kernel and a bias per head, separate for K and V. The
    paper's convolution acts on the projected K and V of all heads together (tensor2tensor:
    on the layer input, before the projections); per-head kernels are the block-diagonal
    part of that, which keeps the mechanism head-scoped. ``init="mean"``: every tap is I/c
    and the bias 0, so a slot starts as the mean of its keys (a pretrained host keeps
    meaningful keys; compression 1 is then exactly softmax attention); ``init="random"``:
    PyTorch's Conv1d default (uniform +-1/sqrt(d*c), weights and bias) from the global RNG,
    as a model trained from scratch. Padding: padded keys are zeroed before the convolution
    and the sequence is padded with zeros to S*c; a slot of padding only is masked, a
    partly padded slot keeps its real keys (zeros + bias elsewhere).
    Deviations: per-head kernels (above); the tensor2tensor variant that prepends the
    first token to the memory is not used (compression 1 would not be softmax).
    ``need_weights`` returns an attribution [b,h,n,m]: a slot's probability spread evenly
    over its kept keys, plus the local probabilities; it is not a matrix with out = P V
    (the convolution mixes channels) except for compression 1 with identity taps.
    Dropout ``ctx.dropout`` applies to the probabilities in training mode.
    """

    example: ClassVar[str] = "mca(compression=3)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Liu et al. 2018", keys_are_tokens=True,
        complexity="O(n*m/c + n*B)",
    )

    def __init__(self, cfg: MCAConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h, d, c = dims.num_heads, dims.head_dim, cfg.compression
        self.key_weight = nn.Parameter(torch.empty(h, d, d, c))  # [h,d_out,d_in,c]
        self.key_bias = nn.Parameter(torch.empty(h, d))  # [h,d]
        self.value_weight = nn.Parameter(torch.empty(h, d, d, c))  # [h,dv_out,dv_in,c]
        self.value_bias = nn.Parameter(torch.empty(h, d))  # [h,dv]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``init="mean"``: taps I/c, bias 0; ``"random"``: Conv1d's default U(+-1/sqrt(d*c))."""
        h, d, c = self.dims.num_heads, self.dims.head_dim, self.cfg.compression
        with torch.no_grad():
            if self.cfg.init == "mean":
                eye = torch.eye(d).div(c)[None, :, :, None]  # [1,d,d,1]
                for w, bb in ((self.key_weight, self.key_bias),
                              (self.value_weight, self.value_bias)):
                    w.copy_(eye.expand(h, d, d, c))
                    bb.zero_()
            else:
                bound = (d * c) ** -0.5
                for p in (self.key_weight, self.key_bias, self.value_weight, self.value_bias):
                    p.uniform_(-bound, bound)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, n, d = q.shape
        m, c, B = k.shape[2], self.cfg.compression, self.cfg.local_block
        require(v.shape[-1] == self.dims.head_dim, f"mca's value convolution was built for "
                f"head dim {self.dims.head_dim} (HeadDims.head_dim) but v has {v.shape[-1]}")
        require(B == 0 or n == m, f"mca local_block needs as many queries as keys (the blocks "
                f"are token positions), got n={n}, m={m}; use local_block=0")
        keep = _keep(ctx, b, m, q.device)  # [b,m]
        kc, slot_ok = compress(k, keep, self.key_weight, self.key_bias)  # [b,h,S,d], [b,S]
        vc, _ = compress(v, keep, self.value_weight, self.value_bias)  # [b,h,S,dv]
        S, scale = kc.shape[2], ctx.scale_for(d)
        p = ctx.dropout if self.training else 0.0
        allowed_c = slot_ok[:, None, None, :]  # [b,1,1,S]
        if ctx.causal:
            pos = torch.arange(n, device=q.device)[:, None] + (m - n)  # [n,1]
            end = torch.arange(S, device=q.device)[None, :] * c + (c - 1)  # [1,S]
            allowed_c = allowed_c & (end <= pos)
        if B == 0 and not ctx.need_weights and p == 0:
            # softmax over the slots on SDPA's fused kernel: the [b,h,n,S] scores and
            # probabilities are not stored (on the CPU, the flash kernel)
            bias = torch.zeros(allowed_c.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~allowed_c, float("-inf"))  # [b,1,1|n,S]
            return AttnOutput(masked_sdpa(q, kc, vc, bias, None, False, scale, 0.0))
        scores_c = (q @ kc.transpose(-1, -2)) * scale  # [b,h,n,S]
        allowed_c = allowed_c.expand(b, 1, n, S)  # [b,1,n,S]
        if B == 0:
            probs = masked_softmax(scores_c, allowed_c.expand(b, h, n, S))  # [b,h,n,S]
            out = _dropout(probs, p) @ vc  # [b,h,n,dv]
            weights = self._spread(probs, keep) if ctx.need_weights else None
            return AttnOutput(out, weights)
        nb = -(-n // B)
        pad = nb * B - n

        def blocks(x: torch.Tensor) -> torch.Tensor:  # [b,h|1,n,e] -> [b,h|1,nb,B,e]
            return F.pad(x, (0, 0, 0, pad)).view(*x.shape[:2], nb, B, x.shape[-1])

        qb, kb, vb = blocks(q), blocks(k), blocks(v)
        scores_l = (qb @ kb.transpose(-1, -2)) * scale  # [b,h,nb,B,B]
        i = torch.arange(nb * B, device=q.device).view(nb, B, 1)
        j = torch.arange(nb * B, device=q.device).view(nb, 1, B)
        allowed_l = (j < n) & (j <= i) if ctx.causal else (j < n).expand(nb, B, B)
        allowed_l = allowed_l[None] & F.pad(keep, (0, pad)).view(b, nb, 1, B)  # [b,nb,B,B]
        scores = torch.cat([scores_l, blocks(scores_c)], -1)  # [b,h,nb,B,B+S]
        allowed = torch.cat([allowed_l[:, None], blocks(allowed_c.to(torch.uint8)).bool()],
                            -1)  # [b,1,nb,B,B+S]
        probs = masked_softmax(scores, allowed.expand(scores.shape))  # [b,h,nb,B,B+S]
        pd = _dropout(probs, p)
        out = pd[..., :B] @ vb + pd[..., B:] @ vc[:, :, None]  # [b,h,nb,B,dv]
        out = out.reshape(b, h, nb * B, -1)[:, :, :n]
        weights = None
        if ctx.need_weights:
            loc = probs[..., :B].new_zeros(b, h, nb, B, nb, B)  # [b,h,nb,B,nb,B]
            u = torch.arange(nb, device=q.device)
            loc[:, :, u, :, u, :] = probs[..., :B].permute(2, 0, 1, 3, 4)
            loc = loc.reshape(b, h, nb * B, nb * B)[:, :, :n, :m]
            slot = probs[..., B:].reshape(b, h, nb * B, S)[:, :, :n]
            weights = loc + self._spread(slot, keep)
        return AttnOutput(out, weights)

    def _spread(self, slot_probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Slot probabilities [b,h,n,S] -> [b,h,n,m]: each spread evenly over its kept keys."""
        c, m = self.cfg.compression, keep.shape[1]
        S = slot_probs.shape[-1]
        kept = F.pad(keep, (0, S * c - m)).view(keep.shape[0], S, c)  # [b,S,c]
        count = kept.sum(-1).clamp(min=1).to(slot_probs.dtype)  # [b,S]
        per_key = (slot_probs / count[:, None, None, :]).repeat_interleave(c, -1)[..., :m]
        return per_key * keep[:, None, None, :].to(per_key.dtype)  # [b,h,n,m]


# ------------------------------------------------------------- nested attention (isab, luna)


def nested_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    keep: torch.Tensor, scale: float, p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attend l slot queries to the keys, then the queries to the l summaries.

    q [b,h,n,d], k [b,h,m,d], v [b,h,m,dv], slots [1|b,h,l,d], keep [b,m] bool.
    A = softmax(slots K^T * scale) over kept keys [b,h,l,m] (rows of a batch element with
    no kept key are 0); keys A K [b,h,l,d], values A V [b,h,l,dv];
    P = softmax(Q (A K)^T * scale) [b,h,n,l]; out = P (A V). Dropout p on A and on P.
    Returns (out [b,h,n,dv], P, A, A V).
    """
    b, h, m, _ = k.shape
    slots = slots.to(q.dtype)
    a = masked_softmax((slots @ k.transpose(-1, -2)) * scale,  # [b,h,l,m]
                       keep[:, None, None, :].expand(b, h, slots.shape[2], m))
    ad = _dropout(a, p)
    hk, hv = ad @ k, ad @ v  # [b,h,l,d], [b,h,l,dv]
    probs = torch.softmax((q @ hk.transpose(-1, -2)) * scale, dim=-1)  # [b,h,n,l]
    out = _dropout(probs, p) @ hv  # [b,h,n,dv]
    return out, probs, a, hv


@dataclass(frozen=True, kw_only=True)
class ISABConfig(MechanismConfig):
    name: ClassVar[str] = "isab"
    num_inducing: int = 16  # m (paper): number of inducing points I

    def __post_init__(self) -> None:
        require(self.num_inducing >= 1, f"isab num_inducing must be >= 1 (the number of "
                f"inducing points), got {self.num_inducing}; the paper uses 16 or 32")


@register_mechanism(ISABConfig)
class ISAB(nn.Module):
    """Induced set attention: learned inducing points summarise the keys, queries read them.

    Paper: Lee, Lee, Kim, Kosiorek, Choi, Teh, "Set Transformer: A Framework for
    Attention-based Permutation-Invariant Neural Networks", ICML 2019 (ISAB, §3.2).
    Formula (per head): A = softmax(I K^T / sqrt(d)) [l,m] with l inducing points
    I [h,l,d] (learned); H_K = A K, H_V = A V; out = softmax(Q H_K^T / sqrt(d)) H_V.
    Complexity O((n+m)*l*d), linear in the length as the paper's O(nm).
    Head space: the paper's ISAB(X) = MAB(X, H), H = MAB(I, X), where each MAB projects its
    own keys and values of H. Here H_K, H_V are the host's K, V projections of H = A X, the
    attended inputs (see the module doc), so no new projection is learned besides I.
    Deviations: the MAB's residual (H = I + ...), row-wise feed-forward and LayerNorms are
    not here (the host layer's own residual, FFN and LayerNorm follow the attention); I is
    N(0, 1) per head (the official code Xavier-initialises I in model space, before the
    MAB's query projection); scores scale by 1/sqrt(d), d the head dim, as the paper (the
    official MAB divides by sqrt(dim_V), the whole model width). Padded keys are masked in
    A, so they never enter H; a batch
    element with no kept key gives 0. Not causal (every inducing point sees every key).
    ``need_weights`` returns the effective weights P A [b,h,n,m] (out = that @ V
    exactly). Dropout ``ctx.dropout`` applies to A and P in training mode.
    """

    example: ClassVar[str] = "isab(num_inducing=4)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Lee et al. 2019", causal_ok=False, complexity="O((n+m)*l)",
    )

    def __init__(self, cfg: ISABConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.inducing = nn.Parameter(torch.empty(dims.num_heads, cfg.num_inducing,
                                                 dims.head_dim))  # I [h,l,d]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inducing.normal_()

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        require(not ctx.causal, "isab cannot be causal (every inducing point summarises all "
                "positions); use it in encoders only")
        keep = _keep(ctx, q.shape[0], k.shape[2], q.device)
        p = ctx.dropout if self.training else 0.0
        out, probs, a, _ = nested_attention(q, k, v, self.inducing[None], keep,
                                            ctx.scale_for(q.shape[-1]), p)
        return AttnOutput(out, probs @ a if ctx.need_weights else None)


# -------------------------------------------------------------------------------------- luna

# Key of the packed-memory entry in ``AttnContext.state``; the value is a PackedMemory.
LUNA_STATE_KEY = "luna.memory"


class PackedMemory(NamedTuple):
    """The memory [b,h,l,d] the last luna layer passed up, and that layer's index."""

    memory: torch.Tensor
    layer_idx: int


@dataclass(frozen=True, kw_only=True)
class LunaConfig(MechanismConfig):
    name: ClassVar[str] = "luna"
    num_memory: int = 16  # l: length of the packed memory P (the paper's projected length)

    def __post_init__(self) -> None:
        require(self.num_memory >= 1, f"luna num_memory must be >= 1 (the length l of the "
                f"packed memory), got {self.num_memory}; the paper uses 16, 128 or 256")


def previous_memory(state: dict[str, Any] | None, layer_idx: int,
                    shape: tuple[int, ...]) -> torch.Tensor | None:
    """The packed memory [b,h,l,d] a lower luna layer left in ``state`` (None if none).

    Raises ValueError when the entry comes from this or a later layer (a state dict reused
    across forward passes, or two luna groups in one layer) or has another shape.
    """
    if state is None or LUNA_STATE_KEY not in state:
        return None
    prev: PackedMemory = state[LUNA_STATE_KEY]
    if prev.layer_idx >= layer_idx:
        raise ValueError(
            f"luna at layer {layer_idx} found a packed memory written by layer "
            f"{prev.layer_idx}: AttnContext.state must be a fresh dict for each forward pass "
            "and each layer may hold a single luna group"
        )
    if tuple(prev.memory.shape) != shape:
        raise ValueError(
            f"luna at layer {layer_idx} needs a packed memory of shape [b,h,l,d]="
            f"{list(shape)} but layer {prev.layer_idx} passed up "
            f"{list(prev.memory.shape)}; every luna layer of a model needs the same head "
            "count, head dim and num_memory (use one luna spec on all heads of its layers)"
        )
    return prev.memory


@register_mechanism(LunaConfig)
class Luna(nn.Module):
    """Luna: pack the sequence into a short memory, unpack it, pass the memory up the stack.

    Paper: Ma, Kong, Wang, Zhou, May, Ma, Zettlemoyer, "Luna: Linear Unified Nested
    Attention", NeurIPS 2021 (official code: XuezheMax/fairseq-apollo, ``luna``).
    Formula (per head): pack A = softmax(P K^T / sqrt(d)) [l,m], C_P = A V; unpack
    out = softmax(Q (A K)^T / sqrt(d)) (A V). Memory passed up: P' = LN(P + C_P) (the
    paper's P_{l+1} = LayerNorm(Y_P + P), LN over d without affine parameters).
    Complexity O((n+m)*l*d), linear in the length.
    P: the first luna layer of a forward pass (no entry in ``ctx.state``, or ``state`` None)
    uses the learned P [h,l,d] (N(0, 1): the official px = sqrt(D) * N(0, 1/sqrt(D)) has
    unit variance); every later luna layer uses the memory P' [b,h,l,d] the last luna layer
    below it stored in ``ctx.state["luna.memory"]`` (with its layer index; a shape or order
    mismatch is a clear error). A model mixing luna and other layers is handled: luna on
    layers 0 and 2 with softmax on layer 1 makes layer 2 read layer 0's memory (other
    mechanisms leave the entry alone). ``apply_plan`` ties P across the luna layers built
    from one spec (:meth:`tie`): one P per model, as the official encoder's single
    ``projected_embeddings``, trained through the first luna layer and saved once. A luna
    instance outside a plan owns its P; when it inherits a memory its P is unused in that
    forward. Gradient checkpointing recomputes a layer after the forward's state is gone,
    so its luna layers would not see the memory: do not combine the two (the ForwardState
    limitation RealFormer shares).
    Head space: the unpack keys and values are A K and A V, the host's K/V projections of
    the packed context A X (the official code projects pc = softmax(pq_proj(P) X^T) X with
    k_proj, v_proj); the pack scores use P against the host's K, so the official pq_proj
    and raw-context keys are folded into P. Deviations: no pack projection (pq_proj) per
    layer (the inherited memory is used as the pack queries directly), the memory's
    LayerNorm has no affine parameters, no dropout on the memory. Padded keys are masked in
    A. Both attentions are softmax, as the paper's and the official bidirectional Luna. Not
    causal: the paper's causal Luna is a different, cumulative algorithm whose pack
    activation is elu(.) + 1 or softplus (official ``LunarCausalAttention``: softplus with
    beta = ln 2), normalised by the position, not a softmax.
    Scope "layer": head i of layer l feeds head i of the next luna layer, which a whole-layer
    mechanism guarantees. ``need_weights`` returns P_unpack A [b,h,n,m] (out = that @ V
    exactly). Dropout ``ctx.dropout`` applies to both attention matrices in training mode.
    """

    example: ClassVar[str] = "luna(num_memory=4)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Ma et al. 2021", scope="layer", causal_ok=False,
        complexity="O((n+m)*l)",
    )

    def __init__(self, cfg: LunaConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.memory = nn.Parameter(torch.empty(dims.num_heads, cfg.num_memory,
                                               dims.head_dim))  # P [h,l,d]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.memory.normal_()

    @classmethod
    def tie(cls, instances: Sequence[nn.Module]) -> None:
        """One P for the stack: the instances one ``apply_plan`` built from one config (in
        layer order) all take the first one's P (only the first luna layer reads it)."""
        lunas = [m for m in instances if isinstance(m, Luna)]
        for m in lunas[1:]:
            if m.memory.shape != lunas[0].memory.shape:
                raise ValueError(
                    f"luna layers of one spec differ in memory shape [h,l,d] "
                    f"({list(m.memory.shape)} vs {list(lunas[0].memory.shape)}); every luna "
                    "layer needs the same head count and head dim"
                )
            m.memory = lunas[0].memory

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, _, d = q.shape
        require(not ctx.causal, "luna cannot be causal here (each memory slot packs all "
                "positions); use it in encoders only")
        require(v.shape[-1] == d, f"luna passes its packed values up as the next layer's "
                f"memory, so v's head dim must equal q's: got {v.shape[-1]} and {d}")
        prev = previous_memory(ctx.state, ctx.layer_idx, (b, h, self.cfg.num_memory, d))
        slots = self.memory[None] if prev is None else prev  # [1|b,h,l,d]
        keep = _keep(ctx, b, k.shape[2], q.device)
        p = ctx.dropout if self.training else 0.0
        out, probs, a, packed = nested_attention(q, k, v, slots, keep, ctx.scale_for(d), p)
        if ctx.state is not None:
            # P' = LayerNorm(P + C_P), passed to the next luna layer
            nxt = F.layer_norm(slots.to(packed.dtype) + packed, (d,))  # [b,h,l,d]
            ctx.state[LUNA_STATE_KEY] = PackedMemory(nxt, ctx.layer_idx)
        return AttnOutput(out, probs @ a if ctx.need_weights else None)
