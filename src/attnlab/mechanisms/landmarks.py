"""Low-rank attention by the Nyström method: landmark queries and keys (segment means).

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.4.2. With
landmark queries Q~ and keys K~ (L each, the means of L consecutive segments of Q, K),
    A ~= softmax(Q K~^T) M^{-1} softmax(Q~ K^T),   M = softmax(Q~ K~^T)   [L, L],
computed right to left without any n x m matrix: O(n*L*d + L^3). ``nystrom`` replaces
M^{-1} by an iterative Moore-Penrose pseudo-inverse, ``csalr`` by (M + eps I)^{-1}.

Shared conventions (both mechanisms; shape glossary b, h, n, m, d, dv, L landmarks):
* Self-attention only: n == m (landmark i of the queries and of the keys cover the same
  positions). Not causal: every landmark mixes a whole segment.
* Segments: position i belongs to segment floor(i * L / n). When L divides n these are
  the equal segments of the official code and of transformers (a reshape and a mean);
  otherwise they differ in length by at most one (the official code and transformers
  require n % L == 0).
* Padding: padded keys get no weight in softmax(Q~ K^T); rows whose keys are all padding
  give 0. ``nystrom`` (as the official Nyströmformer code) zeroes padded queries and keys
  before the segment means, whose segments cover the padded length; ``csalr`` takes each
  row's segments over its own real tokens (``_row_landmarks``), as its sequence alone.
* ``need_weights`` returns the effective weights [b, h, n, m] (out = weights @ V
  exactly); they are not a probability matrix. No attention dropout (``ctx.dropout`` is
  ignored): no n x m probability matrix exists, as in the official code and transformers.
"""

from __future__ import annotations

import math
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
    accumulation_dtype,
    check_qkv,
    masked_softmax,
    reference_attention,
    register_mechanism,
)
from ..core.slicing import over_head_groups

FAMILY = "lowrank"


# ----------------------------------------------------------------------------------- helpers


def segment_means(x: torch.Tensor, num: int) -> torch.Tensor:
    """x [..., n, d] -> [..., L, d], L = ``num`` <= n: the mean of each segment, position i
    in segment floor(i * L / n) (equal segments when L divides n)."""
    n = x.shape[-2]
    if n % num == 0:
        return x.unflatten(-2, (num, n // num)).mean(-2)  # the official reshape + mean
    seg = torch.arange(n, device=x.device) * num // n  # [n] segment of each position
    counts = torch.bincount(seg, minlength=num).to(x.dtype)  # [L] all >= 1 when L <= n
    zeros = x.new_zeros(*x.shape[:-2], num, x.shape[-1])
    return torch.index_add(zeros, x.dim() - 2, seg, x) / counts[:, None]


def iterative_pinv(a: torch.Tensor, iterations: int, init: str = "original") -> torch.Tensor:
    """Moore-Penrose pseudo-inverse of a [b, h, L, L] (rows of a softmax: ||a||_inf = 1) by
    Razavi et al.'s iteration, as in the Nyströmformer code:
        Z_0 = a^T / c,  c = max column sum (over everything for "original", the official
        default; per [L, L] matrix for "exact", = ||a||_1 ||a||_inf, the paper's Z_0)
        Z_{j+1} = 1/4 Z_j (13 I - a Z_j (15 I - a Z_j (7 I - a Z_j)))
    """
    colsum = a.sum(-2)  # [b,h,L]
    c = colsum.max() if init == "original" else colsum.amax(-1)[..., None, None]
    z = (1 / c) * a.transpose(-1, -2)  # [b,h,L,L]
    shape = a.shape
    a3, z = a.flatten(0, -3), z.flatten(0, -3)  # [bh,L,L]: batched GEMMs with a fused add
    eye = torch.eye(shape[-1], dtype=a.dtype, device=a.device)  # [L,L]
    for _ in range(iterations):
        az = torch.bmm(a3, z)  # [bh,L,L]
        t = torch.baddbmm(15 * eye, az, 7 * eye - az, alpha=-1)  # 15I - az(7I - az)
        t = torch.baddbmm(13 * eye, az, t, alpha=-1)  # 13I - az(...)
        z = torch.baddbmm(z, z, t, beta=0, alpha=0.25)  # Z/4 (...)  (input ignored)
    return z.view(shape)


def _key_keep(ctx: AttnContext) -> torch.Tensor | None:
    """[b, m] bool key mask, or None when nothing is padded."""
    km = ctx.key_mask
    return None if km is None or bool(km.all()) else km.to(torch.bool)


def _check_self_attention(name: str, q: torch.Tensor, k: torch.Tensor, ctx: AttnContext):
    if ctx.causal:
        raise ValueError(
            f"{name} cannot be causal (every landmark averages a whole segment); use it in "
            "encoders only"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{name} is self-attention: it needs as many queries as keys (landmarks are "
            f"segment means of both), got n={q.shape[2]}, m={k.shape[2]}"
        )


def _landmarks(q, k, num: int, scale: float, keep: torch.Tensor | None):
    """(q, k with padded positions zeroed, landmark queries Q~ [b,h,L,d], landmark keys
    K~ * scale [b,h,L,d]): padding enters no landmark (official code); the score scale is
    folded into K~ (L rows, not n; the official code scales q and k by d^-1/4 each, the
    product is the same)."""
    if keep is not None:
        km = keep[:, None, :, None].to(q.dtype)  # [b,1,n,1]
        q, k = q * km, k * km
    return q, k, segment_means(q, num), segment_means(k, num) * scale


def _row_landmarks(keep: torch.Tensor, num: int, dtype: torch.dtype):
    """Each row's own segments, for a key mask keep [b, n] and L = ``num`` slots: (index
    [b * n] into b * (L + 1) slot rows, slot sizes [b, L] clamped >= 1, slot validity [b, L]),
    for ``_row_segment_means``. Row b has L_b real tokens and L'_b = min(L, L_b) segments; its
    r-th real token is in segment floor(r * L'_b / L_b) (the segments of the row's sequence
    alone); padded positions go to a dropped slot L, and slots >= L'_b stay empty."""
    b, n = keep.shape
    lengths = keep.sum(-1, keepdim=True)  # L_b [b,1]
    segments = lengths.clamp(max=num)  # L'_b [b,1]
    rank = keep.cumsum(-1) - 1  # [b,n] position among the row's real tokens
    seg = torch.where(keep, rank * segments // lengths.clamp(min=1), num)  # [b,n]
    sizes = torch.zeros(b, num + 1, dtype=dtype, device=keep.device).scatter_add_(
        1, seg, torch.ones(b, n, dtype=dtype, device=keep.device))[:, :num]  # [b,L]
    flat = (seg + torch.arange(b, device=keep.device)[:, None] * (num + 1)).reshape(b * n)
    slots = torch.arange(num, device=keep.device)[None, :] < segments  # [b,L]
    return flat, sizes.clamp(min=1), slots


def _row_segment_means(x: torch.Tensor, flat: torch.Tensor, sizes: torch.Tensor):
    """x [b, g, n, d] -> the means [b, g, L, d] of each row's segments (``_row_landmarks``;
    0 on empty slots)."""
    b, g, n, d = x.shape
    num = sizes.shape[1]
    rows = x.transpose(0, 1).reshape(g, b * n, d).to(sizes.dtype)  # summed in sizes' dtype
    sums = torch.index_add(rows.new_zeros(g, b * (num + 1), d), 1, flat, rows)  # [g,b*(L+1),d]
    means = sums.view(g, b, num + 1, d).transpose(0, 1)[:, :, :num] / sizes[:, None, :, None]
    return means.to(x.dtype).contiguous()  # [b,g,L,d]


def _side_kernels(q, k, ql, kl, scale: float, keep: torch.Tensor | None):
    """softmax(Q K~^T) [b,h,n,L] and softmax(Q~ K^T) [b,h,L,m] (padded keys excluded);
    heads are independent here, so callers may pass any group of heads."""
    k1 = torch.softmax(q @ kl.transpose(-1, -2), dim=-1)  # [b,h,n,L]
    s3 = (ql * scale) @ k.transpose(-1, -2)  # [b,h,L,m]
    if keep is None:
        return k1, torch.softmax(s3, dim=-1)
    return k1, masked_softmax(s3, keep[:, None, None, :].expand(s3.shape))  # [b,h,L,m]


def _bytes_per_head(q: torch.Tensor, num: int) -> int:
    """Bytes of the largest per-head intermediates (softmax(Q K~^T), softmax(Q~ K^T) and
    their gradients), the budget unit for core.slicing.over_head_groups."""
    return q.shape[0] * q.shape[2] * num * q.element_size()


def _conv_band(weight: torch.Tensor, n: int) -> torch.Tensor:
    """Depthwise conv weight [h, 1, K, 1] (padding K // 2) as a band matrix [h, n, n]:
    conv(V)[i] = sum_j C[i, j] V[j] with C[i, j] = w[j - i + K // 2]."""
    ksize = weight.shape[2]
    pos = torch.arange(n, device=weight.device)
    off = pos[None, :] - pos[:, None] + ksize // 2  # [n,n]
    inside = (off >= 0) & (off < ksize)
    w = weight[:, 0, :, 0]  # [h,K]
    return w[:, off.clamp(0, ksize - 1)] * inside.to(w.dtype)  # [h,n,n]


# ----------------------------------------------------------------------------------- nystrom


@dataclass(frozen=True, kw_only=True)
class NystromConfig(MechanismConfig):
    name: ClassVar[str] = "nystrom"
    num_landmarks: int = 64  # the paper's m (L here): landmarks, segment means of Q and K
    pinv_iterations: int = 6  # iterations of the pseudo-inverse iteration (paper: 6)
    conv_kernel: int = 0  # depthwise conv skip on V over the sequence, kernel size (0 = off)
    pinv_init: Literal["original", "exact"] = "original"  # Z_0 scaling (see iterative_pinv)

    def __post_init__(self) -> None:
        if self.num_landmarks < 1:
            raise ValueError(f"num_landmarks must be >= 1, got {self.num_landmarks}")
        if self.pinv_iterations < 0:
            raise ValueError(f"pinv_iterations must be >= 0, got {self.pinv_iterations}")
        if self.conv_kernel < 0 or (self.conv_kernel and self.conv_kernel % 2 == 0):
            raise ValueError(
                f"conv_kernel must be 0 (off) or odd (the conv is centred on each position, "
                f"padding conv_kernel // 2), got {self.conv_kernel}; use {self.conv_kernel + 1}"
            )


def nystrom_attention(q, k, v, num_landmarks: int, pinv_iterations: int, scale: float,
                      keep: torch.Tensor | None = None, pinv_init: str = "original",
                      need_weights: bool = False):
    """The Nyström approximation itself (no softmax shortcut, no conv):
    softmax(Q K~^T) pinv(M) (softmax(Q~ K^T) V). q, k [b,h,n,d], v [b,h,n,dv];
    keep [b,n] bool or None. Returns (out [b,h,n,dv], weights [b,h,n,m] or None).

    The landmarks and pinv(M) [b,h,L,L] are computed for all heads at once ("original"
    scales Z_0 by a maximum over every head and example); the n-sized kernels run a few
    heads at a time (core.slicing), which gives the same result."""
    q, k, ql, kl = _landmarks(q, k, num_landmarks, scale, keep)
    # 16-bit inputs: the L-sized part (M, its pseudo-inverse Z and Z's product) runs in fp32,
    # under autocast too (float64 stays float64): Z amplifies M's rounding, and in bf16 the
    # gradients of q and k were 4x further from fp32's than with this part in fp32
    work = accumulation_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        k2 = torch.softmax(ql.to(work) @ kl.to(work).transpose(-1, -2), dim=-1)  # M [b,h,L,L]
        z = iterative_pinv(k2, pinv_iterations, pinv_init)  # [b,h,L,L]

    def heads(q, k, v, ql, kl, z) -> AttnOutput:
        k1, k3 = _side_kernels(q, k, ql, kl, scale, keep)  # [b,g,n,L], [b,g,L,m]
        kv = k3 @ v  # [b,g,L,dv]
        with torch.autocast(q.device.type, enabled=False):
            zkv = (z @ kv.to(z.dtype)).to(k1.dtype)  # [b,g,L,dv]
        out = k1 @ zkv  # [b,g,n,dv]
        return AttnOutput(out, (k1 @ z.to(k1.dtype)) @ k3 if need_weights else None)

    res = over_head_groups(heads, (q, k, v, ql, kl, z), _bytes_per_head(q, num_landmarks))
    return res.out, res.probs


@register_mechanism(NystromConfig)
class Nystrom(nn.Module):
    """Nyströmformer: landmark (segment-mean) Nyström approximation with an iterative
    pseudo-inverse, and an optional depthwise convolution skip on V.

    Paper: Xiong, Zeng, Chakraborty, Tan, Fung, Li, Singh, "Nyströmformer: A Nyström-Based
    Algorithm for Approximating Self-Attention", AAAI 2021. Follows the official code
    (github mlpen/Nystromformer, code/attention_nystrom.py, ``NystromAttention``) and
    transformers' ``NystromformerSelfAttention`` (tested equal, weights copied across).
    Formula (L = num_landmarks; Q, K scaled by d^-1/4 each, i.e. scores by 1/sqrt(d)):
        Q~, K~ = segment means of Q, K                                        [L, d]
        out = softmax(Q K~^T) Z softmax(Q~ K^T) V  (+ conv(V))                [n, dv]
        Z = pinv(softmax(Q~ K~^T)) by ``pinv_iterations`` steps of iterative_pinv
    computed as softmax(Q K~^T) (Z (softmax(Q~ K^T) V)): no n x L x L product.
    conv: depthwise Conv2d over the sequence axis (kernel (K, 1), padding K // 2, no bias,
    one filter per head, as the official code; parameter ``conv.weight`` [h, 1, K, 1], init
    PyTorch's Conv2d default from the global RNG).
    When L >= n: exact softmax attention (plus the conv). transformers does this at
    L == n (its only valid L >= n; L > n fails its reshape); every key is then its own
    landmark, and the Nyström formula with a converged Z equals softmax (tested).
    ``pinv_init``: "original" (default, the official code's and transformers' default)
    divides by the largest column sum over the whole batch and all heads of the call, so a
    row's output depends slightly on the other sequences of its batch; "exact" uses each
    [L, L] matrix's own (the paper's Z_0, converges faster, batch-independent).
    Complexity O(n*L*d + L^3 * pinv_iterations) time, O(n*L) memory.
    Deviations: masking and uneven segments as in the module docstring (transformers
    adds its padding mask only to softmax(Q~ K^T), so its landmarks average padded
    positions too, and it takes no n % L != 0). The conv skip is off by default
    (transformers' config default is 65; the official code adds it only when configured).
    Padding: as the official code and transformers, the segments cover the padded length and
    padded positions count (as zeros) in the segment means, and L >= n is judged on the
    padded n; so a right-padded row gives other outputs than its sequence alone.
    """

    example: ClassVar[str] = "nystrom(num_landmarks=4, conv_kernel=3)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Xiong et al. 2021", causal_ok=False, keys_are_tokens=True,
        complexity="O(n*L)",
    )

    def __init__(self, cfg: NystromConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h, ksize = dims.num_heads, cfg.conv_kernel
        self.conv = (nn.Conv2d(h, h, kernel_size=(ksize, 1), padding=(ksize // 2, 0),
                               bias=False, groups=h) if ksize else None)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        _check_self_attention("nystrom", q, k, ctx)
        n, c = q.shape[2], self.cfg
        keep = _key_keep(ctx)
        scale = ctx.scale_for(q.shape[-1])
        probs: torch.Tensor | None
        if c.num_landmarks >= n:  # every key its own landmark: exact softmax
            out, dense = reference_attention(q, k, v, key_mask=keep, scale=scale)
            probs = dense if ctx.need_weights else None
        else:
            out, probs = nystrom_attention(q, k, v, c.num_landmarks, c.pinv_iterations, scale,
                                           keep, c.pinv_init, ctx.need_weights)
        if self.conv is not None:
            vm = v if keep is None else v * keep[:, None, :, None].to(v.dtype)
            # the weight in v's dtype, as the other mechanisms' parameters (float64 and
            # 16-bit inputs reach a float32 module when it is called on its own)
            out = out + F.conv2d(vm, self.conv.weight.to(vm.dtype), padding=self.conv.padding,
                                 groups=self.conv.groups)  # [b,h,n,dv]
            if probs is not None:
                band = _conv_band(self.conv.weight.to(probs.dtype), n)  # [h,n,n]
                probs = probs + band * (1.0 if keep is None else keep[:, None, None, :])
        return AttnOutput(out, probs)


# ------------------------------------------------------------------------------------- csalr


@dataclass(frozen=True, kw_only=True)
class CSALRConfig(MechanismConfig):
    name: ClassVar[str] = "csalr"
    num_landmarks: int = 64  # landmark count (average-pooled landmark feature vectors)
    eps: float = 1.0  # epsilon of (M + eps I)^{-1}; 1 = "adds an identity matrix to M"

    def __post_init__(self) -> None:
        if self.num_landmarks < 1:
            raise ValueError(f"num_landmarks must be >= 1, got {self.num_landmarks}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(
                f"eps must be a positive finite number (M + eps I must be invertible), "
                f"got {self.eps}"
            )


@register_mechanism(CSALRConfig)
class CSALR(nn.Module):
    """CSALR: landmark attention map and combination coefficients, with (M + eps I)^{-1}.

    Paper: Chen, Gong, Ge, Du, "Compressed Self-Attention for Deep Metric Learning with
    Low-Rank Approximation", IJCAI 2020 (cited as CSALR in Lin et al.'s survey, §4.4.2).
    The attention map is decomposed into a landmark attention map over all keys and a
    combination coefficient map, with landmark feature vectors taken by average pooling.
    Formula (L = num_landmarks; Q~, K~ = segment means of Q, K; scores scaled by s):
        M   = softmax(s Q~ K~^T)                                     [L, L]
        out = softmax(s Q K~^T) (M + eps I)^{-1} softmax(s Q~ K^T) V      [n, dv]
    The inverse is applied by a linear solve, (M + eps I) X = softmax(s Q~ K^T) V, in fp32.
    eps = 1 (default) is the survey's "adds an identity matrix to M to make sure that the
    inverse always exists": M is row-stochastic with positive entries, so every eigenvalue
    other than 1 has modulus < 1 and M + I is always invertible; eps -> 0 gives the plain
    Nyström inverse (landmarks = n then equals softmax, tested). An eps in (0, 1) can meet
    a negative eigenvalue of M near -eps (seen: -0.099 for eps = 0.1, condition number
    1200, outputs 30x too large): prefer eps = 1 or eps well below the landmark spread.
    When L > n the landmarks are the n tokens themselves (L is capped at n).
    Padding: a row's landmarks are the segment means of its own real tokens (L capped at its
    real length), so a right-padded row gives its sequence alone's outputs; padded keys get
    no weight and padded queries output 0.
    Complexity O(n*L*d + L^3) time, O(n*L) memory.
    Deviations: the paper (an image model, 2-D average pooling over a feature map, no
    padding) was not available to read; the formula is the survey's. Landmarks are 1-D
    segment means; uneven segments as in the module docstring.
    """

    example: ClassVar[str] = "csalr(num_landmarks=4)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Chen et al. 2020", causal_ok=False, keys_are_tokens=True,
        complexity="O(n*L)",
    )

    def __init__(self, cfg: CSALRConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        _check_self_attention("csalr", q, k, ctx)
        num = min(self.cfg.num_landmarks, q.shape[2])
        keep = _key_keep(ctx)
        scale = ctx.scale_for(q.shape[-1])
        eye = torch.eye(num, dtype=accumulation_dtype(q.dtype), device=q.device)  # [L,L]
        need_weights, eps = ctx.need_weights, self.cfg.eps

        if keep is not None:  # each row's own segments (fewer slots in a short row)
            flat, sizes, slots = _row_landmarks(  # [b*n], [b,L], [b,L]
                keep, num, accumulation_dtype(q.dtype))
            pairs = (slots[:, :, None] & slots[:, None, :])[:, None]  # [b,1,L,L]
            # -inf on the empty slots of rows with a real token (a row without one has only
            # padded queries, zeroed by ``kept``)
            empty = ~slots & keep.any(-1, keepdim=True)  # [b,L]
            slot_bias = torch.zeros(empty.shape, dtype=q.dtype, device=q.device).masked_fill(
                empty, float("-inf"))[:, None, None, :]  # [b,1,1,L]
            kept = keep[:, None, :, None].to(q.dtype)  # [b,1,n,1]

        def heads(q, k, v) -> AttnOutput:  # heads are independent: a few at a time
            if keep is None:
                q, k, ql, kl = _landmarks(q, k, num, scale, None)
                k1, k3 = _side_kernels(q, k, ql, kl, scale, None)  # [b,g,n,L], [b,g,L,m]
                k2 = torch.softmax(ql @ kl.transpose(-1, -2), dim=-1)  # M [b,g,L,L]
            else:  # empty slots: no weight in k1, rows and columns of M zero (so M + eps I
                # is block diagonal and they never reach a real slot); padded queries: 0
                ql = _row_segment_means(q, flat, sizes)  # [b,g,L,d]
                kl = _row_segment_means(k, flat, sizes) * scale
                k1 = torch.softmax(q @ kl.transpose(-1, -2) + slot_bias, dim=-1) * kept  # [b,g,n,L]
                s3 = (ql * scale) @ k.contiguous().transpose(-1, -2)  # [b,g,L,m]
                k3 = masked_softmax(s3, keep[:, None, None, :].expand(s3.shape))
                s2 = ql @ kl.transpose(-1, -2)  # [b,g,L,L]
                k2 = masked_softmax(s2, pairs.expand(s2.shape))  # M
            wide = accumulation_dtype(k2.dtype)  # fp32 for 16-bit inputs, else their own
            reg = k2.to(wide) + eps * eye  # M + eps I [b,g,L,L]
            x = torch.linalg.solve(reg, (k3 @ v).to(wide)).to(v.dtype)  # [b,g,L,dv]
            probs = None
            if need_weights:
                coef = torch.linalg.solve(reg, k3.to(wide), left=True).to(k3.dtype)  # [b,g,L,m]
                probs = k1 @ coef  # [b,g,n,m]
            return AttnOutput(k1 @ x, probs)  # out [b,g,n,dv]

        return over_head_groups(heads, (q, k, v), _bytes_per_head(q, num))
