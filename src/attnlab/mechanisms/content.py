"""Content-based sparse attention: keys are grouped by what they contain (hashing), not where.

``lsh``: Reformer's angular-LSH attention with shared query/key vectors.
"""

from __future__ import annotations

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
    check_qkv,
    masked_softmax,
    register_mechanism,
)

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

    scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale  # [b,h,r,nc,C,W]
    is_self = qpos[..., :, None] == kpos[..., None, :]  # [b,h,r,nc,C,W]
    scores = scores.masked_fill(is_self, SELF_SCORE)
    allowed = kvalid[..., None, :].expand(scores.shape)  # [b,h,r,nc,C,W]
    row_any = allowed.any(dim=-1)  # [b,h,r,nc,C]
    s = scores.masked_fill(~allowed, float("-inf")).masked_fill(~row_any[..., None], 0.0)
    z = torch.logsumexp(s, dim=-1)  # log-normaliser per round [b,h,r,nc,C]
    probs = torch.exp(s - z[..., None]) * row_any[..., None]  # [b,h,r,nc,C,W]
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
    Complexity O(n_rounds * n * (C*d + log n)) time, O(n_rounds * n * C) memory.
    Padding: padded tokens hash into an extra last bucket (they never move real tokens) and
    are never attended; a row with no valid key gives zeros.
    Shared QK: the host's keys ``k`` are ignored; the keys are the normalised queries (its
    key projection gets a zero gradient through these heads). Needs n == m.
    Deviations / notes: R is drawn once per (seed, layer) from a seeded generator, in
    training too (the paper resamples per step); rounds are chunked separately (trax / HF
    chunk the concatenation of all rounds, so there the first chunk of round r also sees
    the tail of round r-1; with one round both agree, tested against HF's
    ``LSHSelfAttention``). ``wrap`` (default, as trax/HF): the first chunk looks back at
    the last. No duplicate-pair correction across rounds (nor in trax/HF). 16-bit inputs
    are computed in fp32. Not causal (``causal_ok=False``): masking j > i inside the windows
    (trax/HF decoders) still lets future tokens' hashes choose which past keys share i's
    chunk. ``lsh_attention`` is the functional form taking the rotations explicitly.
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
        work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        out, probs = lsh_attention(
            q.to(work), v.to(work), self.rotations(ctx.layer_idx).to(q.device),
            buckets=self.cfg.buckets, chunk=self.cfg.chunk, key_mask=ctx.key_mask,
            scale=ctx.scale_for(d), wrap=self.cfg.wrap, eps=self.cfg.eps,
            dropout=ctx.dropout, training=self.training, need_weights=ctx.need_weights,
        )
        return AttnOutput(out.to(dtype), None if probs is None else probs.to(dtype))
