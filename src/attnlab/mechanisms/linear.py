"""Linearised attention: a positive feature map replaces the softmax kernel, O(n) in length.

One implementation serves every mechanism here: features phi(q) [b,h,n,r], phi(k) [b,h,m,r]
(r features), then out_i = phi(q_i)^T S / phi(q_i)^T z with S = sum_j phi(k_j) v_j^T and
z = sum_j phi(k_j), the sums running over j <= i (prefix sums) when causal. The mechanisms
differ only in phi: a fixed map (``linear``, ``linear_elu``, ``linear_relu``) or positive
orthogonal random features (``performer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    causal_mask,
    check_qkv,
    register_mechanism,
)
from ..core.masks import global_draw
from ..core.slicing import over_head_groups

FeatureMap = Literal["elu", "relu"]


def _check_eps_chunk(eps: float, chunk: int) -> None:
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps empty rows finite), got {eps}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")


@dataclass(frozen=True, kw_only=True)
class LinearConfig(MechanismConfig):
    name: ClassVar[str] = "linear"
    feature_map: FeatureMap = "elu"  # phi: "elu" = elu(x) + 1 (the paper's), "relu" = relu(x)
    eps: float = 1e-6  # epsilon: added to the normaliser phi(q_i)^T sum_j phi(k_j)
    chunk: int = 64  # C: chunk length of the causal prefix sums (implementation, not paper)

    def __post_init__(self) -> None:
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {self.feature_map!r}"
            )
        _check_eps_chunk(self.eps, self.chunk)


@dataclass(frozen=True, kw_only=True)
class LinearEluConfig(MechanismConfig):
    """``linear`` with phi fixed to elu(x) + 1 (the paper's map)."""

    name: ClassVar[str] = "linear_elu"
    feature_map: ClassVar[FeatureMap] = "elu"  # phi(x) = elu(x) + 1, fixed (not a field)
    eps: float = 1e-6  # epsilon: added to the normaliser phi(q_i)^T sum_j phi(k_j)
    chunk: int = 64  # C: chunk length of the causal prefix sums (implementation, not paper)

    def __post_init__(self) -> None:
        _check_eps_chunk(self.eps, self.chunk)


@dataclass(frozen=True, kw_only=True)
class LinearReluConfig(MechanismConfig):
    """``linear`` with phi fixed to relu(x)."""

    name: ClassVar[str] = "linear_relu"
    feature_map: ClassVar[FeatureMap] = "relu"  # phi(x) = relu(x), fixed (not a field)
    eps: float = 1e-6  # epsilon: added to the normaliser phi(q_i)^T sum_j phi(k_j)
    chunk: int = 64  # C: chunk length of the causal prefix sums (implementation, not paper)

    def __post_init__(self) -> None:
        _check_eps_chunk(self.eps, self.chunk)


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1: positive, so every normaliser is a sum of positive terms."""
    if torch.compiler.is_compiling():  # the compiled backward of elu on a transposed
        x = x.contiguous()  # view (a Hugging Face layer's heads) fails in torch 2.13
    return F.elu(x) + 1.0


def relu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = relu(x): non-negative; a row whose features are all 0 gives 0 (eps)."""
    return F.relu(x)


FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu": elu_feature_map,
    "relu": relu_feature_map,
}


def _features(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None,
    phi: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """phi(q) [b,h,n,d], phi(k) [b,h,m,d] with padded keys zeroed (so they are invisible)."""
    fq, fk = phi(q), phi(k)
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None].to(fk.dtype)  # [b,h,m,d]
    return fq, fk


def _divide(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num [...,dv] / (den [...] + eps); a zero denominator (no visible key, eps = 0) gives 0.

    The numerator is then 0 too (non-negative features); the guard keeps eps = 0 (Performer)
    free of NaN in the output and the gradient. With eps > 0 it is plain division.
    """
    den = den + eps
    return num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1)


def _bidirectional(fq, fk, v, eps: float) -> torch.Tensor:
    """out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps)."""
    kv = torch.einsum("bhmr,bhme->bhre", fk, v)  # [b,h,r,dv]
    z = fk.sum(dim=-2)  # [b,h,r]
    num = torch.einsum("bhnr,bhre->bhne", fq, kv)  # [b,h,n,dv]
    den = torch.einsum("bhnr,bhr->bhn", fq, z)  # [b,h,n]
    return _divide(num, den, eps)


def _causal(fq, fk, v, eps: float, chunk: int, cs: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Causal form with chunked prefix sums; queries aligned to the last n keys.

    fq [b,h,n,d], fk [b,h,m,d] (d: the feature count r), v [b,h,m,dv] -> [b,h,n,dv].

    Query i sees keys j <= i + (m - n). Keys before the aligned block seed the state;
    queries before it (n > m) see nothing and give zeros. The aligned block is cut into
    chunks of C positions: within a chunk a lower-triangular C x C kernel block; across
    chunks an exclusive prefix sum of per-chunk states S_c = sum phi(k_j) v_j^T
    [b,h,n/C,d,dv] and z_c = sum phi(k_j) [b,h,n/C,d]. Memory O(b*h*n*(C + d*dv/C))
    (with C >= d about the size of q itself) instead of the O(b*h*n*d*dv) of a
    per-position cumsum, and no Python loop over the sequence.

    ``cs`` [b,h,m]: keys stabilised each by its own running maximum (Performer,
    ``favor_causal_key_features``: phi(k_j) carries exp(-cs_j), cs non-decreasing);
    every term a row sums is brought to the row's own scale exp(-cs_i) by factors
    exp(cs_j - cs_i) <= 1 (:func:`_rescaled_causal`), so no key after a row sets its scale.
    """
    b, h, n, d = fq.shape
    m, dv = fk.shape[-2], v.shape[-1]
    offset = m - n
    g0 = None  # the scale of the pre-block state (with cs)
    if offset >= 0:
        pre = fk[:, :, :offset]  # [b,h,offset,d]
        if cs is not None:
            g0 = cs[:, :, max(offset - 1, 0)]  # [b,h]: the last pre-block key's scale
            if offset > 0:
                pre = pre * torch.exp(cs[:, :, :offset] - g0[..., None])[..., None]
            cs = cs[:, :, offset:]
        s0 = torch.einsum("bhmd,bhme->bhde", pre, v[:, :, :offset])  # [b,h,d,dv]
        z0 = pre.sum(dim=-2)  # [b,h,d]
        q0, fk, v = 0, fk[:, :, offset:], v[:, :, offset:]
    else:
        s0 = fq.new_zeros(b, h, d, dv)  # [b,h,d,dv]
        z0 = fq.new_zeros(b, h, d)  # [b,h,d]
        q0 = -offset  # queries [0, q0) have no visible key: their rows stay zero
    length = n - q0  # aligned queries == aligned keys
    c = min(chunk, max(length, 1))
    nc = -(-length // c)  # number of chunks
    pad = nc * c - length  # zero rows: phi(k) = 0 adds nothing; padded queries are cut off

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [b,h,L,e] -> [b,h,nc,C,e]
        return F.pad(x, (0, 0, 0, pad)).reshape(b, h, nc, c, x.shape[-1])

    qc, kc, vc = chunks(fq[:, :, q0:]), chunks(fk), chunks(v)  # [b,h,nc,C,d|dv]
    tri = torch.ones(c, c, dtype=torch.bool, device=fq.device).tril()  # [C,C]
    if cs is not None:  # padded rows repeat the last scale (their keys are 0)
        csc = torch.cat([cs, cs[:, :, -1:].expand(b, h, pad)], -1).reshape(b, h, nc, c)
        g0 = csc[:, :, 0, 0] if g0 is None else g0
        num, den = _rescaled_causal(qc, kc, vc, s0, z0, csc, g0, tri)
        out = _divide(num, den, eps).reshape(b, h, nc * c, dv)[:, :, :length]
        return torch.cat([fq.new_zeros(b, h, q0, dv), out], dim=2)  # [b,h,n,dv]
    a = (qc @ kc.transpose(-1, -2)).masked_fill(~tri, 0.0)  # [b,h,nc,C,C]
    kv = kc.transpose(-1, -2) @ vc  # [b,h,nc,d,dv] per-chunk states
    # exclusive prefix over chunks, seeded with the pre-block state
    s_prev = torch.cat([s0[:, :, None], kv[:, :, :-1]], dim=2).cumsum(dim=2)  # [b,h,nc,d,dv]
    z_prev = torch.cat([z0[:, :, None], kc.sum(-2)[:, :, :-1]], dim=2).cumsum(dim=2)
    num = a @ vc + qc @ s_prev  # [b,h,nc,C,dv]
    den = a.sum(dim=-1) + (qc @ z_prev.unsqueeze(-1)).squeeze(-1)  # [b,h,nc,C]
    out = _divide(num, den, eps).reshape(b, h, nc * c, dv)[:, :, :length]
    return torch.cat([fq.new_zeros(b, h, q0, dv), out], dim=2)  # [b,h,n,dv]


def _rescaled_causal(qc, kc, vc, s0, z0, csc, g0, tri) -> tuple[torch.Tensor, torch.Tensor]:
    """``_causal``'s chunk sums with per-key scales: (num [b,h,nc,C,dv], den [b,h,nc,C]).

    qc, kc, vc [b,h,nc,C,.] as in ``_causal``, kc_j carrying exp(-cs_j); csc [b,h,nc,C] the
    scales (non-decreasing along the sequence); s0 [b,h,d,dv], z0 [b,h,d] the pre-block
    state in scale g0 [b,h]. Row i's terms are brought to exp(-cs_i): inside a chunk by
    exp(cs_j - cs_i); each chunk's state is kept in the scale of its last key E_t, and the
    state before chunk t, sum_u<t state_u exp(E_u - E_(t-1)), is one [nc, nc] weighting of
    the chunk states (the scales differ, so no plain cumsum). Every factor is <= 1, so no
    overflow, and a key's scale comes only from keys at or before it.
    """
    nc = csc.shape[2]
    fac = torch.exp((csc[..., None, :] - csc[..., :, None]).clamp(max=0))  # [b,h,nc,C,C]
    a = ((qc @ kc.transpose(-1, -2)) * fac).masked_fill(~tri, 0.0)  # [b,h,nc,C,C]
    end = csc[..., -1]  # E_t [b,h,nc]
    kw = kc * torch.exp(csc - end[..., None])[..., None]  # keys in their chunk's scale
    states = torch.cat([s0[:, :, None], (kw.transpose(-1, -2) @ vc)[:, :, :-1]], 2)
    zs = torch.cat([z0[:, :, None], kw.sum(-2)[:, :, :-1]], 2)  # [b,h,nc,d]
    g = torch.cat([g0[..., None], end[..., :-1]], -1)  # each state's scale [b,h,nc]
    low = torch.ones(nc, nc, dtype=torch.bool, device=csc.device).tril()  # [nc,nc]
    wts = torch.exp((g[..., None, :] - g[..., :, None]).clamp(max=0)).masked_fill(~low, 0.0)
    s_prev = torch.einsum("bhtu,bhude->bhtde", wts, states)  # [b,h,nc,d,dv] in scale g_t
    z_prev = torch.einsum("bhtu,bhud->bhtd", wts, zs)  # [b,h,nc,d]
    rs = torch.exp((g[..., None] - csc).clamp(max=0))  # exp(g_t - cs_i) [b,h,nc,C]
    num = a @ vc + (qc @ s_prev) * rs[..., None]  # [b,h,nc,C,dv]
    den = a.sum(dim=-1) + (qc @ z_prev.unsqueeze(-1)).squeeze(-1) * rs  # [b,h,nc,C]
    return num, den


def _bytes_per_head(q, k, v, ctx: AttnContext, chunk: int, features: int | None = None
                    ) -> int:
    """Size of the largest fp32 intermediate of one head: [b, L, r] features, causal
    [b, L, C] kernel blocks and [b, L/C, r, dv] chunk states (L = max(n, m))."""
    b, length = q.shape[0], max(q.shape[2], k.shape[2])
    r = features or q.shape[-1]
    width = max(r, v.shape[-1], min(chunk, length) if ctx.causal else 1,
                r * v.shape[-1] // max(1, chunk) if ctx.causal else 1)
    return 4 * b * length * width


def linear_weights(fq, fk, causal: bool, eps: float, cs: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The normalised phi(q) phi(k)^T matrix [b,h,n,m] (what the O(n) path implicitly uses);
    ``cs`` [b,h,m]: per-key scales as in ``_causal`` (row i in the scale of its key
    i + m - n)."""
    a = fq @ fk.transpose(-1, -2)  # [b,h,n,m]
    if cs is not None:
        n, m = a.shape[-2], a.shape[-1]
        row = (torch.arange(n, device=a.device) + (m - n)).clamp(0, m - 1)  # [n]
        a = a * torch.exp((cs[..., None, :] - cs[..., row, None]).clamp(max=0))
    if causal:
        a = a.masked_fill(~causal_mask(a.shape[-2], a.shape[-1], a.device), 0.0)
    return _divide(a, a.sum(dim=-1), eps)  # [b,h,n,m]


def _linear_attention(
    fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, ctx: AttnContext, eps: float,
    chunk: int, dtype: torch.dtype, cs: torch.Tensor | None = None,
) -> AttnOutput:
    """The shared O(n) core: features fq [b,h,n,r], fk [b,h,m,r] (padded keys already 0),
    v [b,h,m,dv] in the compute dtype -> AttnOutput in ``dtype``. cs: causal per-key
    scales (``_causal``)."""
    if ctx.causal:
        out = _causal(fq, fk, v, eps, chunk, cs)  # [b,h,n,dv]
    else:
        out = _bidirectional(fq, fk, v, eps)  # [b,h,n,dv]
    probs = (linear_weights(fq, fk, ctx.causal, eps, cs).to(dtype) if ctx.need_weights
             else None)
    return AttnOutput(out.to(dtype), probs)


class _FeatureMapLinear(nn.Module):
    """The one implementation behind ``linear``, ``linear_elu`` and ``linear_relu``."""

    def __init__(self, cfg: LinearConfig | LinearEluConfig | LinearReluConfig,
                 dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.phi = FEATURE_MAPS[cfg.feature_map]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        work = accumulation_dtype(q.dtype)

        def heads(qg, kg, vg) -> AttnOutput:  # [b,g,n|m,d]: a group of g heads
            fq, fk = _features(qg.to(work), kg.to(work), ctx.key_mask, self.phi)
            return _linear_attention(fq, fk, vg.to(work), ctx, self.cfg.eps, self.cfg.chunk,
                                     q.dtype)

        return over_head_groups(heads, (q, k, v), _bytes_per_head(q, k, v, ctx, self.cfg.chunk))


_LINEAR_CAPS = Capabilities(
    family="linear", paper="Katharopoulos et al. 2020", exact=False, complexity="O(n*d^2)",
)


@register_mechanism(LinearConfig)
class Linear(_FeatureMapLinear):
    """Linear attention with a chosen positive feature map (``feature_map``).

    Paper: Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast
    Autoregressive Transformers with Linear Attention", ICML 2020.
    Formula: sim(q, k) = phi(q)^T phi(k) with phi(x) = elu(x) + 1 (the paper's) or relu(x);
    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps),
    with the sums over j <= i (prefix sums) when causal, which is the RNN
    S_i = S_{i-1} + phi(k_i) v_i^T, z_i = z_{i-1} + phi(k_i).
    Complexity O(n*d^2) time, O(d^2) state per head; causal: chunked prefix sums (``chunk``),
    as ``linear_elu``, which is this mechanism with feature_map="elu" (``linear_relu``:
    feature_map="relu"; one implementation).
    Deviations / notes: relu is not in the paper (it is the common alternative map); a row
    whose relu features are all 0 gives 0. As ``linear_elu``: raw q, k (no ``ctx.scale``),
    no attention dropout, 16-bit inputs accumulated in fp32, ``need_weights`` materialises
    the normalised phi(q) phi(k)^T matrix, O(n*m).
    """

    example: ClassVar[str] = "linear(feature_map='relu')"
    caps: ClassVar[Capabilities] = _LINEAR_CAPS


@register_mechanism(LinearReluConfig)
class LinearRelu(_FeatureMapLinear):
    """Linear attention with phi(x) = relu(x): ``linear(feature_map='relu')`` under its own name.

    Paper: Katharopoulos et al., "Transformers are RNNs", ICML 2020 (the linear-attention
    form; relu replaces its elu(x) + 1). Formula:
    out_i = relu(q_i)^T (sum_j relu(k_j) v_j^T) / (relu(q_i)^T sum_j relu(k_j) + eps).
    Complexity O(n*d^2). See ``linear`` for the notes.
    """

    example: ClassVar[str] = "linear_relu"
    caps: ClassVar[Capabilities] = _LINEAR_CAPS

@register_mechanism(LinearEluConfig)
class LinearElu(_FeatureMapLinear):
    """Linear attention with the elu(x) + 1 feature map.

    Paper: Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast
    Autoregressive Transformers with Linear Attention", ICML 2020.
    Formula: phi(x) = elu(x) + 1 (``linear(feature_map="elu")``, the same implementation);
    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps),
    with the sums over j <= i (prefix sums) when causal.
    Complexity O(n*d^2) time, O(d^2) state per head. Causal: chunked prefix sums over
    chunks of C (config ``chunk``) positions, O(n*(C*d + d^2)) time and O(n*(C + d^2/C))
    memory per head; measured peak extra memory at b=1, h=12, n=8192, d=64: 297 MB, vs
    3.1 GB for a per-position cumsum (bidirectional: 127 MB).
    Padding: padded keys are zeroed in phi(k), so they add nothing to either sum; a row
    with no visible key has numerator 0 and gives 0 (eps keeps the division finite).
    Deviations / notes: as in the paper and its fast-transformers code, the feature map
    takes the raw q, k (``ctx.scale`` is not used: the kernel has no temperature) and
    there is no attention dropout (no probability matrix exists on the O(n) path;
    ``ctx.dropout`` is ignored). 16-bit inputs are accumulated in fp32.
    ``need_weights`` materialises the normalised phi(q) phi(k)^T matrix, O(n*m).
    """

    example: ClassVar[str] = "linear_elu"
    caps: ClassVar[Capabilities] = _LINEAR_CAPS



# ------------------------------------------------------------------------------ Performer


@dataclass(frozen=True, kw_only=True)
class PerformerConfig(MechanismConfig):
    name: ClassVar[str] = "performer"
    num_features: int = 64  # m: random features per head (the paper takes m ~ d log d)
    redraw: Literal["every_forward", "fixed"] = "every_forward"  # redraw w_1..w_m in training
    orthogonal: bool = True  # orthogonal w_i (ORF blocks, the paper's); False: i.i.d. N(0, I_d)
    seed: int = 0  # seed of the draws of w, mixed with ctx.layer_idx (and the draw count)
    chunk: int = 64  # C: chunk length of the causal prefix sums (implementation, not paper)

    def __post_init__(self) -> None:
        if self.num_features < 1:
            raise ValueError(
                f"num_features (m) must be >= 1, got {self.num_features}; the default is "
                "num_features=64 (FAVOR+'s analysis takes m ~ d ln d, about 266 for head_dim "
                "64, and the paper's code uses 256)"
            )
        if self.redraw not in ("every_forward", "fixed"):
            raise ValueError(f"redraw must be 'every_forward' or 'fixed', got {self.redraw!r}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")


def gaussian_orthogonal_features(m: int, d: int, generator: torch.Generator,
                                 orthogonal: bool = True) -> torch.Tensor:
    """w [m, d] fp32: rows w_i ~ N(0, I_d), orthogonal within blocks of d when ``orthogonal``.

    ORF (the paper's): each block of d rows is Q^T of the QR of a d x d Gaussian matrix (signs
    fixed by diag(R), so Q is Haar-distributed); row i is then rescaled by the norm of an
    independent N(0, I_d) vector (chi_d distributed), so each row keeps the marginal law of
    a Gaussian row. The last block is cut to m mod d rows.
    """
    if not orthogonal:
        return torch.randn(m, d, generator=generator)
    blocks = []
    for _ in range(-(-m // d)):
        a = torch.randn(d, d, generator=generator, dtype=torch.float64)  # [d,d]
        qm, r = torch.linalg.qr(a)  # columns of qm orthonormal
        blocks.append((qm * torch.sign(torch.diagonal(r))).T)  # [d,d], rows orthonormal
    w = torch.cat(blocks)[:m]  # [m,d]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1)  # [m] chi_d
    return (w * norms[:, None]).float()


def _favor_exponent(x: torch.Tensor, w: torch.Tensor, key_mask: torch.Tensor | None
                    ) -> torch.Tensor:
    """w^T x - |x|^2/2 [b,h,L,m] for x [b,h,L,d]; -inf at padded positions (key_mask [b,L]
    False), so their features are 0."""
    expo = x @ w.transpose(0, 1) - x.square().sum(dim=-1, keepdim=True) / 2  # [b,h,L,m]
    if key_mask is not None:
        expo = expo.masked_fill(~key_mask[:, None, :, None].to(torch.bool), float("-inf"))
    return expo


def favor_features(x: torch.Tensor, w: torch.Tensor, key_mask: torch.Tensor | None = None,
                   is_query: bool = True) -> torch.Tensor:
    """phi(x) = exp(w^T x - |x|^2/2) / sqrt(m) [b,h,L,m] for x [b,h,L,d] (already scaled).

    Stabilised as the paper's code: the max exponent is subtracted before exp, per query row
    for queries and over all visible keys of a (batch, head) for keys. Both are common
    factors of a normaliser's numerator and denominator, so they cancel exactly (no eps is
    added, see Performer). Padded keys (key_mask [b,L] False) get phi = 0.
    """
    expo = _favor_exponent(x, w, None if is_query else key_mask)  # [b,h,L,m]
    with torch.no_grad():  # a constant for the gradient (it cancels)
        if is_query:
            stab = expo.amax(dim=-1, keepdim=True)  # [b,h,L,1]
        else:
            stab = expo.amax(dim=(-2, -1), keepdim=True)  # [b,h,1,1]
            stab = torch.where(torch.isfinite(stab), stab, torch.zeros_like(stab))  # all padded
        # 1/sqrt(m) inside the exponent: exp's output is then the features themselves, one
        # [b,h,L,m] tensor kept for the backward instead of two
        stab = stab + 0.5 * math.log(w.shape[0])
    return torch.exp(expo - stab)  # [b,h,L,m]


def favor_causal_key_features(x: torch.Tensor, w: torch.Tensor,
                              key_mask: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal keys' phi(k) [b,h,L,m] and their scales cs [b,h,L]: key j is stabilised by
    cs_j, the largest exponent among keys 0..j (a running maximum, so a later key never
    changes an earlier key's features); ``_causal`` brings each row's terms to its own
    scale. As ``favor_features`` otherwise (padded keys get phi = 0; 1/sqrt(m) inside the
    exponent). Leading padded keys take the first unpadded key's scale, so cs is
    non-decreasing; an all-padded row gets 0."""
    expo = _favor_exponent(x, w, key_mask)  # [b,h,L,m]
    with torch.no_grad():  # constants for the gradient (each row's cancels)
        cs = torch.cummax(expo.amax(dim=-1), dim=-1).values  # [b,h,L]
        finite = torch.isfinite(cs)
        first = torch.where(finite, cs, torch.full_like(cs, float("inf"))).amin(-1, keepdim=True)
        first = torch.where(torch.isfinite(first), first, torch.zeros_like(first))
        cs = torch.where(finite, cs, first) + 0.5 * math.log(w.shape[0])
    return torch.exp(expo - cs[..., None]), cs


def _mix_seed(seed: int, layer_idx: int, draw: int) -> int:
    # one 63-bit seed per (seed, layer, draw); distinct draws of one (seed, layer) give
    # distinct generators
    return ((seed * 1_000_003 + layer_idx) * 1_000_003 + draw) % (2**63)


@register_mechanism(PerformerConfig)
class Performer(nn.Module):
    """Performer: FAVOR+ (positive orthogonal random features) for the softmax kernel.

    Paper: Choromanski, Likhosherstov, Dohan, Song, Gane, Sarlos, Hawkins, Davis, Mohiuddin,
    Kaiser, Belanger, Colwell, Weller, "Rethinking Attention with Performers", ICLR 2021.
    Formula: with x' = x * s^(1/2), s = ctx.scale or d^-1/2 (the paper's d^-1/4),
    phi(x) = exp(W x' - |x'|^2/2) / sqrt(m), W = [w_1..w_m] orthogonal random features, so
    E[phi(q)^T phi(k)] = exp(s q^T k), the softmax kernel;
    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j)),
    sums over j <= i (prefix sums) when causal. Complexity O(n*m*d) time, O(m*d) state.
    Randomness: W is drawn from ``seed``, ``ctx.layer_idx`` and a draw number; eval mode
    (and ``redraw='fixed'``) always uses draw 0, so it is deterministic;
    ``redraw='every_forward'`` draws a fresh W at each training forward, as the paper
    recommends, its draw number taken from the global RNG (``last_draw``): reproducible from
    the run's seed, the same W when gradient checkpointing recomputes the forward, and on
    resume the draws of the uninterrupted run.
    Deviations / notes: the stabilising max is taken of the whole exponent (w^T x - |x|^2/2)
    rather than of w^T x alone, so the largest feature is exactly 1/sqrt(m); the paper's
    code also adds 1e-6 to every feature, which would stop the key max from cancelling
    (future keys would leak into causal rows), so instead a row with no visible key gives 0.
    Causal: each key is stabilised by the running maximum of the exponents up to it and each
    row's sums are brought to its own scale (``_causal``), so no future key reaches a past
    row. The official code takes one key maximum over the whole sequence: exact in exact
    arithmetic, but a future key whose exponent exceeds the past keys' by more than the
    dtype's range (about 87 in fp32) makes their features underflow to 0 and changes the
    past rows (to 0 when all underflow). No attention
    dropout (``ctx.dropout`` ignored); 16-bit inputs are computed in fp32; ``need_weights``
    materialises the normalised phi(q) phi(k)^T matrix, O(n*m).
    """

    example: ClassVar[str] = "performer(num_features=16)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="linear", paper="Choromanski et al. 2021", exact=False,
        complexity="O(n*r*d), r = num_features",
    )

    def __init__(self, cfg: PerformerConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.last_draw = 0  # the draw of the latest forward (0: the eval features)
        self._fixed: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def projection(self, layer_idx: int, draw: int = 0, device: torch.device | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [m, d] of draw ``draw`` for layer ``layer_idx`` (draw 0: the eval features)."""
        g = torch.Generator().manual_seed(_mix_seed(self.cfg.seed, layer_idx, draw))
        w = gaussian_orthogonal_features(self.cfg.num_features, self.dims.head_dim, g,
                                         self.cfg.orthogonal)
        return w.to(device=device, dtype=dtype)

    def _current_projection(self, layer_idx: int, device: torch.device,
                            dtype: torch.dtype) -> torch.Tensor:
        if self.training and self.cfg.redraw == "every_forward":
            # a fresh draw >= 1 from the global RNG: fixed by the run's seed, recomputed
            # alike under gradient checkpointing, continued alike on resume
            self.last_draw = 1 + global_draw()
            return self.projection(layer_idx, self.last_draw, device, dtype)
        self.last_draw = 0
        key = (layer_idx, device, dtype)
        if key not in self._fixed:
            self._fixed[key] = self.projection(layer_idx, 0, device, dtype)
        return self._fixed[key]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        work = accumulation_dtype(q.dtype)
        w = self._current_projection(ctx.layer_idx, q.device, work)  # [m,d]
        c = ctx.scale_for(q.shape[-1]) ** 0.5  # d^-1/4 on q and on k

        def heads(qg, kg, vg) -> AttnOutput:  # [b,g,n|m,d]: a group of g heads
            fq = favor_features(qg.to(work) * c, w)  # [b,g,n,m]
            if ctx.causal:  # each key in the scale of the keys up to it
                fk, cs = favor_causal_key_features(kg.to(work) * c, w, ctx.key_mask)
                return _linear_attention(fq, fk, vg.to(work), ctx, 0.0, self.cfg.chunk,
                                         q.dtype, cs)
            fk = favor_features(kg.to(work) * c, w, ctx.key_mask, is_query=False)  # [b,g,m,m]
            return _linear_attention(fq, fk, vg.to(work), ctx, 0.0, self.cfg.chunk, q.dtype)

        # in fp32 under autocast too (16-bit inputs are computed in fp32): under fp16
        # autocast the exponentials' products overflowed into inf gradients at inputs of std 4
        with torch.autocast(q.device.type, enabled=False):
            return over_head_groups(heads, (q, k, v), _bytes_per_head(
                q, k, v, ctx, self.cfg.chunk, self.cfg.num_features))
