"""Structured sparse attention: axial (grid) and BP-Transformer (binary-partition tree).

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §3.1.1 (extended
sparse attention). 0-based positions, query i, key j; both mechanisms read keys as tokens
of the query sequence (``keys_are_tokens``).

* ``axial``: tokens laid out row-major on a ``rows x cols`` grid. Mode "union" is exact
  softmax over (same row OR same column) and exposes ``bias(n, m)``; mode "two_pass" is the
  paper's row pass then column pass and has its own naive reference
  (:func:`axial_two_pass_reference`).
* ``bp_tree``: token neighbours plus mean-pooled span nodes of a binary tree, O(n log n)
  keys in all; exact softmax over that token+span key set, with a naive dense reference
  (:func:`bp_tree_reference`).
"""

from __future__ import annotations

import dataclasses
import functools
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
    masked_softmax,
    pattern_bias,
    reference_attention,
    register_mechanism,
    require,
)
from ..core.masks import positions
from ..core.slicing import over_head_groups
from ._gathered import gathered_attention

# family "sparse": the survey files both under extended sparse attention (§3.1.1); this file
# only splits them off sparse.py for length
FAMILY = "sparse"


def _dropout(probs: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(probs, p, training=True) if p > 0 else probs


# ------------------------------------------------------------------------------------ axial


def axial_pattern(n: int, m: int, cols: int, device=None) -> torch.Tensor:
    """[n, m] bool: same row (i // c == j // c) or same column (i % c == j % c)."""
    i, j = positions(n, m, device)
    return (i // cols == j // cols) | (i % cols == j % cols)


def _grid(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[b,h,n,d] -> [b,h,R,C,d], zero-padding the last row virtually (n <= R*C)."""
    b, h, n, d = x.shape
    return F.pad(x, (0, 0, 0, rows * cols - n)).view(b, h, rows, cols, d)


def _grid_keep(key_mask: torch.Tensor | None, b: int, n: int, rows: int, cols: int,
               device: torch.device) -> torch.Tensor:
    """[b,1,R,C] bool: real, unpadded keys (virtual cells of the last row are False)."""
    keep = torch.ones(b, n, dtype=torch.bool, device=device) if key_mask is None else (
        key_mask.to(device=device, dtype=torch.bool))
    return F.pad(keep, (0, rows * cols - n), value=False).view(b, 1, rows, cols)


def axial_two_pass_reference(q, k, v, cols: int, key_mask=None, causal: bool = False,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive two-pass axial attention with dense n x n matrices (n == m).

    P_row = softmax over the row pattern, P_col = softmax over the column pattern (each
    with the key mask and, if causal, j <= i); y = P_row v; out = P_col y = (P_col P_row) v.
    Returns (out [b,h,n,dv], effective probs P_col @ P_row [b,h,n,n]).
    """
    n = q.shape[2]
    i, j = positions(n, n, q.device)
    row = pattern_bias(i // cols == j // cols)[None]  # [1,n,n]
    col = pattern_bias(i % cols == j % cols)[None]  # [1,n,n]
    y, p_row = reference_attention(q, k, v, bias=row, key_mask=key_mask, causal=causal,
                                   scale=scale)
    out, p_col = reference_attention(q, k, y, bias=col, key_mask=key_mask, causal=causal,
                                     scale=scale)
    return out, p_col @ p_row


@dataclass(frozen=True, kw_only=True)
class AxialConfig(MechanismConfig):
    name: ClassVar[str] = "axial"
    cols: int = 16  # c: grid width; token i sits at row i // c, column i % c (row-major)
    mode: Literal["two_pass", "union"] = "union"  # two_pass: row then column; union: one pass
    strict: bool = False  # raise when n % c != 0 instead of padding the last row virtually

    def __post_init__(self) -> None:
        require(self.cols >= 1, f"axial cols must be >= 1 (the grid width c), got {self.cols}; "
                "use e.g. cols=16, or the image width for row-major pixels")
        require(self.mode in ("two_pass", "union"),
                f"axial mode must be 'two_pass' or 'union', got {self.mode!r}")


@register_mechanism(AxialConfig)
class Axial(nn.Module):
    """Axial attention over a row-major rows x cols grid of the sequence.

    Paper: Ho, Kalchbrenner, Weissenborn, Salimans, "Axial Attention in Multidimensional
    Transformers", arXiv 2019. Token i sits at (r_i, c_i) = (i // c, i % c), R = ceil(n / c).
    * mode "union" (default; exact): softmax(q_i k_j / sqrt(d)) over
      {j : r_j = r_i or c_j = c_i} (i itself counted once) -- ``bias(n, m)``.
    * mode "two_pass" (the paper's pair of axial layers, here sharing q, k):
      y_i = sum_{j: r_j = r_i} softmax_j(q_i k_j) v_j, then
      out_i = sum_{j: c_j = c_i} softmax_j(q_i k_j) y_j, i.e. out = (P_col P_row) v; every
      token reaches every other in two hops. Not softmax over one pattern: its caps on the
      instance say exact=False, and ``axial_two_pass_reference`` is its oracle.
    Complexity O(n*(R+c)*d) (sqrt(n) keys per query when R ~ c).
    Lengths: when n is not a multiple of c, the last row is padded virtually with masked
    keys (so "union" stays exact softmax over ``bias``); ``strict=True`` raises instead.
    Causal: additionally j <= i in each pass (no leak; two_pass then never reaches past keys
    in later columns of earlier rows -- the paper shifts rows for that). n != m: "union"
    reads raw positions (dense masked path), "two_pass" refuses. Class caps describe the
    default mode "union"; ``need_weights`` gives the dense (effective) probabilities.
    """

    example: ClassVar[str] = "axial(cols=4)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Ho et al. 2019", exact=True, keys_are_tokens=True,
        complexity="O(n*(n/c+c))",
    )

    def __init__(self, cfg: AxialConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        if cfg.mode == "two_pass":
            # per-instance refinement: not softmax over one pattern, so the windowed/fused
            # path (hf.fused.windowable reads mech.caps) must not treat it as one
            vars(self)["caps"] = dataclasses.replace(type(self).caps, exact=False)

    def bias(self, n: int, m: int) -> torch.Tensor:
        """[1, n, m] additive bias (0 / -inf) of the union pattern (mode "union")."""
        return pattern_bias(axial_pattern(n, m, self.cfg.cols))[None]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        c = self.cfg
        n, m = q.shape[2], k.shape[2]
        if c.strict and (n % c.cols or m % c.cols):
            raise ValueError(
                f"axial(strict=True): length {n} (keys {m}) is not a multiple of cols="
                f"{c.cols}; pad the input to a multiple of {c.cols}, choose cols dividing it, "
                "or set strict=False to pad the last row virtually with masked keys"
            )
        scale = ctx.scale_for(q.shape[-1])
        p = ctx.dropout if self.training else 0.0
        if c.mode == "two_pass":
            require(n == m, f"axial two_pass needs as many keys as queries, got n={n}, m={m}")
            if ctx.need_weights:
                out, probs = axial_two_pass_reference(q, k, v, c.cols, ctx.key_mask,
                                                      ctx.causal, scale)
                return AttnOutput(out, probs)
            return AttnOutput(self._two_pass(q, k, v, ctx, scale, p))
        if ctx.need_weights or n != m:
            bias = self.bias(n, m).to(q.device)  # [1,n,m]
            if ctx.causal:
                i, j = positions(n, m, q.device)
                bias = bias.masked_fill(j > i, float("-inf"))  # raw positions, as sparse.py
            out, probs = reference_attention(q, k, v, bias=bias, key_mask=ctx.key_mask,
                                             scale=scale, dropout=p, training=self.training)
            return AttnOutput(out, probs if ctx.need_weights else None)
        return AttnOutput(self._union(q, k, v, ctx, scale, p))

    def _axes(self, q, k, ctx: AttnContext):
        """Row and column scores plus their allowed masks on the grid."""
        b, _, n, _ = q.shape
        cols = self.cfg.cols
        rows = -(-n // cols)
        qg, kg = _grid(q, rows, cols), _grid(k, rows, cols)  # [b,h,R,C,d]
        keep = _grid_keep(ctx.key_mask, b, n, rows, cols, q.device)  # [b,1,R,C]
        s_row = qg @ kg.transpose(-1, -2)  # [b,h,R,C,C']  key (r, c')
        s_col = qg.transpose(2, 3) @ kg.transpose(2, 3).transpose(-1, -2)  # [b,h,C,R,R']
        a_row = keep[:, :, :, None, :].expand(s_row.shape)  # key (r, c') kept
        a_col = keep.transpose(2, 3)[:, :, :, None, :].expand(s_col.shape)  # key (r', c)
        if ctx.causal:
            ar = torch.arange(cols, device=q.device)
            a_row = a_row & (ar[None, :] <= ar[:, None])  # c' <= c
            ac = torch.arange(rows, device=q.device)
            a_col = a_col & (ac[None, :] <= ac[:, None])  # r' <= r
        return rows, s_row, a_row, s_col, a_col

    def _two_pass(self, q, k, v, ctx, scale: float, p: float) -> torch.Tensor:
        n, cols = q.shape[2], self.cfg.cols
        rows, s_row, a_row, s_col, a_col = self._axes(q, k, ctx)
        p_row = _dropout(masked_softmax(s_row * scale, a_row), p)  # [b,h,R,C,C']
        y = p_row @ _grid(v, rows, cols)  # [b,h,R,C,dv]
        p_col = _dropout(masked_softmax(s_col * scale, a_col), p)  # [b,h,C,R,R']
        out = (p_col @ y.transpose(2, 3)).transpose(2, 3)  # [b,h,R,C,dv]
        return out.reshape(*out.shape[:2], rows * cols, -1)[:, :, :n]  # [b,h,n,dv]

    def _union(self, q, k, v, ctx, scale: float, p: float) -> torch.Tensor:
        n, cols = q.shape[2], self.cfg.cols
        rows, s_row, a_row, s_col, a_col = self._axes(q, k, ctx)
        ar = torch.arange(rows, device=q.device)
        a_col = a_col & (ar[None, :] != ar[:, None])  # i itself is already in its row
        s_col, a_col = s_col.transpose(2, 3), a_col.transpose(2, 3)  # [b,h,R,C,R']
        probs = masked_softmax(torch.cat([s_row, s_col], -1) * scale,
                               torch.cat([a_row, a_col], -1))  # [b,h,R,C,C'+R']
        probs = _dropout(probs, p)
        vg = _grid(v, rows, cols)  # [b,h,R,C,dv]
        out = probs[..., :cols] @ vg  # row keys, [b,h,R,C,dv]
        p_col = probs[..., cols:].transpose(2, 3)  # [b,h,C,R,R']
        out = out + (p_col @ vg.transpose(2, 3)).transpose(2, 3)  # column keys
        return out.reshape(*out.shape[:2], rows * cols, -1)[:, :, :n]  # [b,h,n,dv]


# ---------------------------------------------------------------------------------- bp_tree


def bp_tree_levels(n: int) -> int:
    """Number of span levels l = 1..L-1 with nodes smaller than the whole sequence."""
    return max(0, math.ceil(math.log2(max(n, 1))) - 1)


@functools.lru_cache(maxsize=64)
def bp_tree_index(n: int, window: int, k: int, causal: bool) -> tuple[torch.Tensor, ...]:
    """Key sets of every query, vectorised over i (CPU tensors, cached by arguments).

    Returns (tok [n,T] token positions, spans [n,S] flat node ids, offsets [L+1]); -1 = no
    key. Flat node id of node (level l, index a) is offsets[l-1] + a; node (l, a) covers
    positions [a*2^l, (a+1)*2^l) cut to [0, n). See :class:`BPTree` for the construction.
    """
    i = torch.arange(n)
    levels = bp_tree_levels(n)
    toks = [i + d for d in range(-window, window + 1) if not (causal and d > 0)]
    hi, lo = i + window + 1, i - window  # right frontier (first uncovered), left (last covered)
    # alignment tokens, so the level-1 nodes start on node boundaries
    if not causal:
        toks.append(torch.where(hi % 2 == 1, hi, -1))
        hi = hi + hi % 2
    toks.append(torch.where(lo % 2 == 1, lo - 1, -1))
    lo = lo - lo % 2
    tok = torch.stack(toks, 1)  # [n,T]
    tok = tok.masked_fill((tok < 0) | (tok >= n), -1)
    spans, offsets = [], [0]
    for lvl in range(1, levels + 1):
        s, count = 2**lvl, -(-n // 2**lvl)
        nodes = []
        for side in (("left",) if causal else ("left", "right")):
            if side == "right":  # right: k nodes from the frontier, + 1 to align to level l+1
                a = hi // s
                nodes += [a + t for t in range(k)]
                nodes.append(torch.where((a + k) % 2 == 1, a + k, -1))
                hi = (a + k + (a + k) % 2) * s
            else:  # left: k nodes ending at the frontier, + 1 to align to level l+1
                a = lo // s  # first node not taken yet lies at a - 1
                nodes += [a - 1 - t for t in range(k)]
                nodes.append(torch.where((a - k) % 2 == 1, a - k - 1, -1))
                lo = (a - k - (a - k) % 2) * s
        idx = torch.stack(nodes, 1)  # [n, k+1 | 2(k+1)]
        bad = (idx < 0) | (idx >= count)
        spans.append((idx + offsets[-1]).masked_fill(bad, -1))
        offsets.append(offsets[-1] + count)
    span = torch.cat(spans, 1) if spans else torch.full((n, 0), -1, dtype=torch.long)
    return tok, span, torch.tensor(offsets)


def bp_tree_nodes(x: torch.Tensor, keep: torch.Tensor, levels: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked means of x [b,h,n,d] over every span node of levels 1..L.

    keep [b,n] bool (padded tokens do not enter a mean). Returns (means [b,h,N,d], valid
    [b,N] bool: the span holds at least one kept token; fully padded spans get zeros).
    """
    b, h, n, d = x.shape
    cnt = keep.to(x.dtype)  # [b,n]
    tot = x if bool(keep.all()) else x * cnt[:, None, :, None]  # [b,h,n,d]
    means, valid = [], []
    for _ in range(levels):  # level l from level l-1: sums of node pairs (O(n*d) in all)
        if tot.shape[2] % 2:
            tot, cnt = F.pad(tot, (0, 0, 0, 1)), F.pad(cnt, (0, 1))
        tot = tot.unflatten(2, (-1, 2)).sum(3)  # [b,h,n/2^l,d]
        cnt = cnt.unflatten(1, (-1, 2)).sum(2)  # [b,n/2^l] kept tokens per node
        means.append(tot / cnt.clamp(min=1)[:, None, :, None])
        valid.append(cnt > 0)
    if not means:
        return x.new_zeros(b, h, 0, d), keep.new_zeros(b, 0)
    return torch.cat(means, 2), torch.cat(valid, 1)


def _pool_matrix(n: int, offsets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[b, N, n]: row = weights of the masked mean of one span node over the tokens."""
    rows = []
    for lvl in range(1, len(offsets)):
        s = 2**lvl
        member = torch.arange(int(offsets[lvl] - offsets[lvl - 1]))[:, None] == (
            torch.arange(n)[None, :] // s)  # [count, n]
        rows.append(member)
    if not rows:
        return keep.new_zeros(keep.shape[0], 0, n, dtype=torch.float32)
    mem = torch.cat(rows, 0).to(keep.device)[None] & keep[:, None, :]  # [b,N,n]
    mem = mem.float()
    return mem / mem.sum(-1, keepdim=True).clamp(min=1)


def bp_tree_reference(q, k, v, window: int, spans: int, key_mask=None, causal: bool = False,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive BP-Transformer attention: explicit key sets, then dense masked softmax.

    The key sets are built by walking each query's frontiers in plain Python (independent of
    :func:`bp_tree_index`); keys = [tokens (n) ; span nodes (N)] with span node = masked mean
    of k and v; one ``reference_attention`` over [n, n+N] with the pattern as bias. Returns
    (out [b,h,n,dv], effective token probabilities [b,h,n,n], out = probs @ v).
    """
    b, h, n, d = q.shape
    keep = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask.bool()
    levels = bp_tree_levels(n)
    offsets = [0]
    for lvl in range(1, levels + 1):
        offsets.append(offsets[-1] + -(-n // 2**lvl))
    allowed = torch.zeros(n, n + offsets[-1], dtype=torch.bool)
    for i in range(n):
        for j in range(max(0, i - window), min(n, i + (0 if causal else window) + 1)):
            allowed[i, j] = True
        hi, lo = i + window + 1, i - window
        if not causal and hi % 2 and hi < n:
            allowed[i, hi] = True  # alignment token on the right
        hi += hi % 2
        if lo % 2 and lo - 1 >= 0:
            allowed[i, lo - 1] = True  # alignment token on the left
        lo -= lo % 2
        for lvl in range(1, levels + 1):
            s, count = 2**lvl, offsets[lvl] - offsets[lvl - 1]
            take = []
            if not causal:
                a = hi // s
                take += list(range(a, a + spans))
                if (a + spans) % 2:
                    take.append(a + spans)
                hi = (a + spans + (a + spans) % 2) * s
            a = lo // s
            take += list(range(a - spans, a))
            if (a - spans) % 2:
                take.append(a - spans - 1)
            lo = (a - spans - (a - spans) % 2) * s
            for t in take:
                if 0 <= t < count:
                    allowed[i, n + offsets[lvl - 1] + t] = True
    km, valid = bp_tree_nodes(k, keep, levels)
    vm, _ = bp_tree_nodes(v, keep, levels)
    keys, vals = torch.cat([k, km], 2), torch.cat([v, vm], 2)  # [b,h,n+N,d]
    out, probs = reference_attention(q, keys, vals, bias=pattern_bias(allowed)[None],
                                     key_mask=torch.cat([keep, valid], 1), scale=scale)
    pool = _pool_matrix(n, torch.tensor(offsets), keep).to(probs.dtype)  # [b,N,n]
    eff = probs[..., :n] + probs[..., n:] @ pool[:, None]  # [b,h,n,n]
    return out, eff


@dataclass(frozen=True, kw_only=True)
class BPTreeConfig(MechanismConfig):
    name: ClassVar[str] = "bp_tree"
    window: int = 3  # w: token neighbours per side at level 0, |i - j| <= w
    k: int = 2  # k: span nodes per side at each tree level (+1 to align to the next level)

    def __post_init__(self) -> None:
        require(self.window >= 0, f"bp_tree window must be >= 0 (w = 0: only the token itself "
                f"among tokens), got {self.window}")
        require(self.k >= 1, f"bp_tree k must be >= 1 span node per side per level, got "
                f"{self.k}; use e.g. k=1 (the paper uses k in 1..4)")


@register_mechanism(BPTreeConfig)
class BPTree(nn.Module):
    """BP-Transformer: tokens attend token neighbours and multi-scale span nodes.

    Paper: Ye, Guo, Gan, Qiu, Zhang, "BP-Transformer: Modelling Long-Range Context via
    Binary Partitioning", arXiv 2019. Tokens are the leaves of a binary tree over the
    sequence; node (l, a) spans positions [a*2^l, (a+1)*2^l), and its key/value is the masked
    mean of the token keys/values in it: k_(l,a) = sum_{j in span, kept} k_j / #kept (the
    paper aggregates spans by attention over the tree; here a mean pool, no new weights).
    Key set of token i (contiguous, disjoint, covering the whole sequence):
      tokens |i - j| <= w, plus one alignment token on a side whose frontier is odd;
      for l = 1, 2, ..., L-1 (2^L >= n): the k nodes of level l adjacent to the region
      covered so far on each side, plus one more where needed so the frontier lies on a
      level-(l+1) node boundary (the paper's "k or k+1 nodes").
    Formula: softmax over that set of q_i k_x / sqrt(d), out_i = sum_x p_x v_x, O(k log n)
    keys per query, complexity O(n*(w + k log n)*d). Padded tokens never enter a mean; a
    fully padded span is masked. Causal: only the left side (tokens j <= i and left spans,
    wholly before i-w). ``need_weights`` returns the effective token probabilities
    [b,h,n,n] (span weights spread over their kept tokens; out = probs @ v exactly).
    """

    example: ClassVar[str] = "bp_tree(window=1, k=1)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Ye et al. 2019", keys_are_tokens=True,
        complexity="O(n*(w+k*log n))",
    )

    def __init__(self, cfg: BPTreeConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, _, n, _ = q.shape
        require(k.shape[2] == n, f"bp_tree keys are the query tokens: needs n == m, got n={n}, "
                f"m={k.shape[2]}")
        c, scale = self.cfg, ctx.scale_for(q.shape[-1])
        p = ctx.dropout if self.training else 0.0
        if ctx.need_weights:
            out, probs = bp_tree_reference(q, k, v, c.window, c.k, ctx.key_mask, ctx.causal,
                                           scale)
            return AttnOutput(out, probs)
        keep = torch.ones(b, n, dtype=torch.bool, device=q.device) if ctx.key_mask is None else (
            ctx.key_mask.to(device=q.device, dtype=torch.bool))
        tok, span, _ = (t.to(q.device) for t in bp_tree_index(n, c.window, c.k, ctx.causal))
        levels = bp_tree_levels(n)
        idx = torch.cat([tok, span.masked_fill(span < 0, -1 - n) + n], 1)  # [n,T+S] into n+N
        has = idx >= 0
        idx = idx.clamp(min=0)

        def heads(q, k, v) -> AttnOutput:  # a group of g heads
            km, valid = bp_tree_nodes(k, keep, levels)  # [b,g,N,d], [b,N]
            vm, _ = bp_tree_nodes(v, keep, levels)
            keys = torch.cat([k, km], 2)  # [b,g,n+N,d]
            vals = torch.cat([v, vm], 2)
            ok = torch.cat([keep, valid], 1)  # [b,n+N]
            allowed = (has[None] & ok[:, idx])[:, None]  # [b,1,n,T+S]
            # chunked gathers, recomputed in the backward: O(n*(T+S)) memory, not
            # O(n*(T+S)*d)
            return AttnOutput(gathered_attention(q, keys, vals, idx, allowed, scale=scale,
                                                 dropout=p))  # [b,g,n,dv]

        # a few heads at a time: each group's token+span keys [b,g,n+N,d] stay small enough
        # to be re-read from cache by the gathers (core/slicing.py)
        return over_head_groups(heads, (q, k, v), b * 2 * n * q.shape[-1] * q.element_size())
