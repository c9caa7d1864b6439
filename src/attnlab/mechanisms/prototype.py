"""Attention with prototype queries: attention is computed for a few representative queries
and shared with (or given in a cheap form to) the others.

``clustered`` / ``improved_clustered``: Vyas, Katharopoulos, Fleuret, "Fast Transformers with
Clustered Attention", NeurIPS 2020 (code: idiap/fast-transformers).
``probsparse``: Zhou et al., "Informer: Beyond Efficient Transformer for Long Sequence
Time-Series Forecasting", AAAI 2021 (code: zhouhaoyi/Informer2020, ``ProbAttention``).
Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.3.

Shape glossary: b batch, h heads, n query length, m key length, d head dim, dv value dim,
C clusters, B hash bits, T Lloyd iterations, k top keys, U sampled keys, u active queries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol

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
    register_mechanism,
)
from ..core.masks import call_generator
from ..core.slicing import over_head_groups
from ._kmeans import ClusterDraws, cluster_queries, draw_clustering
from ._maskedsdpa import masked_sdpa
from ._topkeys import TopKeysAttention
from .jat import probsparse_sizes

__all__ = ["ClusterDraws", "cluster_queries", "clustered_attention", "draw_clustering",
           "improved_clustered_attention", "probsparse_attention", "probsparse_keys",
           "probsparse_row_sizes", "probsparse_sizes"]

DRAW_RANGE = 2**31  # probsparse draws r are uniform integers in [0, 2^31)


def _work(*ts: torch.Tensor) -> list[torch.Tensor]:
    """16-bit inputs are computed in fp32."""
    return [t.to(accumulation_dtype(t.dtype)) for t in ts]


def _valid(
    key_mask: torch.Tensor | None, b: int, n: int, m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key validity [b, m], query validity [b, n]); queries are padded only in
    self-attention (n == m) with a key mask, where key_mask marks the padded tokens."""
    kvalid = (torch.ones(b, m, dtype=torch.bool, device=device) if key_mask is None
              else key_mask.to(device=device, dtype=torch.bool))
    qvalid = kvalid if (key_mask is not None and n == m) else torch.ones(
        b, n, dtype=torch.bool, device=device)
    return kvalid, qvalid


def _drop(p: torch.Tensor, dropout: float, training: bool) -> torch.Tensor:
    return F.dropout(p, dropout, training=True) if (training and dropout > 0) else p


def _refuse_causal(name: str, why: str) -> ValueError:
    return ValueError(f"{name} cannot run causally: {why} (caps.causal_ok=False); use it in "
                      "bidirectional encoders only")


# --------------------------------------------------------------- clustered (functional)


def _centroid_queries(q: torch.Tensor, assign: torch.Tensor, clusters: int) -> torch.Tensor:
    """Q_c [b,h,C,d] = mean of the member queries; gradient flows to every member.

    assign [b,h,n] in [0, C]; id C (padded queries) goes to a dropped slot.
    """
    b, h, n, d = q.shape
    sums = q.new_zeros(b, h, clusters + 1, d).scatter_add(
        2, assign[..., None].expand(-1, -1, -1, d), q)  # [b,h,C+1,d]
    counts = q.new_zeros(b, h, clusters + 1).scatter_add(2, assign, q.new_ones(b, h, n))
    return (sums / counts.clamp(min=1.0)[..., None])[:, :, :clusters]  # [b,h,C,d]


def _broadcast(x_c: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """Copy cluster rows x_c [b,h,C,e] to their members [b,h,n,e]; id C (no cluster) -> 0."""
    x = F.pad(x_c, (0, 0, 0, 1))  # [b,h,C+1,e], last row zero
    return x.gather(2, assign[..., None].expand(-1, -1, -1, x.shape[-1]))


def clustered_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, assign: torch.Tensor, *,
    clusters: int, key_mask: torch.Tensor | None = None, scale: float | None = None,
    dropout: float = 0.0, training: bool = False, need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clustered attention for a given assignment; returns (out [b,h,n,dv], weights or None).

    assign [b,h,n] long in [0, C] (C = no cluster: the query outputs zeros).
    Q_c = mean of members; A_c = softmax(Q_c K^T * scale) over the unpadded keys [b,h,C,m];
    V^_c = A_c V; query i gets V^_{c(i)}. weights [b,h,n,m] = A_{c(i)} (pre-dropout).
    Without weights or dropout, A_c V runs on ``masked_sdpa`` (no [b,h,C,m] scores kept).
    """
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    qc = _centroid_queries(q, assign, clusters)  # [b,h,C,d]
    if not need_weights and not (training and dropout > 0):
        # A_c V on torch's fused kernel, the key mask as its mask: no [b,h,C,m] kept
        none = q.new_zeros(1, 1, 1, k.shape[2])  # no bias beyond the key mask
        return _broadcast(masked_sdpa(qc, k, v, none, key_mask, False, scale, 0.0), assign), None
    kvalid, _ = _valid(key_mask, q.shape[0], q.shape[2], k.shape[2], q.device)
    scores = qc @ k.transpose(-1, -2) * scale  # [b,h,C,m]
    probs = masked_softmax(scores, kvalid[:, None, None, :].expand(scores.shape))  # A_c
    out = _broadcast(_drop(probs, dropout, training) @ v, assign)  # [b,h,n,dv]
    return out, (_broadcast(probs, assign) if need_weights else None)


def improved_clustered_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, assign: torch.Tensor, *,
    clusters: int, topk: int, key_mask: torch.Tensor | None = None,
    scale: float | None = None, dropout: float = 0.0, training: bool = False,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """i-clustered attention for a given assignment; returns (out [b,h,n,dv], weights or None).

    T_c = the top-k keys of centroid c by Q_c . k_j (unpadded first); m^_c = sum_{j in T_c}
    A_c[j] its mass there. Query i of cluster c: w_ij = m^_c softmax_{j' in T_c}(q_i . k_j'
    * scale)[j] for j in T_c, w_ij = A_c[j] elsewhere; out_i = sum_j w_ij v_j.
    Memory O(n*k*(d + dv)) for the per-query top-k keys and values, kept for the backward
    only when the weights are returned (else ``_topkeys.TopKeysAttention`` gathers them
    again in the backward).
    """
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    kk = min(topk, m)
    kvalid, _ = _valid(key_mask, b, n, m, q.device)
    allowed = kvalid[:, None, None, :].expand(b, h, clusters, m)  # [b,h,C,m]
    qc = _centroid_queries(q, assign, clusters)  # [b,h,C,d]
    raw = qc @ k.transpose(-1, -2)  # Q_c K^T [b,h,C,m]
    probs = masked_softmax(raw * scale, allowed)  # A_c [b,h,C,m]
    top = raw.detach().masked_fill(~allowed, float("-inf")).topk(kk, dim=-1).indices  # T_c
    in_top = torch.zeros_like(allowed).scatter(-1, top, True)  # [b,h,C,m]
    bottom = probs.masked_fill(in_top, 0.0)  # A_c off the top keys [b,h,C,m]
    mass = (probs * in_top).sum(-1, keepdim=True)  # m^_c [b,h,C,1]
    out_bottom = _broadcast(_drop(bottom, dropout, training) @ v, assign)  # [b,h,n,dv]

    top_i = _broadcast(top, assign)  # T_{c(i)} [b,h,n,k] (key 0 for padded queries)
    flat = top_i.reshape(b, h, n * kk)  # [b,h,n*k]
    ok = kvalid[:, None, :].expand(b, h, m).gather(2, flat).view(b, h, n, kk)  # [b,h,n,k]
    mass_i = _broadcast(mass, assign)  # [b,h,n,1]; 0 if no cluster
    if not need_weights:  # the gathered keys are not kept for the backward (_topkeys)
        keep = None  # drawn as F.dropout draws its mask (so both branches drop alike)
        if training and dropout > 0:
            keep = q.new_empty(b, h, n, kk).bernoulli_(1.0 - dropout).div_(1.0 - dropout)
        out_top = TopKeysAttention.apply(q, k, v, top_i, ok, mass_i, scale, keep)
        return out_top + out_bottom, None
    k_top = k.gather(2, flat[..., None].expand(-1, -1, -1, d)).view(b, h, n, kk, d)
    v_top = v.gather(2, flat[..., None].expand(-1, -1, -1, dv)).view(b, h, n, kk, dv)
    s_top = torch.einsum("bhnd,bhnkd->bhnk", q, k_top) * scale  # [b,h,n,k]
    a_top = masked_softmax(s_top, ok) * mass_i  # [b,h,n,k]
    out_top = torch.einsum("bhnk,bhnke->bhne", _drop(a_top, dropout, training), v_top)
    weights = _broadcast(bottom, assign).scatter_add(-1, top_i, a_top)  # [b,h,n,m]
    return out_top + out_bottom, weights


# ------------------------------------------------------------------------ clustered


def _check_clustering(clusters: int, bits: int, iterations: int) -> None:
    if clusters < 1:
        raise ValueError(f"clusters must be >= 1 (query centroids C per sequence and head), "
                         f"got {clusters}")
    if bits < 1:
        raise ValueError(f"bits must be >= 1 (Hamming-LSH hyperplanes B), got {bits}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1 (Lloyd iterations of k-means; the paper "
                         f"uses 10), got {iterations}")


@dataclass(frozen=True, kw_only=True)
class ClusteredConfig(MechanismConfig):
    name: ClassVar[str] = "clustered"
    clusters: int = 100  # C: query clusters per sequence and head (the paper's clustered-100)
    bits: int = 63  # B: bits of the Hamming-LSH code (random hyperplanes with offsets)
    iterations: int = 10  # Lloyd iterations of k-means in Hamming space (the paper's 10)
    seed: int = 0  # seeds hyperplanes, k-means initialisation, empty-cluster codes (per layer)

    def __post_init__(self) -> None:
        _check_clustering(self.clusters, self.bits, self.iterations)


@dataclass(frozen=True, kw_only=True)
class ImprovedClusteredConfig(MechanismConfig):
    name: ClassVar[str] = "improved_clustered"
    clusters: int = 100  # C: query clusters per sequence and head
    bits: int = 63  # B: bits of the Hamming-LSH code (random hyperplanes with offsets)
    iterations: int = 10  # Lloyd iterations of k-means in Hamming space (the paper's 10)
    topk: int = 32  # k: keys per cluster re-weighted exactly per query (the paper's k = 32)
    seed: int = 0  # seeds hyperplanes, k-means initialisation, empty-cluster codes (per layer)

    def __post_init__(self) -> None:
        _check_clustering(self.clusters, self.bits, self.iterations)
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1 (keys per cluster re-weighted exactly), "
                             f"got {self.topk}")


_CLUSTER_CAUSAL = ("the clusters and centroids are computed from all queries, so future "
                   "queries move the centroid (and top keys) a past query uses")

_CLUSTERED_NOTES = """
    Clustering (official ``cluster_cpu.cpp``): codes bit_i(q) = 1[q . a_i > a_i0] with B
    random hyperplanes (a_i, a_i0) ~ N(0, 1) (``hash_bias=True``); the codes of C distinct
    real queries seed the centroids; T - 1 Lloyd rounds (assign to the nearest centroid in
    Hamming distance, ties to the lowest index; centroid bit = majority of its members, a tie
    is 0; an empty centroid takes a fresh random code), then a final assignment. Clustering is
    per (batch row, head) and takes no gradient; the centroids Q_c = mean of the member
    queries do (gradient flows to every member, as the official ``_GroupQueries``).
    Randomness (hyperplanes, initial centroids, empty-cluster codes): one draw per call,
    shared by the batch rows and heads, seeded by (seed, layer_idx): in training redrawn every
    call through the global RNG (``call_generator``; the official code redraws every forward),
    in eval a fixed draw per (seed, layer_idx, n), so eval is deterministic.
    ``draws(n, layer_idx)`` returns the draw a call would use and ``cluster_queries`` the
    assignment.
    Padding: padded keys get zero weight; padded queries (self-attention, n == m) neither seed,
    join, vote nor count in any cluster (official: query lengths) and output zeros. The eval draw is
    the padded length's, so a padded row clusters unlike its sequence alone.
    Deviations: a row with at most C real queries puts each in its own cluster (the official
    initialisation with every query almost always does; equal codes would merge), so C >= n is
    exactly softmax; initial centroids are C distinct *real* queries (official: positions drawn
    over the padded length); empty clusters draw from the seeded draw (official: an unseeded
    C++ PRNG); codes are 0/1 tensors with a matmul Hamming distance, so B is not capped at 63.
    Not causal (caps.causal_ok=False): {causal}.
    16-bit inputs are computed in fp32. ``need_weights`` returns the effective weights
    [b,h,n,m] (out == weights @ v); dropout ``ctx.dropout`` applies to the centroid
    probabilities (members share one mask) and, i-clustered, to the per-query top-k weights.
"""


class _ClusteringMechanism(Protocol):
    """What the shared clustered helpers read from ``Clustered`` / ``ImprovedClustered``."""

    dims: HeadDims
    training: bool

    @property
    def cfg(self) -> ClusteredConfig | ImprovedClusteredConfig: ...

    def draws(self, n: int, layer_idx: int, head_dim: int | None = None) -> ClusterDraws: ...


def _clustered_forward(
    mech: _ClusteringMechanism, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    ctx: AttnContext, attend: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> AttnOutput:
    """The forward shared by ``clustered`` and ``improved_clustered`` (``attend`` differs)."""
    check_qkv(q, k, v, mech.dims)
    if ctx.causal:
        raise _refuse_causal(mech.cfg.name, _CLUSTER_CAUSAL)
    b, _, n, d = q.shape
    dtype = q.dtype
    qw, kw, vw = _work(q, k, v)
    _, qvalid = _valid(ctx.key_mask, b, n, k.shape[2], q.device)
    cfg = mech.cfg
    draws = mech.draws(n, ctx.layer_idx, d)

    def heads(qw, kw, vw) -> AttnOutput:  # a group of g heads (clustered per head)
        assign = cluster_queries(qw, draws, qvalid, cfg.clusters, cfg.iterations)  # [b,g,n]
        out, probs = attend(qw, kw, vw, assign, key_mask=ctx.key_mask,
                            scale=ctx.scale_for(d), dropout=ctx.dropout,
                            training=mech.training, need_weights=ctx.need_weights)
        return AttnOutput(out, probs)

    # The draws are shared by the heads and every head clusters on its own, so heads can
    # run a few at a time (core/slicing.py): codes [b,n,B], distances [b,n,C] and the
    # centroid maps [b,C,m] per head stay small.
    per_head = b * max(n, k.shape[2]) * max(cfg.clusters, cfg.bits) * 4
    if isinstance(cfg, ImprovedClusteredConfig):  # + the gathered top keys [b,n,k,d]
        per_head = max(per_head, b * n * min(cfg.topk, k.shape[2]) * d * 4)
    # in fp32 under autocast too: bf16 hash projections and centroid scores change the
    # clusters and top keys
    with torch.autocast(q.device.type, enabled=False):
        res = over_head_groups(heads, (qw, kw, vw), per_head)
    out, probs = res.out, res.probs
    return AttnOutput(out.to(dtype), None if probs is None else probs.to(dtype))


def _draws(
    mech: _ClusteringMechanism, n: int, layer_idx: int, head_dim: int | None
) -> ClusterDraws:
    cfg = mech.cfg
    gen = call_generator(cfg.seed, layer_idx, n, mech.training)
    d = mech.dims.head_dim if head_dim is None else head_dim
    return draw_clustering(gen, n, d, cfg.bits, cfg.clusters, cfg.iterations)


@register_mechanism(ClusteredConfig)
class Clustered(nn.Module):
    __doc__ = """Clustered attention: queries grouped by k-means, attention per centroid.

    Paper: Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention",
    NeurIPS 2020 (code: idiap/fast-transformers, ``ClusteredAttention``).
    Formula: cluster the n queries into C groups (k-means on Hamming-LSH codes); Q_c = mean
    of the queries of group c; A_c = softmax(Q_c K^T / sqrt(d)) [C, m]; V^_c = A_c V; every
    query of group c outputs V^_c.
    Complexity O(n*C*B*T + C*m*d) time, O(C*m + n*B) memory.
    """ + _CLUSTERED_NOTES.format(causal=_CLUSTER_CAUSAL)

    example: ClassVar[str] = "clustered(clusters=4, bits=8, iterations=4)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="prototype", paper="Vyas et al. 2020", scope="head", causal_ok=False,
        key_mask_ok=True, exact=False, complexity="O(n*C*B*T + C*m*d)",
    )

    def __init__(self, cfg: ClusteredConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def draws(self, n: int, layer_idx: int, head_dim: int | None = None) -> ClusterDraws:
        """The random draws of a call on n queries in layer ``layer_idx`` (current mode;
        in training each call draws afresh, through the global RNG)."""
        return _draws(self, n, layer_idx, head_dim)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        attend = partial(clustered_attention, clusters=self.cfg.clusters)
        return _clustered_forward(self, q, k, v, ctx, attend)


@register_mechanism(ImprovedClusteredConfig)
class ImprovedClustered(nn.Module):
    __doc__ = """i-clustered attention: clustered attention plus exact top-k re-weighting.

    Paper: Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention",
    NeurIPS 2020, §3.3 (code: idiap/fast-transformers, ``ImprovedClusteredAttention``).
    Formula: clusters, Q_c and A_c as ``clustered``; T_c = the k keys with the largest
    Q_c . k_j; m^_c = sum_{j in T_c} A_c[j]. Query i of cluster c:
    A_ij = m^_c exp(q_i . k_j / sqrt(d)) / sum_{j' in T_c} exp(q_i . k_j' / sqrt(d)), j in T_c;
    A_ij = A_c[j] otherwise; out_i = sum_j A_ij v_j. With C >= n or k >= m it is exactly
    softmax. Complexity O(n*C*B*T + C*m*d + n*k*d) time, O(C*m + n*k*d) memory.
    Gradient: also through m^_c (the official broadcast kernel of m^_c has no backward).
    """ + _CLUSTERED_NOTES.format(causal=_CLUSTER_CAUSAL)

    example: ClassVar[str] = "improved_clustered(clusters=4, bits=8, iterations=4, topk=3)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="prototype", paper="Vyas et al. 2020", scope="head", causal_ok=False,
        key_mask_ok=True, exact=False, complexity="O(n*C*B*T + C*m*d + n*k*d)",
    )

    def __init__(self, cfg: ImprovedClusteredConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def draws(self, n: int, layer_idx: int, head_dim: int | None = None) -> ClusterDraws:
        """The random draws of a call on n queries in layer ``layer_idx`` (current mode;
        in training each call draws afresh, through the global RNG)."""
        return _draws(self, n, layer_idx, head_dim)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        attend = partial(improved_clustered_attention, clusters=self.cfg.clusters,
                         topk=self.cfg.topk)
        return _clustered_forward(self, q, k, v, ctx, attend)


# ------------------------------------------------------------------------ probsparse


def probsparse_keys(draws: torch.Tensor, kvalid: torch.Tensor) -> torch.Tensor:
    """Sampled key indices [b, n, U] from draws r [n, U] (uniform in [0, 2^31)).

    Row b samples among its L_b unpadded keys: the (r * L_b // 2^31)-th unpadded key in
    position order (one draw shared by batch and heads, as the official index_sample). A row
    with no unpadded key gets key 0 (its output is zero anyway).
    """
    b, m = kvalid.shape
    n, num = draws.shape
    real_first = torch.argsort((~kvalid).to(torch.uint8), dim=-1, stable=True)  # [b,m]
    lengths = kvalid.sum(-1)  # L_b [b]
    pos = (draws.to(kvalid.device)[None] * lengths[:, None, None]) // DRAW_RANGE  # [b,n,U]
    return real_first.gather(1, pos.reshape(b, n * num)).view(b, n, num)


def probsparse_row_sizes(lengths: torch.Tensor, factor: int) -> torch.Tensor:
    """``probsparse_sizes`` of each unpadded length L_b [b]: min(c*ceil(ln L_b), L_b) [b]."""
    sizes = [probsparse_sizes(int(n), factor)[0] for n in lengths.tolist()]
    return torch.tensor(sizes, dtype=torch.long, device=lengths.device)


@torch.no_grad()
def sparsity_measure(
    q: torch.Tensor, k: torch.Tensor, keys: torch.Tensor, samples: torch.Tensor | None = None,
    chunk_elems: int = 2**21,
) -> torch.Tensor:
    """M(q_i, K) = max_s q_i . k_s - mean_s q_i . k_s over the sampled keys s [b,h,n].

    q [b,h,n,d], k [b,h,m,d], keys [b,n,U] sampled key indices; samples U_b [b] (long): row b
    uses its first U_b samples (None: all U); U_b = 0 gives M = 0. The paper's Algorithm 1
    (M = max(S) - mean(S) by row; the official code divides the sum by L_K, see ProbSparse).
    Raw scores, no 1/sqrt(d): the ranking is the same. Computed in query
    chunks of at most ``chunk_elems`` gathered key entries (memory O(chunk), no gradient;
    the default, 8 MB in fp32, stays below glibc's mmap ceiling, see core/slicing.py). The
    sampled keys are whole rows of k, copied with ``index_select`` per batch row (the draws
    are shared by the heads): an element-wise ``gather`` of the same rows is ~10x slower.
    """
    b, h, n, d = q.shape
    num = keys.shape[-1]
    if num == 0:  # one key (ln 1 = 0): nothing sampled, every query ranks the same
        return q.new_zeros(b, h, n)
    count = (torch.full((b,), num, dtype=torch.long, device=q.device) if samples is None
             else samples.to(device=q.device).clamp(max=num))  # U_b [b]
    used = (torch.arange(num, device=q.device) < count[:, None])[:, None, None, :]  # [b,1,1,U]
    denom = count.clamp(min=1).to(q.dtype)[:, None, None]  # [b,1,1]
    some = (count > 0)[:, None, None]  # [b,1,1]
    step = max(1, chunk_elems // (b * h * num * d))
    parts = []
    for s0 in range(0, n, step):
        idx = keys[:, s0:s0 + step]  # [b,c,U]
        c = idx.shape[1]
        if b == 1:
            k_s = k.index_select(2, idx.reshape(c * num))  # [1,h,c*U,d]
        else:
            k_s = torch.stack([k[i].index_select(1, idx[i].reshape(c * num))
                               for i in range(b)])  # [b,h,c*U,d]
        k_s = k_s.view(b, h, c, num, d)  # sampled keys [b,h,c,U,d]
        qk = torch.einsum("bhcd,bhcud->bhcu", q[:, :, s0:s0 + step], k_s)  # [b,h,c,U]
        top = qk.masked_fill(~used, float("-inf")).amax(-1)  # [b,h,c]
        mean = qk.masked_fill(~used, 0.0).sum(-1) / denom  # [b,h,c]
        parts.append(torch.where(some, top - mean, torch.zeros_like(mean)))
    return torch.cat(parts, dim=2)  # [b,h,n]


def probsparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, draws: torch.Tensor, *,
    active: int | torch.Tensor, samples: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None, scale: float | None = None, dropout: float = 0.0,
    training: bool = False, need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ProbSparse self-attention (bidirectional) for given draws; (out [b,h,n,dv], weights).

    draws r [n, U] (see ``probsparse_keys``); ``samples`` U_b [b]: row b ranks its queries by
    M over its first U_b samples (None: all U); ``active`` u (an int, or u_b [b] per row):
    the u_b queries of row b with the largest M get softmax(q_i K^T * scale) V over the
    unpadded keys; the others the mean of the unpadded values. Padded queries (n == m with a
    key mask) are never preferred and output zeros.
    weights [b,h,n,m]: the softmax rows, 1/L_b on unpadded keys for lazy rows (pre-dropout).
    """
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    kvalid, qvalid = _valid(key_mask, b, n, m, q.device)
    count = kvalid.sum(-1).clamp(min=1).to(v.dtype)[:, None, None, None]  # L_b [b,1,1,1]
    mean_v = v.masked_fill(~kvalid[:, None, :, None], 0.0).sum(2, keepdim=True) / count
    out = mean_v.expand(b, h, n, dv)  # lazy: mean of V
    lazy_w = (kvalid[:, None, None, :].to(v.dtype) / count).expand(b, h, n, m)
    per_row = torch.as_tensor(active, dtype=torch.long, device=q.device).expand(b)  # u_b [b]
    most = min(active if isinstance(active, int) else int(per_row.max()) if b else 0, n)
    top = torch.zeros(b, h, 0, dtype=torch.long, device=q.device)  # active queries [b,h,u]
    if most > 0:
        keys = probsparse_keys(draws, kvalid)  # [b,n,U]
        meas = sparsity_measure(q, k, keys, samples)  # M [b,h,n]
        meas = meas.masked_fill(~qvalid[:, None, :], float("-inf"))  # padding ranks last
        # the largest M first, ties to the lower position (stable: the same on every device)
        top = meas.sort(dim=-1, descending=True, stable=True).indices[..., :most]  # [b,h,u]
    # rank r of row b is active when r < u_b [b,1,u,1]
    act = (torch.arange(top.shape[-1], device=q.device) < per_row[:, None])[:, None, :, None]
    q_r = q.gather(2, top[..., None].expand(-1, -1, -1, d))  # [b,h,u,d]
    scores = q_r @ k.transpose(-1, -2) * scale  # [b,h,u,m]
    probs = masked_softmax(scores, kvalid[:, None, None, :].expand(scores.shape))  # [b,h,u,m]
    o_r = torch.where(act, _drop(probs, dropout, training) @ v, mean_v)  # [b,h,u,dv]
    out = out.scatter(2, top[..., None].expand(-1, -1, -1, dv), o_r)  # [b,h,n,dv]
    out = out * (keep := qvalid[:, None, :, None])  # padded queries: 0 [b,1,n,1]
    weights = None
    if need_weights:
        p_r = torch.where(act, probs, lazy_w[:, :, :1].expand_as(probs))  # [b,h,u,m]
        weights = lazy_w.scatter(2, top[..., None].expand(-1, -1, -1, m), p_r) * keep
    return out, weights


@dataclass(frozen=True, kw_only=True)
class ProbSparseConfig(MechanismConfig):
    name: ClassVar[str] = "probsparse"
    factor: int = 5  # c: U = c*ceil(ln m) sampled keys, u = c*ceil(ln n) active queries
    seed: int = 0  # seeds the key sampling (per layer; see the class docstring)

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1 (Informer's c in u = c*ceil(ln n); the "
                             f"official default is 5), got {self.factor}")


@register_mechanism(ProbSparseConfig)
class ProbSparse(nn.Module):
    """Informer's ProbSparse self-attention: only the u most "active" queries attend.

    Paper: Zhou, Zhang, Peng, Zhang, Li, Xiong, Zhang, "Informer: Beyond Efficient
    Transformer for Long Sequence Time-Series Forecasting", AAAI 2021 (code:
    zhouhaoyi/Informer2020, ``ProbAttention``).
    Formula (the paper's Algorithm 1): U = min(c*ceil(ln m), m) keys s are sampled per query
    (with replacement, one draw shared by batch and heads); M(q_i, K) = max_s q_i . k_s -
    mean_s q_i . k_s over the U sample scores ("M = max(S) - mean(S) by row"); the
    u = min(c*ceil(ln n), n) queries with the largest M get softmax(q_i K^T / sqrt(d)) V, the
    others ("lazy") the mean of V. ceil(ln .) as the official ``np.ceil(np.log(L))``; sizes
    from ``jat.probsparse_sizes`` (the same rule). Large c (u = n) is exactly softmax.
    Complexity O(n*U*d + u*m*d) time, O(n*U + u*m) memory (the measure runs in query chunks).
    Randomness: training draws afresh every call from (seed, layer_idx) and the global RNG
    (``call_generator``; the official code redraws every call, eval too); eval uses a fixed draw per
    (seed, layer_idx, n), so it is deterministic. ``draws(n, m, layer_idx)`` returns it,
    ``probsparse_keys`` maps it to key indices.
    Padding: a row has its unpadded sequence's sizes (official: no padding): U_b samples (the first
    U_b draws) among its L_b unpadded keys, u_b from its real query count (or n); padded keys get
    zero weight, the lazy mean is over the unpadded values; padded queries rank last and output
    zeros. The eval draws are the padded length's, so a padded row samples unlike its sequence
    alone. Ties in M go to the lower position. ``need_weights``: softmax rows for active queries,
    1/L_b on the unpadded keys for lazy ones (official: 1/L_V), so out == weights @ v.
    Deviations: the official code divides the sample sum by L_K, not U (its authors: sample_k
    "can be used to take the mean", Informer2020 issue #211; equal when U = L_K); dropout
    ``ctx.dropout`` applies to the active rows (the official module never applies its
    dropout); 16-bit inputs are computed in fp32.
    Not causal (caps.causal_ok=False): the official masked form (ProbMask on the active rows,
    cumulative *sum* of V for lazy rows) samples future keys into M and picks the top-u over
    all positions, so a future token can move a past query between the active and lazy sets;
    it is used in Informer's one-shot decoder, not for left-to-right models. Informer's
    encoder distilling (conv + max-pool between layers) is an architecture change, not here.
    This is Informer's query selection, not JAT's ``variant='probsparse'`` (which sparsifies
    its jump graph); the two share ``probsparse_sizes`` only, since the sampling differs
    under padding (JAT samples all positions shared by rows and drops padded samples).
    """

    example: ClassVar[str] = "probsparse(factor=1)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="prototype", paper="Zhou et al. 2021", scope="head", causal_ok=False,
        key_mask_ok=True, exact=False, complexity="O(n*U*d + u*m*d)",
    )

    def __init__(self, cfg: ProbSparseConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def sizes(self, n: int, m: int) -> tuple[int, int]:
        """(U sampled keys per query, u active queries) for n queries and m keys."""
        return probsparse_sizes(m, self.cfg.factor)[0], probsparse_sizes(n, self.cfg.factor)[1]

    def row_sizes(self, b: int, n: int, m: int, key_mask: torch.Tensor | None,
                  device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(U_b, u_b) [b] each: ``sizes`` of each row's unpadded key and query counts."""
        kvalid, qvalid = _valid(key_mask, b, n, m, device or torch.device("cpu"))
        return (probsparse_row_sizes(kvalid.sum(-1), self.cfg.factor),
                probsparse_row_sizes(qvalid.sum(-1), self.cfg.factor))

    def draws(self, n: int, m: int, layer_idx: int) -> torch.Tensor:
        """The draws r [n, U] (uniform in [0, 2^31)) a call would use in the current mode
        (U for the padded length m; a padded row uses its first U_b columns)."""
        num, _ = self.sizes(n, m)
        gen = call_generator(self.cfg.seed, layer_idx, n, self.training)
        return torch.randint(DRAW_RANGE, (n, num), generator=gen)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if ctx.causal:
            raise _refuse_causal(
                "probsparse", "Informer's masked form samples future keys into the measure M "
                "and picks the top-u queries over all positions, so future tokens change "
                "which past queries attend")
        n, m, d = q.shape[2], k.shape[2], q.shape[3]
        dtype = q.dtype
        qw, kw, vw = _work(q, k, v)
        samples, active = (None, self.sizes(n, m)[1]) if ctx.key_mask is None else (
            self.row_sizes(q.shape[0], n, m, ctx.key_mask, q.device))
        # in fp32 under autocast too: a bf16 sparsity measure changes the top-u queries
        with torch.autocast(q.device.type, enabled=False):
            out, probs = probsparse_attention(
                qw, kw, vw, self.draws(n, m, ctx.layer_idx), active=active, samples=samples,
                key_mask=ctx.key_mask, scale=ctx.scale_for(d), dropout=ctx.dropout,
                training=self.training, need_weights=ctx.need_weights,
            )
        return AttnOutput(out.to(dtype), None if probs is None else probs.to(dtype))
