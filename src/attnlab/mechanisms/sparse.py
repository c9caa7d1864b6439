"""Position-based sparse attention: the atomic patterns and their compounds.

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022 (arXiv 2021), §3.1.1.
Every mechanism here is exact softmax over a fixed pattern (0-based positions, query i,
key j; bidirectional unless ``ctx.causal``, which also requires j <= i, with these raw
positions also when n != m) and exposes
``bias(n, m) -> [1, n, m]`` (0 / -inf) that ``core.reference_attention`` takes.

Paths. Band-like patterns (band, dilated, block_local, longformer, star, global_tokens,
bigbird) and sparse_transformer (fixed: its own block plus shared summary keys; strided:
two block orders merged, ``_blockunion``) run on the blocked engine (``_blocksparse``)
from ``DENSE_FALLBACK_MAX_LEN`` keys on: it never builds n x m and trains on CPU.
``random``, whose keys differ from query to query, runs from the same length on as lists
of K keys per query on the gathered engine (``_gathered``: O(n*K) time and memory), as
does the strided pattern with attention dropout. Short inputs take the dense path: SDPA
under the pattern's mask (``_maskedsdpa``), or the reference itself when the weights are
returned (``ctx.need_weights``, capture). On CUDA, without dropout and from the same
length on, every pattern runs on FlexAttention (``_flex``; block-sparse kernels, cached
masks). The dispatch between these paths is ``_patternrun.run_pattern``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import nn

from ..core import (
    OMIT_DEFAULT,
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    pattern_bias,
    register_mechanism,
    require,
)
from ..core.masks import (
    band_pattern,
    bigbird_layout,
    bigbird_random_blocks,
    block_layout_to_pattern,
    block_local_pattern,
    dilated_pattern,
    fixed_pattern,
    global_pattern,
    random_key_list,
    random_pattern,
    star_pattern,
    strided_key_list,
    strided_pattern,
)
from . import _blockflash
from . import _blockpatterns as bp
from . import _blocksparse as bs
from ._patternrun import FastPath, key_list_attention, run_pattern

FAMILY = "sparse"
SURVEY = "Lin et al. 2021 (survey §3.1.1)"

# ----------------------------------------------------------------------------- mechanisms


@dataclass(frozen=True, kw_only=True)
class BandConfig(MechanismConfig):
    name: ClassVar[str] = "band"
    window: int = 64  # w: one-sided window, |i - j| <= w

    def __post_init__(self) -> None:
        require(self.window >= 0, f"band window must be >= 0, got {self.window}")


@register_mechanism(BandConfig)
class Band(nn.Module):
    """Band (sliding-window) attention: softmax over keys with |i - j| <= w.

    Paper: atomic "band attention" in Lin et al., "A Survey of Transformers", 2021
    (used by Longformer, Beltagy et al. 2020, and many local-attention models).
    Formula: softmax(q_i k_j / sqrt(d)) over j with |i - j| <= w. Complexity O(n*w*d)
    time, O(n*(w+B)) memory on the blocked path (B = query block, 64).
    """

    example: ClassVar[str] = "band(window=3)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper=SURVEY, exact=True, keys_are_tokens=True,
        complexity="O(n*w)"
    )

    def __init__(self, cfg: BandConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        return pattern_bias(band_pattern(n, m, self.cfg.window))[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        return bp.local_global_attention(
            q, k, v, window=self.cfg.window, key_mask=ctx.key_mask, causal=ctx.causal,
            scale=scale, dropout=p,
        )

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)


@dataclass(frozen=True, kw_only=True)
class DilatedConfig(MechanismConfig):
    name: ClassVar[str] = "dilated"
    window: int = 32  # w: keys per side, |i - j| <= w * r
    dilation: int = 2  # r: gap between attended keys, (i - j) % r == 0

    def __post_init__(self) -> None:
        require(self.window >= 0, f"dilated window must be >= 0, got {self.window}")
        require(self.dilation >= 1, f"dilation must be >= 1, got {self.dilation}")


@register_mechanism(DilatedConfig)
class Dilated(nn.Module):
    """Dilated band attention: keys at distances 0, r, 2r, ..., w*r on each side.

    Paper: atomic "dilated attention" in Lin et al., "A Survey of Transformers", 2021
    (as in Longformer's dilated windows, Beltagy et al. 2020).
    Formula: softmax over j with |i - j| <= w*r and (i - j) % r == 0. Blocked path: a band
    of width w on each residue class mod r. Complexity O(n*w*d).
    """

    example: ClassVar[str] = "dilated(window=2, dilation=2)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper=SURVEY, exact=True, keys_are_tokens=True,
        complexity="O(n*w)"
    )

    def __init__(self, cfg: DilatedConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        return pattern_bias(dilated_pattern(n, m, self.cfg.window, self.cfg.dilation))[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        return bp.dilated_attention(
            q, k, v, window=self.cfg.window, dilation=self.cfg.dilation,
            key_mask=ctx.key_mask, causal=ctx.causal, scale=scale, dropout=p,
        )

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)


@dataclass(frozen=True, kw_only=True)
class BlockLocalConfig(MechanismConfig):
    name: ClassVar[str] = "block_local"
    block: int = 64  # b: block length; i attends j iff i // b == j // b

    def __post_init__(self) -> None:
        require(self.block >= 1, f"block_local block must be >= 1, got {self.block}")


@register_mechanism(BlockLocalConfig)
class BlockLocal(nn.Module):
    """Block-local attention: the sequence is cut into blocks that attend only themselves.

    Paper: atomic "block local attention" in Lin et al., "A Survey of Transformers", 2021
    (Blockwise self-attention, Qiu et al. 2020; Image Transformer, Parmar et al. 2018).
    Formula: softmax over j with i // b == j // b. Complexity O(n*b*d); the blocked path
    groups small blocks into query blocks of >= 64 rows for efficient matrix products.
    """

    example: ClassVar[str] = "block_local(block=4)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper=SURVEY, exact=True, keys_are_tokens=True,
        complexity="O(n*b)"
    )

    def __init__(self, cfg: BlockLocalConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        return pattern_bias(block_local_pattern(n, m, self.cfg.block))[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        blk = self.cfg.block
        qblock = blk * -(-bs.DEFAULT_BLOCK // blk)  # a multiple of the pattern block

        def pattern(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return i // blk == j // blk

        return bs.blocked_attention(
            q, k, v, block=qblock, left=0, width=qblock, pattern=pattern,
            key_mask=ctx.key_mask, causal=ctx.causal, scale=scale, dropout=p,
            pattern_key=("block_local", blk, qblock),
        )

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)


@dataclass(frozen=True, kw_only=True)
class GlobalTokensConfig(MechanismConfig):
    name: ClassVar[str] = "global_tokens"
    tokens: tuple[int, ...] = (0,)  # G: global positions (attend and are attended by all)

    def __post_init__(self) -> None:
        require(all(t >= 0 for t in self.tokens), f"global tokens must be >= 0: {self.tokens}")


@register_mechanism(GlobalTokensConfig)
class GlobalTokens(nn.Module):
    """Global-node attention: a few tokens see and are seen by all; others see themselves.

    Paper: atomic "global attention" in Lin et al., "A Survey of Transformers", 2021.
    Formula: softmax over j with i in G or j in G or i == j. Complexity O(n*|G|*d);
    blocked path = Longformer with window 0 (query blocks of 64 still score 64 local keys).
    Positions in G beyond the sequence length are ignored.
    """

    example: ClassVar[str] = "global_tokens(tokens=[0, 5])"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper=SURVEY, exact=True, keys_are_tokens=True,
        complexity="O(n*|G|)"
    )

    def __init__(self, cfg: GlobalTokensConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        return pattern_bias(global_pattern(n, m, self.cfg.tokens))[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        return bp.local_global_attention(
            q, k, v, window=0, global_tokens=self.cfg.tokens, key_mask=ctx.key_mask,
            causal=ctx.causal, scale=scale, dropout=p,
        )

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)


@dataclass(frozen=True, kw_only=True)
class RandomConfig(MechanismConfig):
    name: ClassVar[str] = "random"
    num_random: int = 8  # r: random keys per query (plus the query's own position)
    seed: int = 0  # seed of the pattern, combined with the layer index and n

    def __post_init__(self) -> None:
        require(self.num_random >= 0, f"num_random must be >= 0, got {self.num_random}")


@register_mechanism(RandomConfig)
class Random(nn.Module):
    """Random attention: each query sees itself and r keys drawn at random.

    Paper: atomic "random attention" in Lin et al., "A Survey of Transformers", 2021 (as in
    BigBird, Zaheer et al., NeurIPS 2020). Formula: softmax over j == i or j in R_i, with
    R_i r distinct keys drawn per query by a generator seeded by (seed, layer_idx, n): the
    same pattern in train and eval and across calls. Complexity: O(n*r) time and memory
    (the r + 1 keys of each query on the gathered engine, from ``DENSE_FALLBACK_MAX_LEN``
    keys on; the dense masked reference below it). R_i is drawn among all m keys, so a
    draw that hits i leaves r keys in all, and with ``ctx.causal`` the draws after i are
    dropped: query i keeps about r * i / m of them (a prefix of the sequence sees fewer
    random keys). The draw depends on n: a prefix of a longer sequence gets other keys.
    Padding: the pattern is drawn for the padded length n, so a right-padded row attends
    other random keys than its sequence alone (padded keys are never attended).
    """

    example: ClassVar[str] = "random(num_random=3, seed=1)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper=SURVEY, exact=True, keys_are_tokens=True,
        complexity="O(n*r)"
    )

    def __init__(self, cfg: RandomConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        pat = random_pattern(n, m, self.cfg.num_random, self.cfg.seed, layer_idx)
        return pattern_bias(pat)[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        keys = random_key_list(q.shape[2], self.cfg.num_random, self.cfg.seed, ctx.layer_idx)
        return key_list_attention(keys, q, k, v, ctx, scale, p)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)


@dataclass(frozen=True, kw_only=True)
class LongformerConfig(MechanismConfig):
    name: ClassVar[str] = "longformer"
    window: int = 64  # w: one-sided sliding window, |i - j| <= w
    global_tokens: tuple[int, ...] = (0,)  # G: global positions (e.g. [CLS] = 0)

    def __post_init__(self) -> None:
        require(self.window >= 0, f"longformer window must be >= 0, got {self.window}")
        require(all(t >= 0 for t in self.global_tokens),
                f"global tokens must be >= 0: {self.global_tokens}")


@register_mechanism(LongformerConfig)
class Longformer(nn.Module):
    """Longformer attention: sliding window plus global tokens.

    Paper: Beltagy, Peters, Cohan, "Longformer: The Long-Document Transformer", arXiv 2020.
    Formula: softmax over j with |i - j| <= w or i in G or j in G. Complexity
    O(n*(w+|G|)*d). ``window`` is one-sided, w keys on each side: the paper's window size
    and transformers' ``attention_window`` count both sides (``attention_window=512`` is
    ``window=256`` here). Deviation: one set of projections for local and global attention
    (the paper uses separate global Q/K/V projections); no dilation.
    """

    example: ClassVar[str] = "longformer(window=2, global_tokens=[0, 3])"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Beltagy et al. 2020", exact=True, keys_are_tokens=True,
        complexity="O(n*(w+|G|))"
    )

    def __init__(self, cfg: LongformerConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        pat = band_pattern(n, m, self.cfg.window) | global_pattern(n, m, self.cfg.global_tokens)
        return pattern_bias(pat)[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        return bp.local_global_attention(
            q, k, v, window=self.cfg.window, global_tokens=self.cfg.global_tokens,
            key_mask=ctx.key_mask, causal=ctx.causal, scale=scale, dropout=p,
        )

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)


@dataclass(frozen=True, kw_only=True)
class StarConfig(MechanismConfig):
    name: ClassVar[str] = "star"
    relay: int = 0  # position of the relay node (a position of the sequence, e.g. [CLS])

    def __post_init__(self) -> None:
        require(self.relay >= 0, f"star relay must be >= 0, got {self.relay}")


@register_mechanism(StarConfig)
class Star(nn.Module):
    """Star-Transformer attention: neighbours |i - j| <= 1 plus one relay node.

    Paper: Guo, Qiu, Liu, Shao, Xue, Zhang, "Star-Transformer", NAACL 2019.
    Formula: softmax over j with |i - j| <= 1 or i == relay or j == relay. Complexity
    O(n*d). Deviation: the relay is a position of the sequence sharing the layer's
    projections (the paper keeps a separate relay state updated in alternation); a relay
    beyond the sequence length is ignored. Differs from the paper: a satellite's keys are
    its neighbours and the relay, without the paper's extra key of the token's own
    embedding e_i; and although the paper draws the satellites as a ring, the first and last
    tokens are not neighbours (nor are they in the authors' code, fastNLP
    ``StarTransformer``: a zero-padded unfold of width 3).
    """

    example: ClassVar[str] = "star(relay=0)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Guo et al. 2019", exact=True, keys_are_tokens=True,
        complexity="O(n)"
    )

    def __init__(self, cfg: StarConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        return pattern_bias(star_pattern(n, m, self.cfg.relay))[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        return bp.local_global_attention(
            q, k, v, window=1, global_tokens=(self.cfg.relay,), key_mask=ctx.key_mask,
            causal=ctx.causal, scale=scale, dropout=p,
        )

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)


@dataclass(frozen=True, kw_only=True)
class BigBirdConfig(MechanismConfig):
    name: ClassVar[str] = "bigbird"
    block: int = 64  # b: block size of the block-sparse layout
    window_blocks: int = 3  # w: sliding window in blocks (|qb - kb| <= w // 2)
    num_random_blocks: int = 3  # r: random key blocks per query block
    global_blocks: int = 1  # g: leading global blocks (rows and columns)
    seed: int = 0  # seed of the random blocks, combined with the layer index and n
    # the last block global too (rows and columns): with global_blocks=1, the official ITC
    # layout's two global blocks, the first and the last; left out of the spec when False
    last_global: bool = field(default=False, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        require(self.block >= 1, f"bigbird block must be >= 1, got {self.block}")
        require(self.window_blocks >= 1, f"window_blocks must be >= 1, got {self.window_blocks}")
        require(self.num_random_blocks >= 0 and self.global_blocks >= 0,
                "num_random_blocks and global_blocks must be >= 0")


@register_mechanism(BigBirdConfig)
class BigBird(nn.Module):
    """BigBird (ITC) block-sparse attention: window, global and random blocks.

    Paper: Zaheer et al., "Big Bird: Transformers for Longer Sequences", NeurIPS 2020.
    Formula: query block qb attends key blocks |qb - kb| <= w // 2, the global blocks (the
    first g, and the last one with ``last_global``) and r random blocks (drawn outside
    those, seeded by (seed, layer_idx, n)); the global query blocks attend everything.
    Complexity O(n*(w+g+r)*b*d).
    Global blocks: the official ITC code (google-research/bigbird ``bigbird_block_sparse_
    attention``; transformers' ``BigBirdBlockSparseAttention``) makes the first and the last
    block global: ``global_blocks=1, last_global=True``. The default (``last_global``
    False) makes the first g blocks global, so ``bigbird`` alone has one global block, the
    first. Deviations: the random blocks are the same for every head and batch element of a
    layer, and drawn once per (seed, layer, n), the same in training and evaluation (as the
    google-research code, which seeds them by the layer); an even ``window_blocks`` covers
    w + 1 blocks (|qb - kb| <= w // 2).
    Padding: the random blocks are drawn for the padded length n (its block count), and with
    ``last_global`` the padded sequence's last block is the global one, as in the official
    code and transformers; so a right-padded row attends other keys than its sequence alone.
    Without random blocks and ``last_global`` a row's result does not depend on its padding.
    """

    example: ClassVar[str] = (
        "bigbird(block=4, window_blocks=3, num_random_blocks=1, global_blocks=1)"
    )
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Zaheer et al. 2020", exact=True, keys_are_tokens=True,
        complexity="O(n*(w+g+r)*b)"
    )

    def __init__(self, cfg: BigBirdConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def random_blocks(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        c = self.cfg
        nqb, nkb = -(-n // c.block), -(-m // c.block)
        return bigbird_random_blocks(nqb, nkb, c.window_blocks, c.num_random_blocks,
                                     c.global_blocks, c.seed, layer_idx, n, c.last_global)

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        c = self.cfg
        nqb, nkb = -(-n // c.block), -(-m // c.block)
        layout = bigbird_layout(nqb, nkb, c.window_blocks, c.global_blocks,
                                self.random_blocks(n, m, layer_idx), c.last_global)
        return pattern_bias(block_layout_to_pattern(layout, c.block, n, m))[None]

    def _fast(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        c, n = self.cfg, q.shape[2]
        blk, half, g = c.block, c.window_blocks // 2, c.global_blocks
        nqb = -(-n // blk)
        offs = torch.arange(blk)
        rnd = self.random_blocks(n, n, ctx.layer_idx)  # [nqb,r]
        rpos = (rnd[:, :, None] * blk + offs).masked_fill(rnd[:, :, None] < 0, -1)
        last = nqb - 1 if c.last_global and nqb - 1 >= g else None  # not already global
        glob = torch.arange(min(g * blk, n))  # global positions: rows and key columns
        if last is not None:
            glob = torch.cat([glob, torch.arange(last * blk, n)])
        extra = torch.cat([glob.expand(nqb, -1), rpos.reshape(nqb, -1)], dim=1).to(q.device)

        def pattern(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            # the window minus the global columns (they are extras)
            keep = j // blk >= g
            return keep if last is None else keep & (j // blk != last)

        return bs.blocked_attention(
            q, k, v, block=blk, left=half * blk, width=(2 * half + 1) * blk, pattern=pattern,
            extra=extra, key_mask=ctx.key_mask, causal=ctx.causal, scale=scale, dropout=p,
            rows=glob.to(q.device) if glob.numel() else None,
            pattern_key=("bigbird", c, ctx.layer_idx),  # the random blocks are per layer
        )

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        c = self.cfg
        globals_ = c.global_blocks + c.last_global
        keys = (c.window_blocks // 2 * 2 + 1 + globals_ + c.num_random_blocks) * c.block
        # when every query sees about all keys anyway, the dense path is faster
        return run_pattern(self, q, k, v, ctx, self._fast if 2 * keys <= q.shape[2] else None)


@dataclass(frozen=True, kw_only=True)
class SparseTransformerConfig(MechanismConfig):
    name: ClassVar[str] = "sparse_transformer"
    mode: Literal["strided", "fixed"] = "strided"  # factorization: strided or fixed
    stride: int = 64  # l: stride / block length
    summary: int = 1  # c: summary cells per block in the fixed mode

    def __post_init__(self) -> None:
        require(self.stride >= 1, f"stride must be >= 1, got {self.stride}")
        require(1 <= self.summary <= self.stride,
                f"summary must be in 1..stride ({self.stride}), got {self.summary}")


@register_mechanism(SparseTransformerConfig)
class SparseTransformer(nn.Module):
    """Sparse Transformer factorized attention (union of its two heads' patterns).

    Paper: Child, Gray, Radford, Sutskever, "Generating Long Sequences with Sparse
    Transformers", arXiv 2019. Formula: strided |i - j| < l or (i - j) % l == 0; fixed
    i // l == j // l or j % l >= l - c. Complexity: O(n*(l + n/l)) time and memory from
    ``DENSE_FALLBACK_MAX_LEN`` keys on (O(n*sqrt(n)) at l ~ sqrt(n), as the paper's
    kernels): strided on the blocked engine as the band and the residue classes in two
    orders merged by their log-sum-exp (``_blockunion``; with attention dropout or off the
    flash kernels, on the gathered engine: the keys of each query), fixed on the blocked
    engine (the own block as the window, the summary columns as keys every block shares);
    dense masked softmax below it. Deviation: the two factorized
    patterns are merged into one head (the paper's "merged" variant) and are bidirectional
    unless ``ctx.causal``.
    """

    example: ClassVar[str] = "sparse_transformer(mode='strided', stride=4)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Child et al. 2019", exact=True, keys_are_tokens=True,
        complexity="O(n*(l+n/l))"
    )

    def __init__(self, cfg: SparseTransformerConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self._fast: FastPath = self._strided if cfg.mode == "strided" else self._fixed

    def _strided(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        if not _blockflash.usable(q, p):  # attention dropout, other dtypes: key lists
            keys = strided_key_list(q.shape[2], self.cfg.stride)
            return key_list_attention(keys, q, k, v, ctx, scale, p)
        return bp.strided_attention(q, k, v, stride=self.cfg.stride, key_mask=ctx.key_mask,
                                    causal=ctx.causal, scale=scale)

    def _fixed(self, q, k, v, ctx: AttnContext, scale: float, p: float) -> torch.Tensor:
        return bp.fixed_attention(
            q, k, v, stride=self.cfg.stride, summary=self.cfg.summary, key_mask=ctx.key_mask,
            causal=ctx.causal, scale=scale, dropout=p,
        )

    def bias(self, n: int, m: int, layer_idx: int = 0) -> torch.Tensor:
        c = self.cfg
        if c.mode == "strided":
            return pattern_bias(strided_pattern(n, m, c.stride))[None]
        return pattern_bias(fixed_pattern(n, m, c.stride, c.summary))[None]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        return run_pattern(self, q, k, v, ctx, self._fast)
