"""Multi-head changes to what heads share and how far they look: collaborative heads (shared
query/key projections, with the conversion of a pretrained layer by tensor decomposition)
and adaptive attention span (a learned soft span per head).

Shape glossary: b batch, h heads, n query length, m key length, d head dim, dv value dim,
D the host's hidden size (input of the projections), Dk the shared query/key width
(``dk_shared``), R a CP rank (= Dk), w one-sided window.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
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
    masked_softmax,
    register_mechanism,
    require,
)
from ..core.masks import positions
from .dense import Softmax, SoftmaxConfig

FAMILY = "heads"


# ------------------------------------------------------------------ CP decomposition (ALS)

# Below this many multiply-adds per ALS sweep (I*J*K*R) the sweep runs on one thread: its
# many tiny ops were 3-30x slower with 2 threads on the shared 2-core CPU (0.06-0.08 s vs
# 0.27-2.6 s for 100 sweeps of a 32 x 4 x 32 tensor at rank 16).
SMALL_SWEEP = 1 << 24


@contextmanager
def _threads_for(work: int) -> Iterator[None]:
    """One intra-op thread while running small work, restored afterwards."""
    old = torch.get_num_threads()
    if work >= SMALL_SWEEP or old == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _rel_error(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> float:
    """||T - sum_r a_r o b_r o c_r||_F / ||T||_F, by reconstruction (exact, O(I*J*K*R))."""
    approx = torch.einsum("ir,jr,kr->ijk", a, b, c)
    norm = t.norm()
    return float((t - approx).norm() / norm) if norm > 0 else float((t - approx).norm())


def cp_als(tensor: torch.Tensor, rank: int, *, iters: int = 100, tol: float = 1e-6,
           generator: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """CP (PARAFAC) decomposition T ~ sum_r A[:,r] o B[:,r] o C[:,r] by alternating least
    squares, as tensorly's ``parafac(init="random")`` that the official conversion calls.

    tensor [I,J,K]; returns (A [I,R], B [J,R], C [K,R], relative Frobenius error), in
    float64. Factors start uniform in [0, 1) (tensorly's random init) from ``generator``
    (None: the global torch RNG); iteration stops after ``iters`` sweeps or when the
    relative error changes by less than ``tol`` (tensorly's rule).
    """
    t = tensor.detach().to(torch.float64)
    with _threads_for(t.numel() * rank):
        return _als(t, rank, iters, tol, generator)


def _als(t: torch.Tensor, rank: int, iters: int, tol: float,
         generator: torch.Generator | None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    big_i, big_j, big_k = t.shape
    a, b, c = (torch.rand(s, rank, generator=generator, dtype=torch.float64).to(t.device)
               for s in (big_i, big_j, big_k))
    norm2 = t.square().sum()
    prev = None
    for _ in range(iters):
        tc = t @ c  # [I,J,R]: T x_3 C, shared by the A and B updates
        a = torch.einsum("ijr,jr->ir", tc, b) @ torch.linalg.pinv((b.T @ b) * (c.T @ c))
        b = torch.einsum("ijr,ir->jr", tc, a) @ torch.linalg.pinv((a.T @ a) * (c.T @ c))
        mc = torch.einsum("ijk,ir,jr->kr", t, a, b)  # [K,R]: MTTKRP of mode 3
        c = mc @ torch.linalg.pinv((a.T @ a) * (b.T @ b))
        # ||T - T^||^2 = ||T||^2 - 2 <T, T^> + ||T^||^2 (cheap; the final error is exact)
        fit2 = norm2 - 2 * (c * mc).sum() + ((a.T @ a) * (b.T @ b) * (c.T @ c)).sum()
        err = float(fit2.clamp_min(0).sqrt() / norm2.sqrt()) if norm2 > 0 else 0.0
        if prev is not None and abs(prev - err) < tol:
            break
        prev = err
    return a, b, c, _rel_error(t, a, b, c)


@dataclass(frozen=True)
class CollaborativeFactors:
    """A layer's heads in collaborative form (weights in ``nn.Linear`` layout)."""

    query: torch.Tensor  # W~_Q [Dk, D]: shared query projection
    key: torch.Tensor  # W~_K [Dk, D]: shared key projection
    mixing: torch.Tensor  # M [h, Dk]: per-head mixing vectors m_h
    content: torch.Tensor  # U [h, Dk]: content-bias vectors (score term u_h . k~_j)
    error: float  # ||T - T^||_F / ||T||_F, T[:, h, :] = W_Q^h^T W_K^h (all heads)
    content_error: float  # relative error of the content bias c_h = W_K^h^T b_Q^h


def _balance(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale CP columns so a_r and b_r have equal norms (their product unchanged)."""
    na, nb = a.norm(dim=0), b.norm(dim=0)  # [R]
    s = (na * nb).sqrt()
    ok = (na > 0) & (nb > 0)
    return (torch.where(ok, a * s / na.clamp_min(1e-300), a),
            torch.where(ok, b * s / nb.clamp_min(1e-300), b))


def collaborative_from_heads(
    w_q: torch.Tensor, w_k: torch.Tensor, num_heads: int, dk_shared: int,
    b_q: torch.Tensor | None = None, *, iters: int = 100, tol: float = 1e-6,
    generator: torch.Generator | None = None,
) -> CollaborativeFactors:
    """Convert a layer's per-head W_Q, W_K into shared projections and mixing vectors.

    The paper's conversion (Cordonnier et al. 2020, Sec. 4; official ``swap.py``): stack the
    per-head products T[:, h, :] = W_Q^h^T W_K^h [D, D] into T [D, h, D] and decompose it
    by CP of rank Dk: T[q, h, k] ~ sum_r W~_Q[r, q] M[h, r] W~_K[r, k]. At Dk >= h*d the
    layer is reproduced exactly without decomposition (the official code's concatenate case
    at Dk = h*d): W~_Q, W~_K are the concatenated W_Q, W_K and m_h the indicator of head h's
    block; further coordinates get random (global RNG) projection rows and zero mixing.
    The query bias enters the scores only through c_h . x_j with c_h = W_K^h^T b_Q^h (the
    key bias and the rest are constant along a softmax row); it is fitted as u_h . k~_j by
    least squares, u_h in R^Dk (exact at Dk >= h*d).

    w_q, w_k [h*d, D] (``nn.Linear.weight``), b_q [h*d] or None. Returns
    :class:`CollaborativeFactors` in w_q's dtype and device.
    """
    hd, big_d = w_q.shape
    require(w_k.shape == w_q.shape, f"W_Q {tuple(w_q.shape)} and W_K {tuple(w_k.shape)} must "
            "have the same shape [h*d, D]")
    require(hd % num_heads == 0, f"W_Q has {hd} rows, not a multiple of {num_heads} heads")
    require(dk_shared >= 1, f"dk_shared must be >= 1, got {dk_shared}")
    d = hd // num_heads
    wq = w_q.detach().to(torch.float64).view(num_heads, d, big_d)  # [h,d,D]
    wk = w_k.detach().to(torch.float64).view(num_heads, d, big_d)  # [h,d,D]
    bq = (torch.zeros(num_heads, d, dtype=torch.float64, device=w_q.device) if b_q is None
          else b_q.detach().to(torch.float64).view(num_heads, d))  # [h,d]
    content = torch.einsum("hd,hdk->hk", bq, wk)  # c_h = W_K^h^T b_Q^h, [h,D]
    if dk_shared >= hd:
        extra = dk_shared - hd
        rnd = torch.randn(2, extra, big_d, generator=generator, dtype=torch.float64)
        rnd = rnd.to(w_q.device) * w_q.detach().double().std()
        query = torch.cat([w_q.detach().double(), rnd[0]])  # [Dk,D]
        key = torch.cat([w_k.detach().double(), rnd[1]])  # [Dk,D]
        mixing = torch.zeros(num_heads, dk_shared, dtype=torch.float64, device=w_q.device)
        u = torch.zeros_like(mixing)
        for h in range(num_heads):
            mixing[h, h * d:(h + 1) * d] = 1.0
            u[h, h * d:(h + 1) * d] = bq[h]  # u_h . k~_j = b_Q^h . W_K^h x_j
        error = content_error = 0.0
    else:
        t = torch.einsum("hdq,hdk->qhk", wq, wk)  # [D,h,D]: T[:, h, :] = W_Q^h^T W_K^h
        a, m, c, error = cp_als(t, dk_shared, iters=iters, tol=tol, generator=generator)
        a, c = _balance(a, c)  # a [D,R] query side, c [D,R] key side, m [h,R] mixing
        query, key, mixing = a.T, c.T, m
        # least squares W~_K^T u_h ~ c_h for every head at once: [D,R] u^T = [D,h]
        u = torch.linalg.lstsq(key.T.cpu(), content.T.cpu()).solution.T.to(key.device)
        cn = content.norm()
        content_error = float((u @ key - content).norm() / cn) if cn > 0 else 0.0
    dtype, device = w_q.dtype, w_q.device
    return CollaborativeFactors(query.to(device=device, dtype=dtype),
                                key.to(device=device, dtype=dtype),
                                mixing.to(device=device, dtype=dtype),
                                u.to(device=device, dtype=dtype), error, content_error)


def collaborative_error_curve(
    w_q: torch.Tensor, w_k: torch.Tensor, num_heads: int, ranks: list[int] | range,
    b_q: torch.Tensor | None = None, *, iters: int = 100, tol: float = 1e-6,
    generator: torch.Generator | None = None,
) -> list[tuple[int, float, float]]:
    """(rank, relative error of W_Q^h W_K^h^T, relative error of the content bias) for
    each rank: how much of a pretrained layer collaborative heads of width Dk keep."""
    out = []
    for r in ranks:
        f = collaborative_from_heads(w_q, w_k, num_heads, int(r), b_q, iters=iters, tol=tol,
                                     generator=generator)
        out.append((int(r), f.error, f.content_error))
    return out


# ---------------------------------------------------------------------------- collaborative


@dataclass(frozen=True, kw_only=True)
class CollaborativeConfig(MechanismConfig):
    name: ClassVar[str] = "collaborative"
    dk_shared: int | None = None  # D~_k: width of the shared W~_Q, W~_K (None: h*d, lossless)
    convert: bool = True  # apply_plan decomposes the host's W_Q^h W_K^h^T (paper Sec. 4)
    mixing_init: Literal["normal", "concatenate", "ones"] = "normal"  # M without conversion
    als_iters: int = 100  # conversion: CP-ALS sweeps (tensorly's n_iter_max)
    als_tol: float = 1e-6  # conversion: stop when the relative error moves less (official)

    def __post_init__(self) -> None:
        require(self.dk_shared is None or self.dk_shared >= 1, "collaborative dk_shared "
                f"(D~_k) must be >= 1, got {self.dk_shared}; leave it None for h*d")
        require(self.als_iters >= 1, f"collaborative als_iters must be >= 1, got "
                f"{self.als_iters}")
        require(self.als_tol >= 0, f"collaborative als_tol must be >= 0, got {self.als_tol}")


@register_mechanism(CollaborativeConfig)
class Collaborative(nn.Module):
    """Collaborative multi-head attention: all heads share one query and one key projection
    of width Dk and differ only by a mixing vector.

    Paper: Cordonnier, Loukas, Jaggi, "Multi-Head Attention: Collaborate Instead of
    Concatenate", arXiv 2006.16362, 2020 (official code github epfml/collaborative-attention).
    Formula: q~ = W~_Q x [Dk], k~ = W~_K x [Dk] shared by all heads; head h scores
      s_h(i, j) = scale * ( (q~_i * m_h) . k~_j + u_h . k~_j ),
    m_h in R^Dk its mixing vector, u_h . k~_j its content bias; A_h = softmax_j(s_h);
    out_h = A_h V_h with the host's per-head values. Complexity O(h*n*m*Dk) for the scores.
    Scope "module": surgery replaces the host's query and key projections by the shared
    W~_Q, W~_K (``nn.Linear(D, Dk, bias=False)``) through :meth:`adopt_projections`, which
    with ``convert=True`` also converts the pretrained layer (:func:`collaborative_from_heads`:
    exact at Dk >= h*d, CP decomposition below; ``conversion_error`` keeps the relative
    errors; ``load_pretrained`` skips the conversion, the saved weights follow). The host
    then splits q~, k~ into Dk/d "heads" of d, so the mechanism receives q [b, Dk/d, n, d],
    k [b, Dk/d, m, d] (the shared vectors, reshaped) and v [b, h, m, dv]; Dk must be a
    multiple of d. Re-applying a plan to the layer is refused. Used standalone (or on a fused
    Q/K/V host, which surgery refuses) q and k are read the same way, so q, k with h heads
    mean Dk = h*d.
    Deviations: the official code scales by 1/sqrt(Dk/h); here the host's scale (1/sqrt(d))
    is kept, so that the conversion reproduces the layer at any Dk. Its content bias is a
    separate Linear(D, h) on the layer input; here the mechanism sees k~, not x, so the
    content bias is u_h . k~_j = x_j . (W~_K^T u_h): exact at Dk >= h*d, the least-squares
    fit in the span of W~_K below (``conversion_error`` reports it too). Without conversion,
    M starts as the official fresh default ("normal": N(0, 0.2^2), the official UNIFORM
    enum) and u_h at 0; the shared projections keep nn.Linear's init.
    """

    example: ClassVar[str] = "collaborative"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Cordonnier et al. 2020", scope="module", exact=False,
        keys_are_tokens=True, complexity="O(n*m*Dk)",
    )

    def __init__(self, cfg: CollaborativeConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h, d = dims.num_heads, dims.head_dim
        self.dk = cfg.dk_shared if cfg.dk_shared is not None else h * d
        require(self.dk % d == 0, f"collaborative dk_shared={self.dk} must be a multiple of "
                f"the head dim d={d} (the host splits the shared projections into heads of d); "
                f"use dk_shared={max(d, self.dk // d * d)} or {(self.dk // d + 1) * d}")
        self.mixing = nn.Parameter(torch.empty(h, self.dk))  # M [h,Dk]: m_h
        self.content = nn.Parameter(torch.zeros(h, self.dk))  # U [h,Dk]: content bias u_h
        self.attend = Softmax(SoftmaxConfig(), dims)
        self.conversion_error: tuple[float, float] | None = None  # (T, content) after convert
        self.reset_mixing()

    def reset_mixing(self) -> None:
        """The official ``init_mixing_matrix``: N(0, 0.2^2), ones, or concatenate blocks."""
        h = self.dims.num_heads
        with torch.no_grad():
            if self.cfg.mixing_init == "normal":
                self.mixing.normal_(std=0.2)
            elif self.cfg.mixing_init == "ones":
                self.mixing.fill_(1.0)
            else:  # concatenate: head i owns coordinates [i*c, (i+1)*c), c = ceil(Dk / h)
                self.mixing.zero_()
                c = math.ceil(self.dk / h)
                for i in range(h):
                    self.mixing[i, i * c:(i + 1) * c] = 1.0

    def adopt_projections(self, query: nn.Linear, key: nn.Linear, *, convert: bool = True
                          ) -> tuple[nn.Linear, nn.Linear]:
        """Surgery hook: the host's Q, K projections [h*d <- D] -> the shared W~_Q, W~_K
        [Dk <- D] that replace them. With ``convert`` (the caller's, and the config's) the
        layer is converted (see :func:`collaborative_from_heads`) and M, U are set from it;
        ``load_pretrained`` passes convert=False (the saved weights follow)."""
        h, d = self.dims.num_heads, self.dims.head_dim
        for name, lin in (("query", query), ("key", key)):
            require(isinstance(lin, nn.Linear), f"collaborative replaces the {name} projection "
                    f"but it is a {type(lin).__name__}, not an nn.Linear; apply the plan before "
                    "tuners that wrap projections")
            require(lin.out_features == h * d and lin.in_features == query.in_features,
                    f"collaborative: the {name} projection maps {lin.in_features} -> "
                    f"{lin.out_features}, expected D -> h*d = {h * d}")
        w = query.weight
        new = [nn.Linear(query.in_features, self.dk, bias=False, device=w.device,
                         dtype=w.dtype) for _ in range(2)]
        if convert and self.cfg.convert:
            f = collaborative_from_heads(w, key.weight, h, self.dk, query.bias,
                                         iters=self.cfg.als_iters, tol=self.cfg.als_tol)
            with torch.no_grad():
                new[0].weight.copy_(f.query)
                new[1].weight.copy_(f.key)
                self.mixing.copy_(f.mixing)
                self.content.copy_(f.content)
            self.conversion_error = (f.error, f.content_error)
        for lin, old in zip(new, (query, key), strict=True):
            lin.weight.requires_grad_(old.weight.requires_grad)
        return new[0], new[1]

    def _shared(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """[b, Dk/d, L, d] (the host's view of the shared projection) -> [b, L, Dk]."""
        require(x.dim() == 4 and x.shape[1] * x.shape[3] == self.dk, f"collaborative: {name} "
                f"must be [b, Dk/d, L, d] with Dk = dk_shared = {self.dk}, got "
                f"{tuple(x.shape)}; was the plan applied by attnlab.apply_plan?")
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], self.dk)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        qs, ks = self._shared(q, "q"), self._shared(k, "k")  # [b,n,Dk], [b,m,Dk]
        b, m, h = qs.shape[0], ks.shape[1], self.dims.num_heads
        require(ks.shape[0] == b, f"batch sizes differ: q {b}, k {ks.shape[0]}")
        require(v.dim() == 4 and v.shape[1] == h and v.shape[0] == b and v.shape[2] == m,
                f"collaborative: v must be [b={b}, h={h}, m={m}, dv], got {tuple(v.shape)}")
        mix, u = self.mixing.to(qs.dtype), self.content.to(qs.dtype)
        mixed = qs[:, None] * mix[None, :, None, :] + u[None, :, None, :]  # [b,h,n,Dk]
        keys = ks[:, None].expand(b, h, m, self.dk)  # [b,h,m,Dk], no copy
        # scores (q~_i * m_h + u_h) . k~_j at the host's scale; softmax mechanism does the rest
        return self.attend(mixed, keys, v, replace(ctx, scale=ctx.scale_for(self.dims.head_dim)))


# --------------------------------------------------------------------------- adaptive span


@dataclass(frozen=True, kw_only=True)
class AdaptiveSpanConfig(MechanismConfig):
    name: ClassVar[str] = "adaptive_span"
    max_span: int = 512  # S: largest span; z = S * current_val (official attn_span)
    ramp: int = 32  # R: length of the soft mask's ramp (official adapt_span_ramp)
    init: float = 0.0  # z_0 / S: initial span ratio in [0, 1] (official adapt_span_init)
    weight: float = 2e-6  # lambda: L1 span penalty (official adapt_span_loss, small models)

    def __post_init__(self) -> None:
        require(self.max_span >= 1, f"adaptive_span max_span (S) must be >= 1, got "
                f"{self.max_span}")
        require(self.ramp >= 1, f"adaptive_span ramp (R) must be >= 1, got {self.ramp}")
        require(0.0 <= self.init <= 1.0, f"adaptive_span init is the initial span ratio "
                f"z_0 / max_span and must lie in [0, 1], got {self.init}")
        require(self.weight >= 0, f"adaptive_span weight (lambda) must be >= 0, got "
                f"{self.weight}")


NORM_EPS = 1e-8  # the official renormalisation's epsilon: attn / (attn.sum(-1) + 1e-8)
_SPAN_CHUNK = 64  # queries per chunk of the band path (at least the current span)


@register_mechanism(AdaptiveSpanConfig)
class AdaptiveSpan(nn.Module):
    """Adaptive attention span: each head learns how far it looks, through a soft mask.

    Paper: Sukhbaatar, Grave, Bojanowski, Joulin, "Adaptive Attention Span in Transformers",
    ACL 2019 (official code github facebookresearch/adaptive-span).
    Formula: m_z(x) = clamp((R + z - x) / R, 0, 1) on the distance x of key j from query i;
    a_ij = m_z(x_ij) softmax_j(s_ij) / (sum_j' m_z(x_ij') softmax_j'(s_ij') + 1e-8) (the
    official renormalisation of the masked softmax); aux loss lambda * mean_h z_h (the L1
    span penalty, official ``get_loss``). Per head z_h = S * current_val_h with current_val
    kept in [0, 1] (official ``clamp_param``, which the official trainer calls after every
    update; here it runs at the start of each training forward, i.e. before the parameter is
    used again, and the forward reads the clamped value).
    Computation is restricted to the current maximum span L = min(S, ceil(max_h z_h) + R)
    (official ``get_current_max_size``): only keys with x < L are scored, the softmax runs
    over them, on a band of 2L - 1 keys per query when that is narrower than the sequence
    (O(n*L*d)), else densely over the n x m scores masked to x < L.
    Bidirectional use (deviation, documented): the paper is causal, x = i - j; here x =
    |i - j| (raw 0-based positions, also when n != m), which equals i - j under
    ``ctx.causal`` (keys j <= i). At z >= n (with S >= n) every mask value is 1 and this is
    softmax attention (up to the 1e-8).
    Own token (deviation): the paper and the official ``SeqAttention`` attend the S previous
    tokens r in [t - S, t), not token t itself (the paper's m_z(t - r) then starts at
    x = 1, while the official mask template gives the nearest key the value of x = 0, so
    the two differ by one position). Here the query's own key is a key at x = 0 (every
    mechanism of the library attends to its own token) and the official template's values
    apply from there: m_z(x) over x = 0, 1, ..., L - 1.
    """

    example: ClassVar[str] = "adaptive_span(max_span=16, ramp=4, init=0.5)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Sukhbaatar et al. 2019", scope="head", exact=False,
        keys_are_tokens=True, complexity="O(n*L)",
    )

    def __init__(self, cfg: AdaptiveSpanConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        # current_val [h]: z_h / S (official AdaptiveMask.current_val, shape (h, 1, 1))
        self.current_val = nn.Parameter(torch.full((dims.num_heads,), float(cfg.init)))

    def clamp_param(self) -> None:
        """Project current_val into [0, 1] (in place; a no-op when it already is)."""
        with torch.no_grad():
            if bool(((self.current_val < 0) | (self.current_val > 1)).any()):
                self.current_val.clamp_(0.0, 1.0)

    def spans(self) -> torch.Tensor:
        """z [h] = S * current_val, its value clamped to [0, 1] and its gradient that of
        S * current_val (the official mask and loss read current_val unclamped, kept in
        range by ``clamp_param``; a differentiable clamp would give a head sitting on a
        bound a gradient that depends on torch's convention there: 1 up to torch 2.13,
        0 in 2.14)."""
        val = self.current_val
        return self.cfg.max_span * (val + (val.clamp(0.0, 1.0) - val).detach())

    def current_max_span(self) -> int:
        """L = min(S, ceil(max_h z_h) + R): keys at distance >= L have mask 0."""
        top = float(self.current_val.detach().clamp(0.0, 1.0).max())
        return max(1, min(self.cfg.max_span, math.ceil(top * self.cfg.max_span) + self.cfg.ramp))

    def soft_mask(self, x: torch.Tensor) -> torch.Tensor:
        """m_z(x) for integer distances x [...] -> [h, ...] in [0, 1], in the parameter's
        accumulation dtype (float32 for 16-bit parameters, float64 stays float64)."""
        z = self.spans()
        z = z.to(accumulation_dtype(z.dtype)).view(-1, *([1] * x.dim()))  # [h,1..]
        return ((self.cfg.ramp + z - x.to(z.dtype)) / self.cfg.ramp).clamp(0.0, 1.0)

    def _renormalise(self, probs: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
        """softmax probs [b,h,n,L] x m_z [h,n|1,L] -> renormalised (then dropout), in the
        accumulation dtype for 16-bit probs: in fp16 the 1e-8 is 0, and a row with no
        visible key (all its span padding) gave 0 / 0 = NaN."""
        work = accumulation_dtype(probs.dtype)
        a = probs.to(work) * mask.to(work)
        a = (a / (a.sum(-1, keepdim=True) + NORM_EPS)).to(probs.dtype)
        return F.dropout(a, p, training=True) if p > 0 else a

    def _dense(self, q, k, v, ctx: AttnContext, span: int, scale: float, p: float):
        n, m = q.shape[2], k.shape[2]
        scores = (q @ k.transpose(-1, -2)) * scale  # [b,h,n,m]
        i, j = positions(n, m, q.device)
        x = (i - j).abs()  # [n,m]
        allowed = x < span  # [n,m]
        if ctx.causal:
            allowed = allowed & (j <= i)
        allowed = allowed.expand(scores.shape)
        if ctx.key_mask is not None:
            allowed = allowed & ctx.key_mask[:, None, None, :].to(torch.bool)
        probs = masked_softmax(scores, allowed)  # softmax over the current span
        probs = self._renormalise(probs, self.soft_mask(x), 0.0)  # [b,h,n,m]
        pd = F.dropout(probs, p, training=True) if p > 0 else probs
        return pd @ v.to(pd.dtype), probs

    def _band(self, q, k, v, ctx: AttnContext, span: int, scale: float, p: float):
        """Keys j = i - w .. i + w (w = span - 1; right side 0 when causal) only, in chunks
        of c queries: chunk [i0, i1) is scored against the key rows [i0 - w, i1 + w) of the
        zero-padded K, a view, by one matmul [b,h,c,d] x [b,h,d,c+2w]; keys outside a
        query's band are masked. So no [b,h,n,d,2w+1] copy of K or V is made (an unfolded
        window's einsum made one each: 11x the softmax model's peak memory in the bench
        encoder at 4 x 4096 tokens, 2.1x now), at the cost of scoring c + 2w keys per query
        instead of 2w + 1 (c = max(``_SPAN_CHUNK``, span)). The distance of key slot t from
        query a of a chunk is t - w - a in every chunk, so the band and the soft mask are
        built once. With gradients on, each chunk runs under a non-reentrant checkpoint
        (keeping the RNG state when dropout draws): autograd keeps the padded K and V and
        the chunk's queries, not its scores, probabilities and their renormalisation
        (bench encoder at 4 x 4096 tokens: 267 -> 134 MB, about 1.04x softmax's peak, for
        a step 29% longer)."""
        b, h, n, _ = q.shape
        left = span - 1
        right = 0 if ctx.causal else left
        c = min(max(_SPAN_CHUNK, span), n)  # queries per chunk
        cw = c + left + right  # key slots per chunk
        rel = (torch.arange(cw, device=q.device)[None, :] - left
               - torch.arange(c, device=q.device)[:, None])  # [c,cw]: key j minus query i
        band = (rel >= -left) & (rel <= right)  # [c,cw]
        soft = self.soft_mask(rel.abs())  # m_z [h,c,cw]
        # key slots that hold a key: padding rows are not keys, nor are masked keys
        slots = torch.zeros(b, n + left + right, dtype=torch.bool, device=q.device)
        slots[:, left : left + n] = True if ctx.key_mask is None else ctx.key_mask.to(
            device=q.device, dtype=torch.bool).expand(b, n)
        kp = F.pad(k, (0, 0, left, right))  # [b,h,n+l+r,d]
        vp = F.pad(v, (0, 0, left, right)).to(q.dtype)

        def chunk(i0: int, qc: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
            ci = qc.shape[2]
            keys = slice(i0, i0 + ci + left + right)  # the chunk's key slots
            scores = (qc @ kp[:, :, keys].transpose(-1, -2)) * scale  # [b,h,ci,ci+l+r]
            allowed = band[:ci, : scores.shape[-1]] & slots[:, None, None, keys]  # [b,1,ci,.]
            probs = masked_softmax(scores, allowed)  # [b,h,ci,ci+l+r]
            probs = self._renormalise(probs, soft[:, :ci, : scores.shape[-1]], p)
            return probs @ vp[:, :, keys]  # [b,h,ci,dv]

        outs = []
        for i0 in range(0, n, c):
            qc = q[:, :, i0 : i0 + c]  # [b,h,ci,d]
            if torch.is_grad_enabled():  # the chunk's scores recomputed in the backward
                outs.append(checkpoint(chunk, i0, qc, soft, use_reentrant=False,
                                       preserve_rng_state=p > 0))
            else:
                outs.append(chunk(i0, qc, soft))
        return torch.cat(outs, dim=2)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if self.training:
            self.clamp_param()
        n, m = q.shape[2], k.shape[2]
        span = self.current_max_span()  # L
        scale = ctx.scale_for(q.shape[-1])
        p = ctx.dropout if self.training else 0.0
        aux = (self.cfg.weight * self.spans().mean()).to(q.dtype)  # lambda * mean_h z_h
        band = (2 * span - 1) if not ctx.causal else span  # keys per query on the band
        if n == m and not ctx.need_weights and 2 * band <= m:
            return AttnOutput(self._band(q, k, v, ctx, span, scale, p), None, aux)
        out, probs = self._dense(q, k, v, ctx, span, scale, p)
        return AttnOutput(out, probs if ctx.need_weights else None, aux)
