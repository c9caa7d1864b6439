"""Jump Self-attention (JAT): attention scores propagated over a graph of jump links.

Zhou et al., "Jump Self-attention: Capturing High-order Statistics in Transformers",
NeurIPS 2022; official code github zhouhaoyi/JAT2022 (``CheckerNet`` and ``get_attn_adj``
in its ``modeling_bert.py``), which this file follows step by step. The exact n^3-free
computation of the adjacency lives in ``_jat_adjacency``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
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
from ..core.masks import training_generator
from ..core.reference import masked_softmax
from ._jat_adjacency import (
    jump_counts,
    jump_counts_or_none,
    key_length,
    link_census,  # noqa: F401  (public for bench.jat: link sparsity and counter)
    naive_adjacency,
    naive_jump_counts,
    normalized_adjacency,
    normalized_adjacency_coo,
)
from ._rowchunks import attend_rows, in_row_chunks
from .dense import Softmax, SoftmaxConfig

AdjacencyMethod = Literal["auto", "pairs", "enumerate", "compare", "direct", "naive"]

# Scores per group of heads whose adjacency is computed at once (``head_adjacency``).
_GROUP_SCORES = 1 << 22
# A_hat is kept sparse (COO: 28 bytes per nonzero against 4 per dense entry) when at most
# this fraction of it is nonzero, for n >= _SPARSE_MIN_N (shorter heads stay dense).
_SPARSE_FRACTION = 1 / 32
_SPARSE_MIN_N = 256


@dataclass(frozen=True, kw_only=True)
class JATConfig(MechanismConfig):
    name: ClassVar[str] = "jat"
    rho: float = 5.0  # rho: threshold on the jump strength U_k[i, j] (official super_p)
    coef: float = 0.5  # c: weight of J in S~ = (1 - c) S + c J (official ceof)
    order: int = 1  # M: number of propagation hops summed into J (official order)
    sign: bool = False  # zero U_k[i, j] when S[i,k] < 0 and S[j,k] < 0 (official jat_sgn)
    mask_pads: bool = False  # exclude padding keys and rows from A (official: they take part)
    mode: Literal["mix", "replace"] = "mix"  # S~ = (1-c) S + c J, or S~ = J (official otype)
    variant: Literal["dense", "probsparse"] = "dense"  # all queries, or top-u (prob_attn)
    factor: int = 2  # c_I: U = u = min(c_I * ceil(ln n), n) (official/Informer factor)
    sample_in_eval: bool = False  # probsparse: sample at eval too (official) vs fixed seed
    seed: int = 0  # seed of the probsparse key sampling
    adjacency: AdjacencyMethod = "auto"  # how A is computed; "naive" = official n^3 port

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rho) and math.isfinite(self.coef)):
            raise ValueError(f"jat needs finite rho and coef, got rho={self.rho}, c={self.coef}")
        if self.order < 1:
            raise ValueError(f"jat order (hops M) must be >= 1, got {self.order}")
        if self.factor < 1:
            raise ValueError(f"jat factor must be >= 1, got {self.factor}")


# ------------------------------------------------------------------------- building blocks


def jat_adjacency(
    scores: torch.Tensor,
    k: torch.Tensor,
    rho: float,
    sign: bool = False,
    valid: torch.Tensor | None = None,
    method: AdjacencyMethod = "auto",
) -> torch.Tensor:
    """A_hat [..., n, n] (no gradient) from raw scores [..., n, n] and keys k [..., n, d].

    valid [..., n] bool (False = padding, excluded) or None. ``method="naive"`` runs the
    official n^3 code; the others are exact and share one result bit for bit.
    """
    d = k.shape[-1]
    if method == "naive":
        if valid is None and scores.dim() == 4:
            return naive_adjacency(scores, k, rho, sign)
        counts = naive_jump_counts(scores, key_length(k), d, rho, sign, valid)
    else:
        counts = jump_counts(scores, key_length(k), d, rho, sign, valid, method)
    return normalized_adjacency(counts, valid, scores.dtype)


def hops(
    a_hat: torch.Tensor, q: torch.Tensor, k: torch.Tensor, order: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([A Q, A^2 Q, ..., A^M Q], the same of K), each concatenated to [..., n, M*d]:
    J = sum_m (A^m Q)(A^m K)^T is their product. a_hat [..., n, n], q, k [..., n, d]; or
    a_hat a sparse COO [g, n, n] (``head_adjacency``'s sparse form, g = b*h) and q, k
    [b, h, n, d]."""
    shape = q.shape
    if a_hat.is_sparse:  # flatten the heads to the sparse batch
        q, k = q.reshape(-1, *shape[-2:]), k.reshape(-1, *shape[-2:])  # [g, n, d]
    mm = torch.bmm if a_hat.is_sparse else torch.matmul
    qs, ks = [], []
    qm, km = q, k
    for _ in range(order):
        qm, km = mm(a_hat, qm), mm(a_hat, km)  # [.., n, d]
        qs.append(qm)
        ks.append(km)
    qj, kj = torch.cat(qs, -1), torch.cat(ks, -1)
    return qj.view(*shape[:-1], -1), kj.view(*shape[:-1], -1)


def propagate(
    a_hat: torch.Tensor, q: torch.Tensor, k: torch.Tensor, order: int, naive: bool = False
) -> torch.Tensor:
    """J = sum_{m=1..M} Phi_m, Phi_m = A^m Q K^T (A^m)^T; a_hat [..., n, n], q, k [..., n, d].

    Computed as sum_m (A^m Q)(A^m K)^T, one matmul with inner size M*d: O(M n^2 d) instead
    of the official O(M n^3) ((A Q) K^T A^T, then A Phi A^T), same value up to float
    reassociation. ``naive=True`` runs the official order.
    """
    if naive:
        phi = a_hat @ q @ k.transpose(-1, -2) @ a_hat.transpose(-1, -2)  # [.., n, n]
        total = phi
        for _ in range(1, order):
            phi = a_hat @ phi @ a_hat.transpose(-1, -2)
            total = total + phi
        return total
    qj, kj = hops(a_hat, q, k, order)
    return qj @ kj.transpose(-1, -2)  # [.., n, n]


def head_adjacency(
    q: torch.Tensor, k: torch.Tensor, cfg: JATConfig, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """A_hat of S = Q K^T (no gradient), a group of heads at a time: dense [b, h, n, n], or,
    when it has few nonzeros, a sparse COO [b*h, n, n] (the same values).

    q, k [b, h, n, d]; valid [b, n] (mask_pads) or None. Each group's S (about
    ``_GROUP_SCORES`` entries) lives only while its A_hat is computed. A_hat is the diagonal
    plus one entry per linked pair (i, j), and is kept by the hops' products for the
    backward: sparse when at most ``_SPARSE_FRACTION`` of it is nonzero, n >=
    ``_SPARSE_MIN_N`` and q is float32 or float64, else dense. Heads without any link (at
    initialisation, where the scores are small, every head) have A_hat = I exactly (counts
    0, degree 1), which is written as such without the normalisation's passes; with few
    links the sparse A_hat is built from the linked pairs (``normalized_adjacency_coo``,
    the dense values bit for bit).
    Under ``torch.compile`` it runs eagerly, outside the graph (no gradient; group loops,
    data-dependent counts and sparse COO parts): one graph break instead of many.
    """
    if torch.compiler.is_compiling():  # not a decorator: that imports torch._dynamo
        return torch.compiler.disable(head_adjacency)(q, k, cfg, valid)
    b, h, n, d = q.shape
    g = b * h
    qf, kf = q.detach().reshape(g, 1, n, d), k.detach().reshape(g, 1, n, d)
    vf = None if valid is None else valid[:, None, :].expand(b, h, n).reshape(g, 1, n)
    step = max(1, _GROUP_SCORES // (n * n))
    # torch's sparse x dense bmm has no half-precision kernel on the CPU: those stay dense
    sparse = n >= _SPARSE_MIN_N and q.dtype in (torch.float32, torch.float64)
    parts: list[torch.Tensor] = []  # per group: [gc, n, n], dense or COO
    nonzero = 0  # of all parts (counted only when A_hat may be kept sparse)
    with torch.no_grad():
        for g0 in range(0, g, step):
            sl = slice(g0, g0 + step)
            scores = qf[sl] @ kf[sl].transpose(-1, -2)  # S [gc, 1, n, n]
            v_sl = None if vf is None else vf[sl]
            if cfg.adjacency == "naive":
                part = jat_adjacency(scores, kf[sl], cfg.rho, cfg.sign, v_sl, "naive")
            else:
                counts = jump_counts_or_none(scores, key_length(kf[sl]), d, cfg.rho, cfg.sign,
                                             v_sl, cfg.adjacency)
                if counts is None:  # no link in these heads
                    parts.append(_identity(scores.shape[0], n, q.dtype, q.device, sparse))
                    nonzero += scores.shape[0] * n
                    continue
                counts = counts.view(-1, n, n)  # [gc, n, n]
                v_flat = None if v_sl is None else v_sl.reshape(-1, n)
                coo = None if not sparse else normalized_adjacency_coo(
                    counts, v_flat, scores.dtype, _SPARSE_FRACTION * counts.numel())
                if coo is not None:  # few links: built sparse, no dense pass
                    parts.append(coo)
                    nonzero += coo.values().numel()
                    continue
                part = normalized_adjacency(counts, v_flat, scores.dtype)
            part = part.view(-1, n, n)  # [gc, n, n]
            if sparse:
                part_nonzero = int(part.count_nonzero())
                nonzero += part_nonzero
                if part_nonzero <= _SPARSE_FRACTION * part.numel():
                    part = part.to_sparse()
            parts.append(part)
        if not sparse or nonzero > _SPARSE_FRACTION * g * n * n:
            return torch.cat([p.to_dense() for p in parts]).view(b, h, n, n)
        parts = [p if p.is_sparse else p.to_sparse() for p in parts]
        index = torch.cat([p.indices() + torch.tensor([[g0], [0], [0]], device=q.device)
                           for p, g0 in zip(parts, range(0, g, step), strict=True)], 1)
        values = torch.cat([p.values() for p in parts])  # [nnz]
        return torch.sparse_coo_tensor(index, values, (g, n, n),
                                       check_invariants=True).coalesce()  # [g, n, n]


def _identity(heads: int, n: int, dtype: torch.dtype, device: torch.device,
              sparse: bool) -> torch.Tensor:
    """I [heads, n, n], dense or sparse COO."""
    if not sparse:
        return torch.eye(n, dtype=dtype, device=device).expand(heads, n, n)
    diag = torch.arange(n, device=device)
    index = torch.stack([torch.arange(heads, device=device).repeat_interleave(n),
                         diag.repeat(heads), diag.repeat(heads)])  # [3, heads*n]
    ones = torch.ones(heads * n, dtype=dtype, device=device)
    return torch.sparse_coo_tensor(index, ones, (heads, n, n), check_invariants=True).coalesce()


def _mix(scores: torch.Tensor, jump: torch.Tensor, coef: float, mode: str) -> torch.Tensor:
    return jump if mode == "replace" else scores * (1 - coef) + jump * coef


def jat_dense_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scores: torch.Tensor,
    cfg: JATConfig,
    valid: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """S~ [b, h, n, n] from q, k [b, h, n, d] and raw scores S = q k^T (steps 1-6).

    valid [b, n] (mask_pads) or None; ``dropout`` is applied to J (pass 0 at eval).
    """
    if cfg.mode == "mix" and cfg.coef == 0:
        return scores  # (1 - 0) S + 0 J == S: skip the work, stay bit-exact
    vmask = None if valid is None else valid[:, None, :]  # [b, 1, n]
    a_hat = jat_adjacency(scores, k, cfg.rho, cfg.sign, vmask, cfg.adjacency)
    jump = propagate(a_hat, q, k, cfg.order, naive=cfg.adjacency == "naive")
    if dropout > 0:
        jump = F.dropout(jump, dropout, training=True)
    return _mix(scores, jump, cfg.coef, cfg.mode)


# --------------------------------------------------------------------------- probsparse


def probsparse_sizes(n: int, factor: int) -> tuple[int, int]:
    """(U sampled keys per query, u kept queries) = min(factor * ceil(ln n), n) each.

    Both are 0 at n = 1 (ln 1 = 0): the block is empty and S~ keeps S.
    """
    size = min(factor * math.ceil(math.log(n)), n) if n > 0 else 0
    return size, size


def probsparse_generator(seed: int, layer_idx: int, n: int) -> torch.Generator:
    """The fixed eval generator of a layer at length n: CPU, seeded by the first 63 bits of
    sha256("jat:{seed}:{layer_idx}:{n}")."""
    text = f"jat:{seed}:{layer_idx}:{n}".encode()
    value = int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1
    return torch.Generator().manual_seed(value)


def probsparse_sample(n: int, num: int, generator: torch.Generator) -> torch.Tensor:
    """[n, num] int64 key indices drawn with replacement, shared by batch and heads.

    As the official ``_prob_QK``: ``randint(L_K, (L_Q, sample_k))``.
    """
    return torch.randint(n, (n, num), generator=generator)


def jat_probsparse_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scores: torch.Tensor,
    sample: torch.Tensor,
    cfg: JATConfig,
    valid: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """S~ [b, h, n, n] with JAT on the u x u block of the most "active" queries only.

    sample [n, U] key indices (``probsparse_sample``). As the official code (after Informer):
    M(q_i) = max_s q_i.k_s - (1/n) sum_s q_i.k_s over the sampled s; the top-u queries and
    the keys at the same positions form the block; A and Phi are built on it and written
    into a copy of S (J keeps S elsewhere). With ``valid``, padded samples are left out of
    M and padded queries are never preferred to real ones.
    """
    b, h, n, d = q.shape
    num, u = probsparse_sizes(n, cfg.factor)
    if sample.shape != (n, num):
        raise ValueError(f"probsparse sample must be [{n}, {num}], got {tuple(sample.shape)}")
    if cfg.mode == "mix" and cfg.coef == 0:
        return scores
    jump = scores.clone()
    if u > 0:
        sd = scores.detach()
        idx = sample.to(scores.device)
        qk = sd.gather(-1, idx.expand(b, h, n, num))  # [b, h, n, U] sampled q_i . k_s
        if valid is None:
            top_s, sum_s = qk.max(-1).values, qk.sum(-1)
        else:
            ok = valid[:, idx][:, None]  # [b, 1, n, U] sampled key is real
            top_s = qk.masked_fill(~ok, float("-inf")).max(-1).values
            sum_s = qk.masked_fill(~ok, 0.0).sum(-1)
        m_score = top_s - sum_s / n  # [b, h, n]
        if valid is not None:
            m_score = m_score.masked_fill(~valid[:, None, :], float("-inf"))
        top = m_score.topk(u, dim=-1, sorted=False).indices.sort(-1).values  # [b, h, u]
        gather = top[..., None].expand(b, h, u, d)
        q_r, k_r = q.gather(2, gather), k.gather(2, gather)  # [b, h, u, d]
        v_r = None if valid is None else valid[:, None, :].expand(b, h, n).gather(-1, top)
        s_r = q_r @ k_r.transpose(-1, -2)  # [b, h, u, u]
        a_hat = jat_adjacency(s_r, k_r, cfg.rho, cfg.sign, v_r, cfg.adjacency)
        j_r = propagate(a_hat, q_r, k_r, cfg.order, naive=cfg.adjacency == "naive")
        bi = torch.arange(b, device=q.device)[:, None, None, None]
        hi = torch.arange(h, device=q.device)[None, :, None, None]
        jump[bi, hi, top[..., :, None], top[..., None, :]] = j_r
    if dropout > 0:
        jump = F.dropout(jump, dropout, training=True)
    return _mix(scores, jump, cfg.coef, cfg.mode)


# ----------------------------------------------------------------------------- mechanism


@register_mechanism(JATConfig)
class JumpSelfAttention(nn.Module):
    """Jump Self-attention: softmax over scores mixed with their propagation on a jump graph.

    Paper: Haoyi Zhou et al., "Jump Self-attention: Capturing High-order Statistics in
    Transformers", NeurIPS 2022 (code: github zhouhaoyi/JAT2022).

    Per head, with S = Q K^T (raw, no 1/sqrt(d), no mask; biases are inside q and k):
      1. U_k[i, j] = S[i,k] S[j,k] / (d max(||K_k||, 1))  (``sign``: 0 if both are < 0)
      2. B_k = 1[U_k >= rho]
      3. A = (1/n) sum_k B_k, diag(A) = 1; no gradient through A; NaN -> 0
      4. A_hat = D^-1/2 A D^-1/2, D = diag(rowsum A) clamped >= 1e-4
      5. J = Dropout_p(sum_{m=1..M} A_hat^m S (A_hat^m)^T), p = ctx.dropout, training only
      6. S~ = (1 - c) S + c J   (``mode="replace"``: S~ = J)
      7. out = softmax(S~ * ctx.scale_for(d) + mask) (attention dropout) V
    No trainable parameters; c = 0 is exactly softmax attention.

    ``variant="probsparse"`` (official ``prob_attn``, after Informer): steps 1-5 run on the
    u x u block of the top-u queries by M(q) = max_s q.k_s - (1/n) sum_s q.k_s over
    U = min(factor ceil(ln n), n) keys s sampled per query (with replacement, one draw
    shared by batch and heads), and J is S with that block replaced. Sampling: each training
    call draws afresh from a generator seeded by (seed, layer_idx) and the global RNG
    (``core.masks.training_generator``: reproducible from the run's seed, alike under
    gradient checkpointing and on resume); eval uses a generator seeded by (seed,
    layer_idx, n), so eval is deterministic (``sample_in_eval=True`` keeps drawing afresh
    at eval, as the official code does; not deterministic).

    Complexity: the official code materialises B as [b, h, n, n, n]. Here A is exact (the
    same integer counts, tested bit for bit) in O(n^2 + P) time when links are sparse, P
    the pairs of rows that can link through a shared key (bounded exactly by each key's
    extreme scores, no sort), else O(n^2 log n + min(E, n^3)), E = number of jump links;
    O(n^2) memory. A head whose scores cannot reach rho (every head at initialisation) has
    A = I. J costs O(M n^2 d). Probsparse: O(n^2 d + u^3).
    Memory kept for the backward (dense variant, no ``need_weights``): S~ = (1 - c) S + c J
    is the product Q~ K~^T of Q~ = [(1 - c) Q, c A Q, ..., c A^M Q] and
    K~ = [K, A K, ..., A^M K], so step 7 runs as SDPA over Q~, K~ (the flash kernel on the
    CPU) and only A_hat is kept of the [b, h, n, n] tensors: sparse (COO) when at most 1/32
    of it is nonzero, so O(n + E') with E' linked pairs. With dropout on J (training,
    ``ctx.dropout`` > 0) the query rows run in checkpointed chunks instead.
    Off the CPU, ``adjacency="auto"`` counts inputs of n <= 256 with ``direct``: the
    official predicate on all n^3 triples in blocks (few kernels, no host syncs), same counts.

    Deviations from the official code (each a fix or an equivalent reordering):
      * J is computed as sum_m (A^m Q)(A^m K)^T (O(n^2 d)), not (A Q) K^T A^T (O(n^3)).
      * ``mask_pads=True`` (off by default, the official behaviour) leaves padding out of
        A: as keys k, as rows/columns, and from the mean (divided by the real length), so a
        padded sequence gets exactly the A of the unpadded one.
      * probsparse with order > 1: J's block is sum_m Phi_m (the official code writes every
        hop in place into one shared tensor, so its sum double counts the last hop and S).
      * probsparse: the kept queries are sorted (no effect on the values); batch 1 works
        (the official ``.squeeze()`` breaks it); n = 1 gives an empty block.
      * ``mode="replace"`` sets S~ = J of the head itself. The official ``otype=1`` computes
        J from the JAT heads (the even heads 0, 2, ... when at most half are JAT heads) and
        writes it into the last ``use`` heads (``attention_scores[:, oheads:]``), so with
        the default ``oheads=10`` of 12 heads 10 and 11 take J of heads 0 and 2 while heads
        0 and 2 keep S; here a plan puts the head where J is computed and used.
    With ``mode='mix'`` and c = 0 the head runs the ``softmax`` mechanism itself, so a
    model with such heads is bit for bit the pretrained one (tested).
    Not causal: A mixes all positions (``causal_ok=False``); needs n == m (self-attention).
    Padding: with ``mask_pads=False`` (default, official) padding keys enter A and its mean is
    over the padded length, and ``variant="probsparse"`` samples (eval: seeded) for the padded
    length, so a right-padded row differs from its sequence alone; the dense variant with
    ``mask_pads=True`` does not depend on the padding.
    """

    example: ClassVar[str] = "jat(rho=0.3, mask_pads=True)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="jump",
        paper="Zhou et al. 2022",
        scope="head",
        causal_ok=False,
        key_mask_ok=True,
        exact=False,
        keys_are_tokens=True,
        complexity="O(n^2*(M*d + log n) + min(E, n^3)), E = jump links",
    )

    def __init__(self, cfg: JATConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.softmax = Softmax(SoftmaxConfig(), dims)  # no parameters: SDPA of the heads

    def sample(self, n: int, layer_idx: int) -> torch.Tensor:
        """The probsparse key sample [n, U] this module uses for a call in its current mode."""
        num, _ = probsparse_sizes(n, self.cfg.factor)
        if self.training or self.cfg.sample_in_eval:
            gen = training_generator(self.cfg.seed, layer_idx)  # fresh, via the global RNG
        else:
            gen = probsparse_generator(self.cfg.seed, layer_idx, n)
        return probsparse_sample(n, num, gen)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if ctx.causal:
            raise ValueError(
                "jat cannot run causally: its adjacency mixes future positions into every "
                "score (caps.causal_ok=False); use it in bidirectional encoders only"
            )
        b, h, n, d = q.shape
        if k.shape[2] != n:
            raise ValueError(
                f"jat needs self-attention with as many queries as keys, got {n} queries "
                f"and {k.shape[2]} keys; the jump graph links queries through shared keys"
            )
        if self.cfg.mode == "mix" and self.cfg.coef == 0:
            # S~ = S: the very path of plain heads (SDPA), so the model is bit for bit the
            # pretrained one, dropout draws included
            return self.softmax.train(self.training)(q, k, v, ctx)
        p = ctx.dropout if self.training else 0.0
        valid = None
        if self.cfg.mask_pads and ctx.key_mask is not None:
            valid = ctx.key_mask.to(torch.bool)  # [b, n]
        if self.cfg.variant == "dense" and not ctx.need_weights:
            return AttnOutput(self._factored(q, k, v, ctx, valid, p))
        scores = torch.matmul(q, k.transpose(-1, -2))  # S [b, h, n, n]
        if self.cfg.variant == "dense":
            mixed = jat_dense_scores(q, k, scores, self.cfg, valid, p)
        else:
            sample = self.sample(n, ctx.layer_idx)
            mixed = jat_probsparse_scores(q, k, scores, sample, self.cfg, valid, p)
        logits = mixed * ctx.scale_for(d)  # [b, h, n, n]
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).expand(logits.shape)
        if ctx.key_mask is not None:
            allowed = allowed & ctx.key_mask[:, None, None, :].to(torch.bool)
        probs = masked_softmax(logits, allowed & ~torch.isneginf(logits))
        drop = F.dropout(probs, p, training=True) if p > 0 else probs
        out = torch.matmul(drop, v.to(drop.dtype))  # [b, h, n, dv]
        return AttnOutput(out, probs if ctx.need_weights else None)

    def _factored(self, q, k, v, ctx: AttnContext, valid: torch.Tensor | None,
                  p: float) -> torch.Tensor:
        """out [b, h, n, dv] of the dense variant without the [b, h, n, n] scores kept.

        S~ = (1 - c) Q K^T + c sum_m (A^m Q)(A^m K)^T is itself a product Q~ K~^T with
        Q~ = [(1 - c) Q, c A Q, ..., c A^M Q] and K~ = [K, A K, ..., A^M K] (``replace``:
        the hops alone), so step 7 is softmax attention over Q~, K~ at the scale of d:
        SDPA, which keeps no [b, h, n, n] tensor. With dropout on J (training, p > 0) the
        product is not one any more: the query rows then run in checkpointed chunks
        (``_rowchunks``), J's and the probabilities' dropout drawn per chunk. Autograd keeps
        A_hat [b, h, n, n] (the hops' matmuls), q, k, v and the hops.
        """
        d = q.shape[-1]
        a_hat = head_adjacency(q, k, self.cfg, valid)  # [b, h, n, n], no gradient
        qj, kj = hops(a_hat, q, k, self.cfg.order)  # [b, h, n, M*d] each
        coef, scale = self.cfg.coef, ctx.scale_for(d)
        if p == 0:
            if self.cfg.mode == "replace":
                qt, kt = qj, kj
            else:
                qt, kt = torch.cat([q * (1 - coef), qj * coef], -1), torch.cat([k, kj], -1)
            ctx_t = replace(ctx, scale=scale, need_weights=False)
            return self.softmax.train(self.training)(qt, kt, v, ctx_t).out  # [b, h, n, dv]
        n = q.shape[2]

        def rows(r0: int, q_rows: torch.Tensor, qj_rows: torch.Tensor) -> torch.Tensor:
            scores = q_rows @ k.transpose(-1, -2)  # S rows [b, h, c, n]
            jump = F.dropout(qj_rows @ kj.transpose(-1, -2), p, training=True)  # J rows
            mixed = _mix(scores, jump, coef, self.cfg.mode)
            return attend_rows(mixed * scale, v, ctx, self.training, r0, n)[0]

        return in_row_chunks(rows, q, n, dropout=True, row_inputs=(qj,))
