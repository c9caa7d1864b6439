"""Multi-head changes that add a regulariser: head disagreement and guided attention patterns.

Both mechanisms compute plain dense softmax attention (their outputs equal ``softmax``) and
return an auxiliary loss in ``AttnOutput.aux_loss``, already multiplied by the config's
``weight``. The Hugging Face backend sums the aux losses of all layers
(``attnlab.aux_loss(model)``) and the runner adds the sum to the task loss.

Shape glossary: b batch, h heads, n query length, m key length, d head dim, dv value dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    accumulation_dtype,
    check_qkv,
    reference_attention,
    register_mechanism,
    require,
)
from ..core.masks import positions
from ._rowchunks import attend_rows, draws_dropout, in_row_chunks

FAMILY = "heads"
EPS = 1e-12  # floor of the norms in the cosine similarities (all-padding examples -> 0)


def query_rows(key_mask: torch.Tensor | None, n: int, m: int) -> torch.Tensor | None:
    """[b,n] bool, the real query rows: the key mask itself in self-attention (n == m; a
    padded token is a padded query too), else None (every row counts)."""
    if key_mask is None or n != m:
        return None
    return key_mask.to(torch.bool)


def dense_with_probs(q, k, v, ctx: AttnContext, training: bool):
    """Dense softmax attention: (out [b,h,n,dv], probs [b,h,n,m] before dropout)."""
    p = ctx.dropout if training else 0.0
    return reference_attention(q, k, v, key_mask=ctx.key_mask, causal=ctx.causal,
                               scale=ctx.scale_for(q.shape[-1]), dropout=p, training=training)


def _dense_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
                training: bool, first_row: int, num_queries: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense_with_probs`` for query rows first_row .. of num_queries (q [b,h,c,d]: those
    rows): (out [b,h,c,dv], probs [b,h,c,m] before dropout)."""
    scores = (q @ k.transpose(-1, -2)) * ctx.scale_for(q.shape[-1])  # [b,h,c,m]
    return attend_rows(scores, v, ctx, training, first_row, num_queries)


# ----------------------------------------------------------------------------- disagreement

Term = Literal["subspace", "position", "output"]
TERMS: tuple[Term, ...] = ("subspace", "position", "output")


@dataclass(frozen=True, kw_only=True)
class DisagreementConfig(MechanismConfig):
    name: ClassVar[str] = "disagreement"
    terms: tuple[Term, ...] = TERMS  # which of D_subspace, D_position, D_output to use
    weight: float = 1.0  # lambda: weight of the disagreement term in the objective

    def __post_init__(self) -> None:
        require(len(self.terms) > 0, "disagreement needs at least one term; choose from "
                f"{', '.join(TERMS)}, e.g. terms=['output']")
        require(len(set(self.terms)) == len(self.terms), f"disagreement terms repeat: "
                f"{list(self.terms)}; list each of {', '.join(TERMS)} at most once")
        require(self.weight >= 0, f"disagreement weight (lambda) must be >= 0, got "
                f"{self.weight}; a negative weight would reward agreement")


def _mean_cosine(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """1/H^2 sum_{i,j} cos(X^i, X^j) per example, averaged over the batch.

    x [b,h,L,e]: one [L,e] matrix per head; keep [b,L] bool rows that count (None: all).
    The inner product is the Frobenius one of the [L,e] matrices (the paper's X^i . X^j).
    """
    if keep is not None:
        x = x * keep[:, None, :, None].to(x.dtype)  # padded rows -> 0
    flat = x.flatten(2).to(accumulation_dtype(x.dtype))  # [b,h,L*e]
    gram = flat @ flat.transpose(1, 2)  # [b,h,h] Frobenius inner products
    norm = flat.norm(dim=-1).clamp_min(EPS)  # [b,h]
    cos = gram / (norm[:, :, None] * norm[:, None, :])  # [b,h,h]
    return cos.mean(dim=(1, 2)).mean()  # 1/H^2 sum_ij, then the batch mean


@register_mechanism(DisagreementConfig)
class Disagreement(nn.Module):
    """Dense softmax attention plus the disagreement regulariser of its heads.

    Paper: Li, Tu, Yang, Lyu, Zhang, "Multi-Head Attention with Disagreement
    Regularization", EMNLP 2018.
    Objective: maximise L + lambda * D, D the chosen sum of
      D_subspace = -1/H^2 sum_i sum_j  V^i . V^j / (|V^i| |V^j|)   (values of head i, [m,dv])
      D_position = -1/H^2 sum_i sum_j  |A^i (*) A^j|                (probabilities, [n,m])
      D_output   = -1/H^2 sum_i sum_j  O^i . O^j / (|O^i| |O^j|)   (head outputs O = A V)
    so ``aux_loss = weight * (-D)`` is minimised with the task loss. Each term is computed
    per example (padded keys / values / query rows excluded; "." is the Frobenius inner
    product of the matrices, |.| of a matrix the sum of its entries) and averaged over the
    batch. The attention itself is dense softmax (``out`` equals ``softmax``'s). Complexity
    O(n*m) per head, plus O(h^2*(n+m)*d) for the terms.
    Notes: the sums run over all pairs i, j as the paper writes them, so the i = j pairs add
    the constant 1/H to each cosine term and sum_i |A^i (*) A^i| / H^2 to the position term.
    The position term sums over the query rows, so it grows with n (between about n/m and
    n per example) while the cosine terms stay in [-1, 1]: on long inputs a lambda that
    suited NMT sentences can outweigh the task (docs/results.md, ListOps at 512).
    The terms compare the heads this mechanism owns: give it ``heads: all`` for the paper's
    setting (scope "head" also allows a subset). O is the head output after attention
    dropout (what the model uses); A is taken before dropout. Deviation: the paper applies it
    to an NMT Transformer's encoder, decoder and cross attention; here it regularises the
    encoder layers a plan puts it on. Not ``exact`` (its forward must run to give the loss),
    so on a local (sliding-window) layer of a fused host the window is not applied.
    Memory: without ``need_weights`` the rows run in chunks under activation checkpoints
    (``_rowchunks``), each giving its rows' share of D_position, so training keeps no
    [b, h, n, m] tensor.
    """

    example: ClassVar[str] = "disagreement"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Li et al. 2018", scope="head", exact=False,
        complexity="O(n*m)",
    )

    def __init__(self, cfg: DisagreementConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def disagreement_loss(self, v: torch.Tensor, probs: torch.Tensor | None,
                          out: torch.Tensor, key_mask: torch.Tensor | None,
                          position: torch.Tensor | None = None) -> torch.Tensor:
        """-D (unweighted): v [b,h,m,dv], probs [b,h,n,m], out [b,h,n,dv] -> scalar.
        ``position``: the position term per example [b] (sum over the query rows of
        (sum_i A^i)^2 / H^2), given instead of probs by the chunked forward."""
        n, m = out.shape[-2], v.shape[-2]
        rows = query_rows(key_mask, n, m)  # [b,n] or None
        total = out.new_zeros((), dtype=accumulation_dtype(out.dtype))
        for term in self.cfg.terms:
            if term == "subspace":
                total = total + _mean_cosine(v, key_mask)
            elif term == "output":
                total = total + _mean_cosine(out, rows)
            elif position is not None:  # the chunked forward's sums
                total = total + position.mean()
            else:  # position: sum_ij sum_{q,k} A^i A^j = sum_{q,k} (sum_i A^i)^2
                assert probs is not None
                h = probs.shape[1]
                s = probs.to(accumulation_dtype(probs.dtype)).sum(1)  # [b,n,m]; padded keys 0
                if rows is not None:
                    s = s * rows[:, :, None]
                total = total + (s.square().sum(dim=(1, 2)) / h**2).mean()
        return total

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if ctx.need_weights:
            out, probs = dense_with_probs(q, k, v, ctx, self.training)  # [b,h,n,dv], [b,h,n,m]
            aux = self.cfg.weight * self.disagreement_loss(v, probs, out, ctx.key_mask)
            return AttnOutput(out, probs, aux.to(out.dtype))
        # the query rows in checkpointed chunks (_rowchunks): training keeps no [b,h,n,m];
        # each chunk also gives its rows' share of the position term, sum (sum_i A^i)^2 [b]
        n, m = q.shape[-2], k.shape[-2]
        keep = query_rows(ctx.key_mask, n, m)  # [b,n] or None
        position = "position" in self.cfg.terms

        def rows(r0: int, qc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c = qc.shape[-2]
            out, probs = _dense_rows(qc, k, v, ctx, self.training, r0, n)
            if not position:
                return out, out.new_zeros(())
            s = probs.to(accumulation_dtype(probs.dtype)).sum(1)  # [b,c,m]; padded keys 0
            if keep is not None:
                s = s * keep[:, r0:r0 + c, None]
            return out, s.square().sum(dim=(1, 2))  # [b]

        out, pos = in_row_chunks(rows, q, m, dropout=draws_dropout(ctx, self.training))
        h = q.shape[1]
        aux = self.disagreement_loss(v, None, out, ctx.key_mask, position=pos / h**2)
        return AttnOutput(out, None, (self.cfg.weight * aux).to(out.dtype))


# ----------------------------------------------------------------------------- pattern loss

Pattern = Literal["prev", "next", "first", "self", "bow", "none"]
PATTERNS = ("prev", "next", "first", "self", "bow", "none")


@dataclass(frozen=True, kw_only=True)
class PatternLossConfig(MechanismConfig):
    name: ClassVar[str] = "pattern_loss"
    patterns: tuple[Pattern, ...] = ("prev", "next", "first", "bow")  # P^h: head i gets
    # patterns[i % len]: prev/next/first token, self, bag of words (uniform), none (unguided)
    weight: float = 10.0  # alpha: weight of the attention-guidance loss (official scale 10)

    def __post_init__(self) -> None:
        require(len(self.patterns) > 0, "pattern_loss needs at least one pattern; choose "
                f"from {', '.join(PATTERNS)}, e.g. patterns=['prev', 'next']")
        require(self.weight >= 0, f"pattern_loss weight must be >= 0, got {self.weight}")


def pattern_target(pattern: str, allowed: torch.Tensor, first_row: int = 0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Target map P [b,n,m] in ``dtype`` of ``pattern`` where ``allowed`` [b,n,m] bool says
    which keys a query may see: 1 on the pattern's key (prev j = i-1, next j = i+1, first
    j = 0, self j = i; 0 when that key is not allowed), or uniform over the allowed keys
    (bow). The n rows are queries first_row .. first_row + n - 1 (a chunk of rows)."""
    n, m = allowed.shape[-2:]
    i, j = positions(n, m, allowed.device)  # [n,1], [1,m]
    i = i + first_row
    if pattern == "bow":
        a = allowed.to(dtype)
        return a / a.sum(-1, keepdim=True).clamp_min(1.0)
    on = {"prev": j == i - 1, "next": j == i + 1, "first": (j == 0).expand(n, m),
          "self": j == i}[pattern]
    return (on & allowed).to(dtype)


@register_mechanism(PatternLossConfig)
class PatternLoss(nn.Module):
    """Dense softmax attention plus attention guidance: chosen heads are pulled towards
    predefined patterns by an auxiliary loss.

    Paper: Deshpande, Narasimhan, "Guiding Attention for Self-Supervised Learning with
    Transformers", Findings of EMNLP 2020 (official code github ameet-1997/AttentionGuidance).
    Loss: for every pattern p and the heads H_p that follow it,
      L_p = sum_{b, h in H_p} ||A^h_b - P_p,b||_F^2 / (|H_p| * sum_b |Q_b| |K_b|)
    i.e. the official ``MSELoss`` (squared Frobenius distance over the number of entries),
    over the real query rows Q_b and keys K_b only; ``aux_loss = weight * sum_p L_p``.
    Patterns (on positions i query, j key): prev j = i-1, next j = i+1, first j = 0 (the
    [CLS] column), self j = i (the official one_to_one), bow uniform over the keys the query
    may see (bag of words); a row whose pattern key is padding or out of range has an
    all-zero target (as the official next/prev targets' first/last rows). Head i of the
    mechanism's heads gets ``patterns[i % len(patterns)]``; "none" leaves a head unguided.
    The attention is dense softmax (``out`` equals ``softmax``'s). Complexity O(n*m).
    Memory: without ``need_weights`` the rows run in chunks under activation checkpoints
    (``_rowchunks``), each giving its rows' share of the loss: training keeps no
    [b, h, n, m] tensor.
    Deviations: token patterns ([SEP], period) need token ids, which attention mechanisms do
    not receive, so they are not offered; the official code ignores padding and decays the
    weight linearly after 20k steps (no schedule here: set ``weight``); it guides the first
    heads of every layer, here a plan chooses layers and heads. Not ``exact``, so on a local
    (sliding-window) layer of a fused host the window is not applied.
    """

    example: ClassVar[str] = "pattern_loss(patterns=['prev', 'next'])"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Deshpande & Narasimhan 2020", scope="head", exact=False,
        keys_are_tokens=True, complexity="O(n*m)",
    )

    def __init__(self, cfg: PatternLossConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        require(len(cfg.patterns) <= dims.num_heads, f"pattern_loss got {len(cfg.patterns)} "
                f"patterns for {dims.num_heads} heads; give at most one per head (head i "
                "gets patterns[i % len(patterns)])")
        self.head_patterns = tuple(cfg.patterns[i % len(cfg.patterns)]
                                   for i in range(dims.num_heads))

    def guidance_loss(self, probs: torch.Tensor, key_mask: torch.Tensor | None,
                      causal: bool, first_row: int = 0, num_queries: int | None = None
                      ) -> torch.Tensor | None:
        """sum_p L_p (unweighted) from probs [b,h,n,m]; None when no head is guided. For a
        chunk of query rows, probs [b,h,c,m] holds rows first_row .. of ``num_queries``,
        and the result is their share of the sum (the denominators count every row)."""
        b, _, c, m = probs.shape
        n = c if num_queries is None else num_queries
        allowed = torch.ones(b, c, m, dtype=torch.bool, device=probs.device)  # [b,c,m]
        if causal:  # raw positions, as the patterns: key j <= query i
            i, j = positions(c, m, probs.device)
            allowed = allowed & (j <= i + first_row)
        keys = torch.ones(b, m, dtype=torch.bool, device=probs.device)
        if key_mask is not None:
            keys = key_mask.to(torch.bool)
            allowed = allowed & keys[:, None, :]
        rows = query_rows(key_mask, n, m)
        rows = torch.ones(b, n, dtype=torch.bool, device=probs.device) if rows is None else rows
        count = (rows.sum(-1) * keys.sum(-1)).sum().clamp_min(1)  # sum_b |Q_b| |K_b|
        entries = rows[:, first_row:first_row + c, None] & keys[:, None, :]  # [b,c,m] counted
        work = accumulation_dtype(probs.dtype)  # float32 for 16-bit maps, else their dtype
        total = None
        for pat in dict.fromkeys(self.head_patterns):
            if pat == "none":
                continue
            heads = [i for i, p in enumerate(self.head_patterns) if p == pat]
            target = pattern_target(pat, allowed, first_row, work)  # [b,c,m]
            diff = (probs[:, heads].to(work) - target[:, None]) * entries[:, None]  # [b,k,c,m]
            term = diff.square().sum() / (count * len(heads))
            total = term if total is None else total + term
        return total

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        if ctx.need_weights:
            out, probs = dense_with_probs(q, k, v, ctx, self.training)  # [b,h,n,dv], [b,h,n,m]
            loss = self.guidance_loss(probs, ctx.key_mask, ctx.causal)
            aux = None if loss is None else (self.cfg.weight * loss).to(out.dtype)
            return AttnOutput(out, probs, aux)
        # the query rows in checkpointed chunks (_rowchunks): training keeps no [b,h,n,m];
        # each chunk also gives its rows' share of the guidance loss
        n, m = q.shape[-2], k.shape[-2]
        guided = any(p != "none" for p in self.head_patterns)

        def rows(r0: int, qc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, probs = _dense_rows(qc, k, v, ctx, self.training, r0, n)
            loss = self.guidance_loss(probs, ctx.key_mask, ctx.causal, r0, n)
            if loss is None:
                return out, out.new_zeros((), dtype=accumulation_dtype(out.dtype))
            return out, loss

        out, loss = in_row_chunks(rows, q, m, dropout=draws_dropout(ctx, self.training))
        aux = (self.cfg.weight * loss).to(out.dtype) if guided else None
        return AttnOutput(out, None, aux)
