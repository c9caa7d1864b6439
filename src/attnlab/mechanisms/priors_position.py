"""Attention with position priors: Gaussian terms over token distance, added to the scores
(``gaussian_prior``, ``gaussian_transformer``) or in place of them (``hardcoded_gaussian``).

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.5 ("attention with
prior": prior that models locality). RealFormer and the cross-layer helpers are in
``priors.py``; maps passed between layers in ``priors_layers.py``.

Positions: key j sits at position j (0-based) and query i at i + (m - n) (queries aligned to
the last n keys, as ``core.causal_mask``). Padding is assumed on the right (Hugging Face
tokenizers' default), so the unpadded tokens keep the positions they have without padding.

Shapes in comments: b batch, h heads, n query length, m key length, d head dim, dv value
head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

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
    register_mechanism,
    require,
)
from ._gaussian_window import FAST_DTYPES, gaussian_window, window_lags
from ._maskedsdpa import masked_sdpa
from ._rowchunks import attend_rows, draws_dropout, in_row_chunks

FAMILY = "priors"

# Smallest sigma_i used by gaussian_prior: D_i = I * sigmoid(.) can underflow to 0, and
# G = -(j - P_i)^2 / (2 sigma_i^2) must stay finite (at 1e-4 and n = 4096, |G| <= 1e15).
MIN_SIGMA = 1e-4


def _distance(n: int, m: int, device: torch.device, first_row: int = 0,
              rows: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(i + (m - n)) - j as ``dtype`` [rows,m]: query position minus key position, for
    query rows first_row .. first_row + rows - 1 of n (all n by default)."""
    rows = n if rows is None else rows
    i = torch.arange(first_row, first_row + rows, device=device,
                     dtype=dtype)[:, None] + (m - n)
    j = torch.arange(m, device=device, dtype=dtype)[None, :]
    return i - j


def _with_prior(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
                training: bool, prior) -> AttnOutput:
    """softmax(Q K^T * scale + prior + masks) V, the query rows in checkpointed chunks
    (``_rowchunks``) unless weights are asked for. ``prior(r0, q_rows)`` -> the additive
    term of query rows r0 .. ([b|1,h,c,m], in the scores' dtype)."""
    n, m = q.shape[-2], k.shape[-2]
    scale = ctx.scale_for(q.shape[-1])

    def rows(r0: int, qc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (qc @ k.transpose(-1, -2)) * scale  # [b,h,c,m]
        return attend_rows(scores + prior(r0, qc), v, ctx, training, r0, n)

    if ctx.need_weights:
        return AttnOutput(*rows(0, q))
    out = in_row_chunks(lambda r0, qc: rows(r0, qc)[0], q, m,
                        dropout=draws_dropout(ctx, training))
    return AttnOutput(out)


# --------------------------------------------------------------------------- gaussian_prior


@dataclass(frozen=True, kw_only=True)
class GaussianPriorConfig(MechanismConfig):
    name: ClassVar[str] = "gaussian_prior"


@register_mechanism(GaussianPriorConfig)
class GaussianPrior(nn.Module):
    """Localness: a Gaussian bias around a centre and window predicted from each query.

    Paper: Yang, Tu, Wong, Meng, Chao, Zhang, "Modeling Localness for Self-Attention
    Networks", EMNLP 2018 (the query-specific window).
    Formula, per head (q_i the query, I the number of unpadded keys of the sequence):
        P_i = I * sigmoid(v_p^T tanh(W_p q_i))       central position
        D_i = I * sigmoid(v_d^T tanh(W_p q_i))       window size
        G_ij = -(j - P_i)^2 / (2 sigma_i^2),  sigma_i = D_i / 2
        out = softmax(Q K^T / sqrt(d) + G + mask) V
    W_p is shared by the centre and the window (as in the paper); v_p, v_d differ.
    Parameters per head: W_p [h,d,d], v_p [h,d], v_d [h,d], initialised as ``nn.Linear``
    weights (uniform in +-1/sqrt(d)) from the global torch RNG; no biases (the paper has
    none). Complexity O(n*m*d); without ``need_weights`` the scores exist a chunk of query
    rows at a time, recomputed in the backward (``_rowchunks``: training memory O(n) plus
    one chunk instead of several [b, h, n, m] tensors).
    Deviations: I is the number of unpadded keys of each sequence, so a padded sequence is
    attended exactly as the unpadded one (right padding); sigma_i is clamped to >= 1e-4 so
    that G stays finite when the sigmoid underflows. Causal attention (masking after the
    prior) is allowed though the paper targets encoders. ``need_weights`` returns the
    probabilities; ``ctx.dropout`` applies to them in training.
    """

    example: ClassVar[str] = "gaussian_prior"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Yang et al. 2018", keys_are_tokens=True, complexity="O(n*m*d)",
    )

    def __init__(self, cfg: GaussianPriorConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h, d = dims.num_heads, dims.head_dim
        self.w_p = nn.Parameter(torch.empty(h, d, d))  # W_p [h,d_out,d_in]
        self.v_p = nn.Parameter(torch.empty(h, d))  # v_p [h,d]
        self.v_d = nn.Parameter(torch.empty(h, d))  # v_d [h,d]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s weight init (uniform +-1/sqrt(fan_in)), global torch RNG."""
        bound = 1.0 / math.sqrt(self.dims.head_dim)
        with torch.no_grad():
            for p in (self.w_p, self.v_p, self.v_d):
                p.uniform_(-bound, bound)

    def centre_and_window(self, q: torch.Tensor, ctx: AttnContext,
                          m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(P [b,h,n], D [b,h,n]) for queries q [b,h,n,d] over m keys, in q's accumulation
        dtype (float32 for 16-bit queries, else q's dtype)."""
        b = q.shape[0]
        work = accumulation_dtype(q.dtype)
        if ctx.key_mask is None:
            length = torch.full((b,), float(m), device=q.device, dtype=work)
        else:
            length = ctx.key_mask.to(torch.bool).sum(-1).to(work)  # I [b]
        length = length[:, None, None]  # [b,1,1]
        w_p, v_p, v_d = (p.to(work) for p in (self.w_p, self.v_p, self.v_d))
        t = torch.tanh(torch.einsum("bhnd,hed->bhne", q.to(work), w_p))  # tanh(W_p q_i)
        centre = length * torch.sigmoid(torch.einsum("bhne,he->bhn", t, v_p))  # P [b,h,n]
        window = length * torch.sigmoid(torch.einsum("bhne,he->bhn", t, v_d))  # D [b,h,n]
        return centre, window

    def prior(self, q: torch.Tensor, ctx: AttnContext, m: int) -> torch.Tensor:
        """G [b,h,n,m] for queries q [b,h,n,d], computed in q's accumulation dtype (float32
        for 16-bit queries), returned in q's dtype."""
        centre, window = self.centre_and_window(q, ctx, m)  # [b,h,n] each
        sigma = (window / 2).clamp_min(MIN_SIGMA)  # sigma_i [b,h,n]
        j = torch.arange(m, device=q.device, dtype=centre.dtype)  # [m]
        g = -(j - centre[..., None]).square() / (2 * sigma[..., None].square())  # [b,h,n,m]
        return g.to(q.dtype)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        m = k.shape[-2]
        return _with_prior(q, k, v, ctx, self.training,
                           lambda r0, qc: self.prior(qc, ctx, m))


# --------------------------------------------------------------------- gaussian_transformer


def _inverse_softplus(x: float) -> float:
    """y with softplus(y) = x, for x > 0 (stable for large x)."""
    return x + math.log(-math.expm1(-x))


@dataclass(frozen=True, kw_only=True)
class GaussianTransformerConfig(MechanismConfig):
    name: ClassVar[str] = "gaussian_transformer"
    w_init: float = 1.0  # w: initial weight of the squared distance d_ij^2 (kept > 0)
    b_init: float = -1.0  # b: initial offset (kept < 0)

    def __post_init__(self) -> None:
        require(math.isfinite(self.w_init) and self.w_init > 0,
                f"gaussian_transformer w_init must be > 0 (w is kept positive by "
                f"w = softplus(w_raw)), got {self.w_init}; e.g. w_init=1.0")
        require(math.isfinite(self.b_init) and self.b_init < 0,
                f"gaussian_transformer b_init must be < 0 (b is kept negative by "
                f"b = -softplus(b_raw)), got {self.b_init}; e.g. b_init=-1.0")


@register_mechanism(GaussianTransformerConfig)
class GaussianTransformer(nn.Module):
    """Gaussian self-attention: a learned, content-free distance prior on the scores.

    Paper: Guo, Zhang, Liu, "Gaussian Transformer: a Lightweight Approach for Natural
    Language Inference", AAAI 2019.
    Formula, per head, d_ij = i - j the distance of query i and key j:
        G_ij = -|w d_ij^2 + b|,   w >= 0, b <= 0 (learned scalars per head)
        out = softmax(Q K^T / sqrt(d) + G + mask) V
    With b < 0 the prior peaks (G = 0) at distance sqrt(-b / w) and gives the word itself
    (d = 0) the penalty b: neighbours weigh most, the central word less, far words least.
    Constraints by parameterisation: w = softplus(w_raw) > 0, b = -softplus(b_raw) < 0 (so
    the boundary values 0 are approached, not reached); init w = ``w_init``, b = ``b_init``
    (constants, so the same under every seed). ``bias(n, m)`` gives G [h,n,m] and the
    mechanism is softmax over that additive bias (``caps.exact``, tested against
    ``core.reference``). Complexity O(n*m) (dense scores, a chunk of query rows at a time
    and recomputed in the backward when no weights are asked for: ``_rowchunks``).
    Deviations: only the attention prior is implemented (the paper's encoding, interaction
    and comparison blocks are architecture, not attention). The paper's initial values of
    w, b are not given here; the defaults are a choice. ``need_weights`` returns the
    probabilities; ``ctx.dropout`` applies to them in training.
    """

    example: ClassVar[str] = "gaussian_transformer(w_init=0.5, b_init=-0.5)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Guo et al. 2019", exact=True, keys_are_tokens=True,
        complexity="O(n*m)",
    )

    def __init__(self, cfg: GaussianTransformerConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h = dims.num_heads
        self.w_raw = nn.Parameter(torch.empty(h))  # w = softplus(w_raw) [h]
        self.b_raw = nn.Parameter(torch.empty(h))  # b = -softplus(b_raw) [h]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w_raw.fill_(_inverse_softplus(self.cfg.w_init))
            self.b_raw.fill_(_inverse_softplus(-self.cfg.b_init))

    @property
    def w(self) -> torch.Tensor:
        """w [h], >= 0."""
        return F.softplus(self.w_raw)

    @property
    def b(self) -> torch.Tensor:
        """b [h], <= 0."""
        return -F.softplus(self.b_raw)

    def bias(self, n: int, m: int, first_row: int = 0, rows: int | None = None
             ) -> torch.Tensor:
        """G [h,n,m] = -|w d_ij^2 + b|, computed in the parameters' accumulation dtype
        (float32 for 16-bit parameters, where d^2 is exact; float64 stays float64); G
        [h,rows,m] for query rows first_row .. first_row + rows - 1 of n."""
        work = accumulation_dtype(self.w_raw.dtype)
        d2 = _distance(n, m, self.w_raw.device, first_row, rows, work).square()  # [n|rows,m]
        w, b = self.w.to(work)[:, None, None], self.b.to(work)[:, None, None]  # [h,1,1]
        return -(w * d2 + b).abs()

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        n, m = q.shape[-2], k.shape[-2]
        return _with_prior(q, k, v, ctx, self.training,
                           lambda r0, qc: self.bias(n, m, r0, qc.shape[-2]).to(qc.dtype))


# ----------------------------------------------------------------------- hardcoded_gaussian


@dataclass(frozen=True, kw_only=True)
class HardcodedGaussianConfig(MechanismConfig):
    name: ClassVar[str] = "hardcoded_gaussian"
    offsets: tuple[int, ...] = (-1, 1)  # mu_i - i per head, cycled over the heads
    sigma: float = 1.0  # sigma: standard deviation in positions

    def __post_init__(self) -> None:
        require(len(self.offsets) >= 1, "hardcoded_gaussian offsets must name at least one "
                "offset, e.g. offsets=[-1, 1] (the paper's encoder heads)")
        require(math.isfinite(self.sigma) and self.sigma > 0,
                f"hardcoded_gaussian sigma must be > 0 (a standard deviation in positions), "
                f"got {self.sigma}; the paper uses sigma=1")


@register_mechanism(HardcodedGaussianConfig)
class HardcodedGaussian(nn.Module):
    """Hard-coded Gaussian attention: fixed, input-agnostic weights over positions.

    Paper: You, Sun, Iyyer, "Hard-Coded Gaussian Attention for Neural Machine Translation",
    ACL 2020 (official code: fallcat/stupidNMT, ``models/new_attention.py``).
    Formula, head t (offset o_t = offsets[t mod len(offsets)], query i at position
    i + (m - n)):
        A_ij = N(j; i + o_t, sigma^2) / sum_{j' visible} N(j'; i + o_t, sigma^2)
             = softmax_j(-(j - i - o_t)^2 / (2 sigma^2) + mask)
        out = A V
    q and k are not read (``caps.reads_qk`` False: the host's Q/K projections get no
    gradient from these heads). Defaults follow the official encoder setting (heads
    alternate centres i-1 and i+1: ``--enc-attn-offset -1 1``; its decoder uses
    ``-1 0``, i.e. offsets=[-1, 0] with causal masking) and sigma 1.
    The offsets cycle over the heads of this mechanism's group, in its own head order.
    No parameters. Without ``need_weights`` or attention dropout, at length (float32 or
    float64, n <= m, at most m/2 lags within reach: R = ceil(sigma sqrt(2 cutoff)) of the
    centres, 15 for sigma 1 in float32) it runs as a depthwise convolution of the masked
    values with the Gaussian, O(n*W) for W ~ 2R lags (``_gaussian_window``: equal to the
    dense prior to the dtype's rounding, rows far from every visible key computed around
    their nearest one); shorter inputs run on ``F.scaled_dot_product_attention``
    (``_maskedsdpa``) with the prior as its mask (only the [h, n, m] prior is stored).
    Deviations: the official code uses the Gaussian density values themselves as weights
    (rows sum to ~1 for sigma=1 away from the edges, less at the edges and next to
    padding); here each row is renormalised over its visible keys, so rows sum to 1 and
    padding is invisible. ``need_weights`` returns A [b,h,n,m]; ``ctx.dropout`` applies to
    A in training. Rows with no visible key give 0.
    """

    example: ClassVar[str] = "hardcoded_gaussian(offsets=[-1, 0, 1], sigma=1.0)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="You et al. 2020", keys_are_tokens=True, reads_qk=False,
        complexity="O(n*sigma) (O(n*m) below ~60*sigma keys)",
    )

    offset_per_head: torch.Tensor  # buffer registered in __init__

    def __init__(self, cfg: HardcodedGaussianConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        offs = [cfg.offsets[t % len(cfg.offsets)] for t in range(dims.num_heads)]
        self.offsets = tuple(offs)  # o_t per head as ints (the convolution path's kernel)
        self.register_buffer("offset_per_head", torch.tensor(offs, dtype=torch.float32),
                             persistent=False)  # o_t [h]

    def windowed(self, n: int, m: int, dtype: torch.dtype, causal: bool) -> bool:
        """Whether the convolution path runs (``_gaussian_window``): float32/64, queries
        no more than keys, and a window of lags under half the keys (else the dense prior
        costs about as much)."""
        if dtype not in FAST_DTYPES or n > m:
            return False
        lo, hi = window_lags(list(self.offsets), self.cfg.sigma, dtype, causal)
        return 2 * (hi - lo + 1) <= m

    def logits(self, n: int, m: int, device: torch.device,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-(j - i - o_t)^2 / (2 sigma^2) as [h,n,m], computed in ``dtype`` (float32, or
        float64 for float64 inputs)."""
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        gap = (-_distance(n, m, device).to(dtype)
               - self.offset_per_head.to(device, dtype)[:, None, None])
        return -gap.square() / (2 * self.cfg.sigma**2)  # [h,n,m]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        n, m = q.shape[-2], k.shape[-2]
        plain = not ctx.need_weights and not (self.training and ctx.dropout > 0)
        if plain and self.windowed(n, m, v.dtype, ctx.causal):
            return AttnOutput(gaussian_window(v, n, list(self.offsets), self.cfg.sigma,
                                              ctx.key_mask, ctx.causal))
        logits = self.logits(n, m, v.device, v.dtype).to(v.dtype)[None]  # [1,h,n,m]
        if not plain:
            out, probs = attend_rows(logits, v, ctx, self.training)
            return AttnOutput(out, probs if ctx.need_weights else None)
        # softmax(0 + logits + masks) V on SDPA's fused kernel: zero queries and keys make
        # every score 0, so the prior is the whole logit, and the [b,h,n,m] probabilities
        # are never stored (the [1,h,n,m] prior is). Zeros of v's head dim: the CPU flash
        # kernel needs equal q, k and v dims (else the materialising math path runs).
        zq = v.new_zeros(*v.shape[:2], n, v.shape[-1])  # [b,h,n,dv]
        zk = v.new_zeros(v.shape)  # [b,h,m,dv]
        return AttnOutput(masked_sdpa(zq, zk, v, logits, ctx.key_mask, ctx.causal, 1.0, 0.0))
