"""Content-based sparse attention: keys are grouped by what they contain (hashing), not where.

``lsh``: Reformer's angular-LSH attention with shared query/key vectors.
``routing``: the Routing Transformer's online k-means routing (balanced top-w clusters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
)
from ..core.slicing import over_head_groups
from ._maskedsdpa import masked_sdpa

# Score given to a token's own key (Reformer's self-mask; as trax and Hugging Face, a
# finite value: a token whose window holds no other valid key attends to itself alone,
# and such a round then weighs ~exp(-1e5) against rounds that found real neighbours).
SELF_SCORE = -1e5


@dataclass(frozen=True, kw_only=True)
class LSHConfig(MechanismConfig):
    name: ClassVar[str] = "lsh"
    buckets: int = 8  # n_buckets: buckets per round; 1 (no hashing) or even (argmax([xR; -xR]))
    chunk: int = 64  # m (paper): chunk length in the sorted order; a chunk sees itself + 1 back
    num_hashes: int = 2  # n_rounds: independent hashing rounds, combined by logsumexp weights
    seed: int = 0  # seeds the random rotations R (one draw per layer: seed, layer_idx)
    wrap: bool = True  # the first chunk looks back at the last one (circular, as trax / HF)
    eps: float = 1e-6  # epsilon of the key length normalisation k = q / sqrt(mean(q^2) + eps)

    def __post_init__(self) -> None:
        if self.buckets < 1 or (self.buckets > 1 and self.buckets % 2):
            raise ValueError(
                f"buckets must be 1 (no hashing) or an even number >= 2, got {self.buckets}: "
                "the paper's angular hash h(x) = argmax([xR; -xR]) yields an even number of "
                "buckets (R has buckets/2 columns)"
            )
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1 (tokens per chunk), got {self.chunk}")
        if self.num_hashes < 1:
            raise ValueError(f"num_hashes must be >= 1 (hashing rounds), got {self.num_hashes}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def lsh_rotations(cfg: LSHConfig, num_heads: int, head_dim: int, layer_idx: int) -> torch.Tensor:
    """Random rotations R [h, d, n_rounds, buckets/2] (fp32, CPU), fixed per (seed, layer).

    The layout of Hugging Face's ``LSHSelfAttention._hash_vectors`` (one R per head and
    round, i.i.d. N(0, 1) entries, as the paper's random projection).
    """
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + layer_idx)
    return torch.randn(num_heads, head_dim, cfg.num_hashes, cfg.buckets // 2, generator=g)


def lsh_buckets(
    qk: torch.Tensor, rotations: torch.Tensor, buckets: int, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """Bucket ids [b, h, r, n]: argmax([xR; -xR]) per round; padded tokens get bucket ``buckets``.

    qk [b, h, n, d]; rotations [h, d, r, buckets/2] (an empty last axis when buckets == 1).
    The extra bucket for padding (as Hugging Face) sorts padding after every real token, so
    padding never changes where real tokens land.
    """
    b, h, n, _ = qk.shape
    r = rotations.shape[2]
    if buckets == 1:
        ids = qk.new_zeros(b, h, r, n, dtype=torch.long)
    else:
        rot = torch.einsum("bmtd,mdhr->bmhtr", qk.detach(), rotations.to(qk))  # [b,h,r,n,nb/2]
        ids = torch.cat([rot, -rot], dim=-1).argmax(dim=-1)  # [b,h,r,n]
    if key_mask is not None:
        ids = torch.where(key_mask[:, None, None, :].to(torch.bool), ids, buckets)
    return ids


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [b, h, n', e], idx [b, h, r, L] -> x[..., idx, :] as [b, h, r, L, e]."""
    r, e = idx.shape[2], x.shape[-1]
    src = x[:, :, None].expand(-1, -1, r, -1, -1)  # [b,h,r,n',e]
    return torch.gather(src, 3, idx[..., None].expand(-1, -1, -1, -1, e))


def _cluster_sdpa(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                  kvalid: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over each cluster's valid keys, times their values, on ``masked_sdpa``
    (clusters as heads): qs [b,h,k,wq,d], ks [b,h,k,wk,d], vs [b,h,k,wk,dv], kvalid
    [b,h,k,wk] -> [b,h,k,wq,dv]; a cluster with no valid key gives 0."""
    b, h, nk, wq, _ = qs.shape
    bias = torch.zeros(kvalid.shape, dtype=qs.dtype, device=qs.device)
    bias = bias.masked_fill(~kvalid, float("-inf")).flatten(0, 1)[:, :, None, :]
    out = masked_sdpa(qs.flatten(0, 1), ks.flatten(0, 1), vs.flatten(0, 1), bias, None,
                      False, scale, 0.0)  # [b*h,k,wq,dv]
    return out.view(b, h, nk, wq, -1)


def lsh_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    rotations: torch.Tensor,
    *,
    buckets: int,
    chunk: int,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    wrap: bool = True,
    eps: float = 1e-6,
    dropout: float = 0.0,
    training: bool = False,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared-QK LSH attention with given rotations; returns (out [b,h,n,dv], probs or None).

    qk [b, h, n, d] shared query/key vectors; v [b, h, n, dv]; rotations [h, d, r, buckets/2]
    (inject any, e.g. Hugging Face's, to reproduce its hashing); key_mask [b, n] True = keep.
    Keys are k_j = qk_j / sqrt(mean(qk_j^2) + eps) (norm ~sqrt(d)), scores qk_i . k_j * scale
    (scale 1/sqrt(d) by default: the same numbers as HF's q . len_norm(k) / sqrt(d)).
    Per round: stable sort by (bucket, position), chunks of C = min(chunk, n) in that order,
    each chunk attends itself and the previous chunk (circular if ``wrap``; itself only when
    there is one chunk). Own key: score SELF_SCORE. Padded keys: never attended.
    Rounds: o_i = sum_r exp(z_r(i) - logsumexp_r' z_r'(i)) o_r(i), z_r(i) the log-normaliser
    of round r. Rows with no valid key give zeros. probs [b, h, n, n] (pre-dropout) on request.
    """
    b, h, n, d = qk.shape
    dv = v.shape[-1]
    r = rotations.shape[2]
    scale = d**-0.5 if scale is None else scale
    c = max(1, min(chunk, n))
    nc = -(-n // c)  # chunks per round
    length = nc * c  # sorted slots per round; slots >= n are empty (index n, never valid)
    dev = qk.device

    ids = lsh_buckets(qk, rotations, buckets, key_mask)  # [b,h,r,n]
    pos = torch.arange(n, device=dev)
    perm = torch.argsort(ids * n + pos, dim=-1)  # [b,h,r,n] slot -> position (stable: unique keys)
    undo = torch.empty_like(perm).scatter_(-1, perm, pos.expand_as(perm))  # position -> slot
    slots = F.pad(perm, (0, length - n), value=n)  # [b,h,r,L]

    keys = qk * torch.rsqrt(qk.square().mean(dim=-1, keepdim=True) + eps)  # [b,h,n,d]
    valid = torch.ones(b, n, dtype=torch.bool, device=dev) if key_mask is None else key_mask
    valid = F.pad(valid.to(torch.bool), (0, 1), value=False)  # [b,n+1]; n = empty slot

    def ext(x: torch.Tensor) -> torch.Tensor:  # [b,h,n,e] -> [b,h,n+1,e] (zero empty row)
        return F.pad(x, (0, 0, 0, 1))

    qs = _gather_rows(ext(qk), slots).view(b, h, r, nc, c, d)  # queries [b,h,r,nc,C,d]
    ks = _gather_rows(ext(keys), slots).view(b, h, r, nc, c, d)  # keys [b,h,r,nc,C,d]
    vs = _gather_rows(ext(v), slots).view(b, h, r, nc, c, dv)  # values [b,h,r,nc,C,dv]
    qpos = slots.view(b, h, r, nc, c)  # [b,h,r,nc,C]
    kvalid = torch.gather(valid[:, None, None, :].expand(b, h, r, n + 1), 3, slots)
    kvalid = kvalid.view(b, h, r, nc, c)  # [b,h,r,nc,C]
    kpos = qpos
    if nc > 1:  # window = previous chunk + own chunk, 2C keys
        prev_valid = kvalid.roll(1, dims=3)
        if not wrap:
            prev_valid = prev_valid.clone()
            prev_valid[:, :, :, 0] = False
        ks = torch.cat([ks.roll(1, dims=3), ks], dim=4)  # [b,h,r,nc,2C,d]
        vs = torch.cat([vs.roll(1, dims=3), vs], dim=4)  # [b,h,r,nc,2C,dv]
        kpos = torch.cat([qpos.roll(1, dims=3), qpos], dim=4)  # [b,h,r,nc,2C]
        kvalid = torch.cat([prev_valid, kvalid], dim=4)  # [b,h,r,nc,2C]

    # the scores are masked in place (the product's backward needs qs and ks, not them)
    s = torch.matmul(qs, ks.transpose(-1, -2)).mul_(scale)  # [b,h,r,nc,C,W]
    is_self = qpos[..., :, None] == kpos[..., None, :]  # [b,h,r,nc,C,W]
    s.masked_fill_(is_self, SELF_SCORE)
    allowed = kvalid[..., None, :].expand(s.shape)  # [b,h,r,nc,C,W]
    row_any = allowed.any(dim=-1)  # [b,h,r,nc,C]
    s.masked_fill_(~allowed, float("-inf")).masked_fill_(~row_any[..., None], 0.0)
    # probs [b,h,r,nc,C,W] (0 in rows with no valid key), z the log-normaliser per round
    probs, z = _SoftmaxLse.apply(s, row_any)
    p = F.dropout(probs, dropout, training=True) if (training and dropout > 0) else probs
    out_r = torch.matmul(p, vs).view(b, h, r, length, dv)[:, :, :, :n]  # sorted [b,h,r,n,dv]
    out_r = torch.gather(out_r, 3, undo[..., None].expand(-1, -1, -1, -1, dv))  # [b,h,r,n,dv]
    z = torch.gather(z.reshape(b, h, r, length)[..., :n], 3, undo)  # [b,h,r,n]
    found = torch.gather(row_any.reshape(b, h, r, length)[..., :n], 3, undo)  # [b,h,r,n]
    w = masked_softmax(z.transpose(2, 3), found.transpose(2, 3))  # round weights [b,h,n,r]
    out = torch.einsum("bhnr,bhrne->bhne", w, out_r)  # [b,h,n,dv]

    dense = None
    if need_weights:  # scatter each round's window probs into [n, n+1] and combine
        cols = kpos[..., None, :].expand(probs.shape).reshape(b, h, r, length, -1)
        pr = probs.new_zeros(b, h, r, length, n + 1)
        pr = pr.scatter_add(4, cols, probs.reshape(b, h, r, length, -1))[:, :, :, :n, :n]
        pr = torch.gather(pr, 3, undo[..., None].expand(-1, -1, -1, -1, n))  # [b,h,r,n,n]
        dense = torch.einsum("bhnr,bhrnm->bhnm", w, pr)  # [b,h,n,m]
    return out, dense


class _SoftmaxLse(torch.autograd.Function):
    """(probs, z) = (exp(s - z) * live, logsumexp(s)) over the last axis, keeping only
    probs for the backward (autograd through logsumexp and exp kept s and exp's output as
    well: three [.., C, W] buffers per round instead of one). s [..., W] (masked keys
    -inf; a row with none allowed filled with 0), live [...] bool (that row has a key).

    Backward: ds = probs * (dprobs - rowsum(dprobs * probs)) + probs * dz; a row that is
    not live gets 0 (its scores are the constant fill, whose gradient is dropped anyway).
    """

    @staticmethod
    def forward(ctx, s: torch.Tensor, live: torch.Tensor):
        z = torch.logsumexp(s, dim=-1)  # [...]
        probs = (s - z[..., None]).exp_().mul_(live[..., None])  # [..., W]
        ctx.save_for_backward(probs)
        return probs, z

    @staticmethod
    def backward(ctx, dprobs, dz):
        (probs,) = ctx.saved_tensors
        ds = torch.zeros_like(probs)
        if dprobs is not None:
            ds = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
        if dz is not None:
            ds = ds.addcmul_(probs, dz[..., None])
        return ds, None


@register_mechanism(LSHConfig)
class LSH(nn.Module):
    """Reformer's LSH attention (angular locality-sensitive hashing, shared QK).

    Paper: Kitaev, Kaiser, Levskaya, "Reformer: The Efficient Transformer", ICLR 2020.
    Formula: shared QK: keys k_j = q_j / ||q_j|| (here q_j / sqrt(mean(q_j^2) + eps), norm
    ~sqrt(d), with the usual 1/sqrt(d) scale: HF's numbers exactly). Hash, per round r with
    a random R_r [d, buckets/2]: h_r(x) = argmax([x R_r; -x R_r]). Sort tokens by
    (h_r, position), cut the order into chunks of C tokens; query i attends the keys of its
    chunk and of the previous chunk, P_r(i): o_r(i) = sum_{j in P_r(i)} exp(s_ij - z_r(i)) v_j,
    z_r(i) = logsumexp_{j in P_r(i)} s_ij, s_ij = q_i . k_j / sqrt(d), and s_ii = -1e5 (a token
    attends itself only when nothing else is there). Rounds: o_i = sum_r
    exp(z_r(i) - logsumexp_r' z_r'(i)) o_r(i).
    Complexity O(n_rounds * n * (C*d + log n)) time, O(n_rounds * n * C) memory. Training
    without ``need_weights`` runs it under a non-reentrant checkpoint (RNG state kept for
    attention dropout): autograd keeps q and v, and the rounds' gathered rows and window
    scores are recomputed in the backward (bench encoder at 4 x 4096: 366 -> 197 MB for a
    step 17-30% longer).
    Padding: padded tokens hash into an extra last bucket (they never move real tokens) and
    are never attended; a row with no valid key gives zeros. With ``wrap`` the first chunk
    looks back at the last chunk of the padded sequence (padding, or a padded row's tail), as
    trax/HF, so a right-padded row differs from its sequence alone there; ``wrap=False``
    does not depend on the padding.
    Shared QK: the host's keys ``k`` are ignored; the keys are the normalised queries (its
    key projection gets a zero gradient through these heads). Needs n == m.
    Deviations / notes: R is drawn once per (seed, layer) from a seeded generator, in
    training too (the paper resamples per step); rounds are chunked separately (trax / HF
    chunk the concatenation of all rounds, so there the first chunk of round r also sees
    the tail of round r-1; with one round both agree, tested against HF's
    ``LSHSelfAttention``). Keys of another bucket inside the window are attended, as in
    trax / HF (the paper's equations mask them, m(j, P_i) = inf for j not in P_i).
    ``wrap`` (default, as trax/HF): the first chunk looks back at the last. No duplicate-pair
    correction across rounds (nor in trax/HF). 16-bit inputs are computed in fp32. Not
    causal (``causal_ok=False``): masking j > i inside the windows (trax/HF decoders) still
    lets future tokens' hashes choose which past keys share i's chunk. ``lsh_attention`` is
    the functional form taking the rotations explicitly.
    """

    example: ClassVar[str] = "lsh(buckets=4, chunk=4, num_hashes=2)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="content", paper="Kitaev et al. 2020", scope="head", causal_ok=False,
        key_mask_ok=True, exact=False, keys_are_tokens=True, shared_qk=True,
        complexity="O(r*n*(C*d + log n))",
    )

    def __init__(self, cfg: LSHConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def rotations(self, layer_idx: int) -> torch.Tensor:
        """R [h, d, n_rounds, buckets/2] of layer ``layer_idx`` (fp32, CPU)."""
        return lsh_rotations(self.cfg, self.dims.num_heads, self.dims.head_dim, layer_idx)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if ctx.causal:
            raise ValueError(
                "lsh cannot run causally: the bucket sort lets future tokens choose which "
                "keys share a query's chunk (caps.causal_ok=False); use it in encoders only"
            )
        n, d = q.shape[2], q.shape[3]
        if v.shape[2] != n:
            raise ValueError(
                f"lsh needs self-attention with as many queries as keys (shared QK: the keys "
                f"are the queries), got {n} queries and {v.shape[2]} keys"
            )
        dtype = q.dtype
        work = accumulation_dtype(dtype)

        def attend(qg, vg, rot):  # a group of heads: [b,g,n,d], [g,d,r,buckets/2]
            return lsh_attention(
                qg.to(work), vg.to(work), rot, buckets=self.cfg.buckets, chunk=self.cfg.chunk,
                key_mask=ctx.key_mask, scale=ctx.scale_for(d), wrap=self.cfg.wrap,
                eps=self.cfg.eps, dropout=ctx.dropout, training=self.training,
                need_weights=ctx.need_weights,
            )

        def heads(qg, vg, rot) -> AttnOutput:
            if torch.is_grad_enabled() and not ctx.need_weights:
                # the rounds' gathered rows and window scores recomputed in the backward
                out = checkpoint(lambda *t: attend(*t)[0], qg, vg, rot, use_reentrant=False,
                                 preserve_rng_state=bool(self.training and ctx.dropout > 0))
                return AttnOutput(out.to(dtype))
            out, probs = attend(qg, vg, rot)
            return AttnOutput(out.to(dtype), None if probs is None else probs.to(dtype))

        # largest intermediate per head: the window scores [b, r, n, 2C] (and keys [.., 2d])
        per_head = 4 * q.shape[0] * self.cfg.num_hashes * n * 2 * max(self.cfg.chunk, d)
        # in fp32 under autocast too: bf16 hash projections move tokens between buckets
        with torch.autocast(q.device.type, enabled=False):
            return over_head_groups(heads, (q, v), per_head,
                                    per_head=(self.rotations(ctx.layer_idx).to(q.device),))


# ------------------------------------------------------------------ routing (online k-means)


@dataclass(frozen=True, kw_only=True)
class RoutingConfig(MechanismConfig):
    name: ClassVar[str] = "routing"
    num_clusters: int = 4  # k: k-means centroids mu_1..mu_k per head (the routes)
    window: int = 0  # w: queries and keys each cluster keeps (top-w by similarity); 0 = ceil(n/k)
    decay: float = 0.999  # lambda: EMA of the centroids, mu <- lambda mu + (1 - lambda) mean
    seed: int = 0  # seeds the initial centroids mu (unit-norm Gaussian draws)
    eps: float = 1e-5  # epsilon of the layer norm of q and k (no scale, no bias)

    def __post_init__(self) -> None:
        if self.num_clusters < 1:
            raise ValueError(
                f"num_clusters must be >= 1 (k-means centroids per head), got {self.num_clusters}"
            )
        if self.window < 0:
            raise ValueError(
                f"window must be >= 0 (tokens kept per cluster; 0 = ceil(n / num_clusters)), "
                f"got {self.window}"
            )
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(
                f"decay must be in [0, 1) (EMA rate of the centroids, e.g. 0.999), got {self.decay}"
            )
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def routing_centroids(cfg: RoutingConfig, num_heads: int, head_dim: int) -> torch.Tensor:
    """Initial centroids mu [h, k, d] (fp32, unit norm) from a generator seeded by cfg.seed."""
    g = torch.Generator().manual_seed(cfg.seed)
    return F.normalize(torch.randn(num_heads, cfg.num_clusters, head_dim, generator=g), dim=-1)


def routing_windows(window: int, num_clusters: int, n: int, m: int) -> tuple[int, int]:
    """(w_q, w_k): members kept per cluster among n queries and m keys (0 = ceil(len / k))."""
    wq = window if window > 0 else -(-n // num_clusters)
    wk = window if window > 0 else -(-m // num_clusters)
    return min(wq, n), min(wk, m)


def routing_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    centroids: torch.Tensor,
    *,
    window: int = 0,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-5,
    dropout: float = 0.0,
    training: bool = False,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Balanced routing attention with given centroids; returns (out [b,h,n,dv], probs or None).

    q [b,h,n,d], k [b,h,m,d], v [b,h,m,dv]; centroids mu [h,k,d] (unit norm); key_mask [b,m].
    q~ = LN(q), k~ = LN(k) (layer norm without scale/bias, norm ~sqrt(d)); routing uses the
    unit vectors q^ = q~/sqrt(d), k^ = k~/sqrt(d): cluster c keeps the top-w_q queries by
    q^_i . mu_c and the top-w_k keys by k^_j . mu_c (padded keys, and padded queries when
    n == m, rank last; with window 0 a padded row keeps w_b = ceil(L_b / k) of each, L_b its
    unpadded length, as its unpadded sequence would). Inside c: p_c(i, j) =
    softmax_j(q~_i . k~_j * scale) over its kept, unpadded keys. A query kept by several
    clusters averages their outputs; a query kept by none gets zeros (and zero probs).
    probs [b,h,n,m] (pre-dropout, averaged likewise).
    """
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    nk = centroids.shape[1]
    scale = d**-0.5 if scale is None else scale
    wq, wk = routing_windows(window, nk, n, m)
    dev = q.device

    qn = F.layer_norm(q, (d,), eps=eps)  # [b,h,n,d], norm ~sqrt(d)
    kn = F.layer_norm(k, (d,), eps=eps)  # [b,h,m,d]
    mu = centroids.to(device=dev, dtype=qn.dtype)  # [h,k,d]
    q_sim = torch.einsum("bhnd,hcd->bhcn", qn.detach(), mu) * d**-0.5  # q^ . mu [b,h,k,n]
    k_sim = torch.einsum("bhmd,hcd->bhcm", kn.detach(), mu) * d**-0.5  # k^ . mu [b,h,k,m]
    valid = torch.ones(b, m, dtype=torch.bool, device=dev) if key_mask is None else (
        key_mask.to(torch.bool))  # [b,m]
    k_sim = k_sim.masked_fill(~valid[:, None, None, :], float("-inf"))
    if key_mask is not None and n == m:  # self-attention: padded queries rank last too
        q_sim = q_sim.masked_fill(~valid[:, None, None, :], float("-inf"))
    qidx = q_sim.topk(wq, dim=-1).indices  # kept queries per cluster, best first [b,h,k,wq]
    kidx = k_sim.topk(wk, dim=-1).indices  # kept keys per cluster, best first [b,h,k,wk]
    q_keep = k_keep = None  # [b,1,1,w]: the ranks a row keeps (window 0 under padding)
    if window == 0 and key_mask is not None:  # w_b = ceil(L_b / k) of each unpadded row
        k_len = valid.sum(-1)  # [b]
        q_len = k_len if n == m else torch.full_like(k_len, n)
        q_keep = (torch.arange(wq, device=dev) < -(-q_len // nk)[:, None])[:, None, None, :]
        k_keep = (torch.arange(wk, device=dev) < -(-k_len // nk)[:, None])[:, None, None, :]

    qs = _gather_rows(qn, qidx)  # [b,h,k,wq,d]
    ks = _gather_rows(kn, kidx)  # [b,h,k,wk,d]
    vs = _gather_rows(v, kidx)  # [b,h,k,wk,dv]
    kvalid = torch.gather(valid[:, None, None, :].expand(b, h, nk, m), 3, kidx)  # [b,h,k,wk]
    if k_keep is not None:
        kvalid = kvalid & k_keep  # keys past the row's window are not kept
    probs = None
    if need_weights or (training and dropout > 0):
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale  # [b,h,k,wq,wk]
        probs = masked_softmax(scores, kvalid[..., None, :].expand(scores.shape))
        p = F.dropout(probs, dropout, training=True) if (training and dropout > 0) else probs
        out_c = torch.matmul(p, vs)  # [b,h,k,wq,dv]
    else:  # the same softmax on torch's fused kernel: no [b,h,k,wq,wk] scores kept
        out_c = _cluster_sdpa(qs, ks, vs, kvalid, scale)  # [b,h,k,wq,dv]

    flat_q = qidx.reshape(b, h, nk * wq)  # [b,h,k*wq]
    kept = out_c.new_ones(b, h, nk, wq)  # [b,h,k,wq]
    if q_keep is not None:  # queries past the row's window are not kept
        kept = kept * q_keep
        out_c = out_c * kept[..., None]
        probs = None if probs is None else probs * kept[..., None]
    count = q.new_zeros(b, h, n, dtype=out_c.dtype).scatter_add(
        2, flat_q, kept.reshape(b, h, nk * wq))  # clusters keeping query i [b,h,n]
    denom = count.clamp(min=1.0)[..., None]  # [b,h,n,1]
    out = out_c.new_zeros(b, h, n, dv).scatter_add(
        2, flat_q[..., None].expand(-1, -1, -1, dv), out_c.reshape(b, h, nk * wq, dv))
    out = out / denom  # [b,h,n,dv]; unrouted queries stay 0

    dense = None
    if need_weights:
        assert probs is not None
        cells = qidx[..., :, None] * m + kidx[..., None, :]  # flat (i, j) [b,h,k,wq,wk]
        dense = probs.new_zeros(b, h, n * m).scatter_add(
            2, cells.reshape(b, h, -1), probs.reshape(b, h, -1)).view(b, h, n, m) / denom
    return out, dense


@register_mechanism(RoutingConfig)
class Routing(nn.Module):
    """Routing Transformer attention: online k-means routes queries to keys by content.

    Paper: Roy, Saffar, Vaswani, Grangier, "Efficient Content-Based Sparse Attention with
    Routing Transformers", TACL 2021.
    Formula: q~ = LN(q), k~ = LN(k) (layer norm, no scale/bias), unit vectors
    q^ = q~ / sqrt(d), k^ = k~ / sqrt(d); per head k centroids mu_c (unit norm, shared by
    queries and keys). Balanced routing (the paper's implementation): cluster c keeps the
    w queries with the largest q^_i . mu_c and the w keys with the largest k^_j . mu_c
    (w = window, or ceil(n / k) when window = 0). Query i in cluster c attends the kept
    keys of c: o_c(i) = sum_j softmax_j(q~_i . k~_j / sqrt(d)) v_j. A query kept by several
    clusters averages its outputs (as lucidrains' routing_transformer, scatter-mean); a query
    kept by none outputs zeros (its residual stream passes unchanged), never NaN.
    Training (train mode only): after the forward, each unpadded q^ and k^ joins its nearest
    centroid (argmax x^ . mu_c), and mu_c <- normalise(lambda mu_c + (1 - lambda) mean of its
    members) (clusters with no member keep mu_c), applied when the backward reaches q (at
    once when q needs no gradient; a forward whose graph is never backpropagated, or that
    runs without gradients, does not step), so gradient checkpointing, reentrant or not,
    neither re-steps nor re-routes (under ``torch.compile`` the step is applied in the
    forward itself, whose graph may then go without a backward); eval mode never
    updates, so it is deterministic. The centroids are a buffer [h, k, d] (saved with
    the model, no gradient), initialised from a generator seeded by ``seed``.
    Complexity O(n*k*d + k*w^2*d) time (+ O(n log n) top-w), O(k*w^2) memory.
    Padding: padded keys rank last in every cluster and are never attended (so are padded
    queries when n == m); with window = 0 a padded row keeps w_b = ceil(L_b / k) per cluster,
    L_b its unpadded length, so its routing is its unpadded sequence's (padding-invariant);
    a row with no valid key gives zeros.
    Deviations / notes: no commitment auxiliary loss (the paper uses EMA only); 16-bit inputs
    are computed in fp32. The official code (google-research routing_transformer) layer-norms
    q after its 1/sqrt(d) scaling, so its logits are LN(q) . LN(k) unscaled, and its EMA keeps
    running counts and sums (VQ-VAE style, unnormalised means); here the host's scale applies
    and the centroids stay unit vectors (lucidrains: raw q, k with 1/sqrt(d)). Not causal
    (``causal_ok=False``): the balanced top-w ranking lets future tokens push past tokens
    out of a cluster. ``routing_attention`` is the functional form taking the centroids
    explicitly.
    """

    example: ClassVar[str] = "routing(num_clusters=3, window=5)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="content", paper="Roy et al. 2021", scope="head", causal_ok=False,
        key_mask_ok=True, exact=False, complexity="O(n*k*d + k*w^2*d)",
    )
    centroids: torch.Tensor

    def __init__(self, cfg: RoutingConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.register_buffer("centroids", routing_centroids(cfg, dims.num_heads, dims.head_dim))

    @torch.no_grad()
    def next_centroids(
        self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The centroids [h,k,d] after one online k-means (EMA) step on q [b,h,n,d],
        k [b,h,m,d] (padded tokens skipped); the buffer is left as it is."""
        b, h, n, d = q.shape
        m = k.shape[2]
        x = torch.cat([F.layer_norm(q, (d,), eps=self.cfg.eps),
                       F.layer_norm(k, (d,), eps=self.cfg.eps)], dim=2) * d**-0.5  # [b,h,n+m,d]
        ones_q = torch.ones(b, n, dtype=torch.bool, device=q.device)
        kvalid = ones_q.new_ones(b, m) if key_mask is None else key_mask.to(torch.bool)
        qvalid = kvalid if (key_mask is not None and n == m) else ones_q
        valid = torch.cat([qvalid, kvalid], dim=1)  # [b,n+m]
        mu = self.centroids.to(x)  # [h,k,d]
        assign = torch.einsum("bhtd,hcd->bhtc", x, mu).argmax(dim=-1)  # nearest [b,h,n+m]
        onehot = F.one_hot(assign, mu.shape[1]).to(x) * valid[:, None, :, None]  # [b,h,t,k]
        sums = torch.einsum("bhtc,bhtd->hcd", onehot, x)  # [h,k,d]
        counts = onehot.sum(dim=(0, 2))  # [h,k]
        mean = sums / counts.clamp(min=1.0)[..., None]
        new = F.normalize(self.cfg.decay * mu + (1.0 - self.cfg.decay) * mean, dim=-1)
        return torch.where(counts[..., None] > 0, new, mu).to(self.centroids.dtype)

    def _schedule_update(self, q: torch.Tensor, new: torch.Tensor) -> None:
        """Step the centroids to ``new`` once per training step: when the backward reaches
        q (a hook on q; no step if the graph is never backpropagated), or now when q needs
        no gradient. So gradient checkpointing, which
        recomputes the forward before the backward reaches q, routes the recomputation by
        the centroids the forward used and computes the same ``new`` there without
        applying it a second time (a hook on a recomputed tensor never fires). A forward
        without gradients (``torch.no_grad`` in train mode, reentrant checkpointing's first
        forward) has no backward and does not step: reentrant checkpointing steps once, in
        its recomputation, which routes by the centroids its first forward used."""
        if not torch.is_grad_enabled():
            return
        if not q.requires_grad or torch.compiler.is_compiling():
            # compiled: at once (a hook registered inside a compiled training forward lost
            # the model's loss from its output in torch 2.13)
            self.centroids.copy_(new)
            return

        def step(_grad: torch.Tensor) -> None:
            with torch.no_grad():
                self.centroids.copy_(new)

        q.register_hook(step)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if ctx.causal:
            raise ValueError(
                "routing cannot run causally: the balanced top-w cluster ranking lets future "
                "tokens push past tokens out of a cluster (caps.causal_ok=False); use it in "
                "encoders only"
            )
        d = q.shape[3]
        dtype = q.dtype
        work = accumulation_dtype(dtype)
        qw, kw, vw = q.to(work), k.to(work), v.to(work)
        # in fp32 under autocast too: bf16 similarities change the top-w routes
        with torch.autocast(q.device.type, enabled=False):
            out, probs = routing_attention(
                qw, kw, vw, self.centroids.to(work), window=self.cfg.window,
                key_mask=ctx.key_mask, scale=ctx.scale_for(d), eps=self.cfg.eps,
                dropout=ctx.dropout, training=self.training, need_weights=ctx.need_weights,
            )
            if self.training:
                self._schedule_update(q, self.next_centroids(qw, kw, ctx.key_mask))
        return AttnOutput(out.to(dtype), None if probs is None else probs.to(dtype))
