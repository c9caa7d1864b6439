"""Jump Self-attention (JAT): attention scores propagated over a graph of jump links.

Zhou et al., "Jump Self-attention: Capturing High-order Statistics in Transformers",
NeurIPS 2022; official code github zhouhaoyi/JAT2022 (``CheckerNet`` and ``get_attn_adj``
in its ``modeling_bert.py``), which this file follows step by step. The exact n^3-free
computation of the adjacency lives in ``_jat_adjacency``.
"""

from __future__ import annotations

import hashlib
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
    check_qkv,
    register_mechanism,
)
from ..core.reference import masked_softmax
from ._jat_adjacency import (
    jump_counts,
    key_length,
    link_census,  # noqa: F401  (public for bench.jat: link sparsity and counter)
    naive_adjacency,
    naive_jump_counts,
    normalized_adjacency,
)
from .dense import Softmax, SoftmaxConfig

AdjacencyMethod = Literal["auto", "enumerate", "compare", "direct", "naive"]


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
    qs, ks = [], []
    qm, km = q, k
    for _ in range(order):
        qm, km = a_hat @ qm, a_hat @ km  # [.., n, d]
        qs.append(qm)
        ks.append(km)
    return torch.cat(qs, -1) @ torch.cat(ks, -1).transpose(-1, -2)  # [.., n, n]


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


def probsparse_generator(seed: int, layer_idx: int, n: int | None = None) -> torch.Generator:
    """CPU generator seeded by the first 63 bits of sha256("jat:{seed}:{layer_idx}:{n}").

    n=None gives the training stream of a layer; an int gives the fixed eval generator.
    """
    text = f"jat:{seed}:{layer_idx}:{'' if n is None else n}".encode()
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
    shared by batch and heads), and J is S with that block replaced. Sampling: training
    draws from a per-layer stream seeded by (seed, layer_idx); eval uses a fresh generator
    seeded by (seed, layer_idx, n), so eval is deterministic (``sample_in_eval=True`` keeps
    drawing from the stream at eval, as the official code does; not deterministic).

    Complexity: the official code materialises B as [b, h, n, n, n]. Here A is exact (the
    same integer counts, tested bit for bit) in O(n^2 log n + min(E, n^3)) time and
    O(n^2) memory, E = number of jump links; J costs O(M n^2 d). Probsparse: O(n^2 d + u^3).
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
    With ``mode='mix'`` and c = 0 the head runs the ``softmax`` mechanism itself, so a
    model with such heads is bit for bit the pretrained one (tested).
    Not causal: A mixes all positions (``causal_ok=False``); needs n == m (self-attention).
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
        self._streams: dict[int, torch.Generator] = {}  # probsparse training streams

    def sample(self, n: int, layer_idx: int) -> torch.Tensor:
        """The probsparse key sample [n, U] this module uses for a call in its current mode."""
        num, _ = probsparse_sizes(n, self.cfg.factor)
        if self.training or self.cfg.sample_in_eval:
            if layer_idx not in self._streams:
                self._streams[layer_idx] = probsparse_generator(self.cfg.seed, layer_idx)
            gen = self._streams[layer_idx]
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
            return Softmax(SoftmaxConfig(), self.dims).train(self.training)(q, k, v, ctx)
        p = ctx.dropout if self.training else 0.0
        valid = None
        if self.cfg.mask_pads and ctx.key_mask is not None:
            valid = ctx.key_mask.to(torch.bool)  # [b, n]
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
