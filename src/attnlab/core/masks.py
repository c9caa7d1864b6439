"""Key-padding masks and position-pattern builders.

A pattern is a boolean [n, m] tensor, True where query i may attend key j. ``pattern_bias``
turns one into the additive 0 / -inf bias that ``reference_attention`` takes.
"""

from __future__ import annotations

import functools

import torch


def key_mask_from_lengths(lengths: torch.Tensor | list[int], m: int) -> torch.Tensor:
    """[b] lengths -> [b,m] bool key mask, True for the first ``length`` keys."""
    lengths = torch.as_tensor(lengths)
    return torch.arange(m, device=lengths.device)[None, :] < lengths[:, None]


def pattern_bias(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bool pattern [..., n, m] -> additive bias (0 where allowed, -inf elsewhere)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill(~allowed, float("-inf"))


def positions(n: int, m: int, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """(i [n,1], j [1,m]) integer position grids."""
    return (
        torch.arange(n, device=device)[:, None],
        torch.arange(m, device=device)[None, :],
    )


def band_pattern(n: int, m: int, window: int, device=None) -> torch.Tensor:
    """|i - j| <= window."""
    i, j = positions(n, m, device)
    return (i - j).abs() <= window


def dilated_pattern(n: int, m: int, window: int, dilation: int, device=None) -> torch.Tensor:
    """|i - j| <= window * dilation and (i - j) % dilation == 0."""
    i, j = positions(n, m, device)
    d = i - j
    return (d.abs() <= window * dilation) & (d.remainder(dilation) == 0)


def block_local_pattern(n: int, m: int, block: int, device=None) -> torch.Tensor:
    """i // block == j // block."""
    i, j = positions(n, m, device)
    return (i // block) == (j // block)


def global_pattern(n: int, m: int, tokens, device=None) -> torch.Tensor:
    """i in tokens or j in tokens or i == j (tokens outside the length are ignored)."""
    i, j = positions(n, m, device)
    t = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
    gi = torch.isin(torch.arange(n, device=device), t)[:, None]
    gj = torch.isin(torch.arange(m, device=device), t)[None, :]
    return gi | gj | (i == j)


def block_layout_to_pattern(layout: torch.Tensor, block: int, n: int, m: int) -> torch.Tensor:
    """Block layout [nqb, nkb] bool -> element pattern [n, m] (cropped to n, m)."""
    full = layout.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return full[:n, :m]


# ------------------------------------------- seeded and compound patterns (sparse family)


def seeded_generator(seed: int, layer_idx: int, n: int) -> torch.Generator:
    """CPU generator seeded by (seed, layer_idx, n): the same pattern in train and eval."""
    mixed = ((seed * 1_000_003 + layer_idx) * 1_000_033 + n) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def global_draw() -> int:
    """One integer in [0, 2^62) from the global CPU RNG: what a mechanism's training-time
    randomness is seeded from (``training_generator``, performer's feature draws)."""
    return int(torch.randint(0, 2**62, ()).item())


def training_generator(seed: int, layer_idx: int) -> torch.Generator:
    """CPU generator of one training call of a mechanism that draws afresh at every
    training forward: seeded by (seed, layer_idx) and one draw from the global CPU RNG.

    Through that draw the run's seed (``torch.manual_seed``) fixes every call's draws;
    gradient checkpointing, which restores the global RNG before it recomputes a layer,
    recomputes the forward's draws; and a resumed run, whose checkpoint restores the
    global RNG, continues them as the uninterrupted run does. (Generators of the
    mechanism's own would need all three handled apart.)"""
    return seeded_generator(seed, layer_idx, global_draw())


def call_generator(seed: int, layer_idx: int, n: int, training: bool) -> torch.Generator:
    """Where a call's random draws come from: in training a fresh ``training_generator``
    (redrawn every call, through the global RNG), in eval the fixed ``seeded_generator`` of
    (seed, layer_idx, n), so eval is deterministic."""
    if training:
        return training_generator(seed, layer_idx)
    return seeded_generator(seed, layer_idx, n)


_DRAW_ROWS = 256  # rows of uniform draws at a time: no [n, m] float tensor is built


@functools.lru_cache(maxsize=16)
def random_keys(n: int, m: int, num_random: int, seed: int, layer_idx: int) -> torch.Tensor:
    """[n, r] long (r = min(num_random, m)): the distinct keys drawn for each query, the r
    largest of m uniform draws seeded by (seed, layer_idx, n). Drawn a few rows at a time
    (the generator gives the same numbers as one [n, m] draw). Cached: do not modify."""
    r, g = min(num_random, m), seeded_generator(seed, layer_idx, n)
    parts = [torch.rand(min(_DRAW_ROWS, n - r0), m, generator=g).topk(r, dim=-1).indices
             for r0 in range(0, n, _DRAW_ROWS)] if r > 0 else []
    return torch.cat(parts) if parts else torch.empty(n, 0, dtype=torch.long)


def random_pattern(n: int, m: int, num_random: int, seed: int, layer_idx: int) -> torch.Tensor:
    """[n, m] bool: j == i, or j among ``num_random`` distinct keys drawn for query i."""
    i, j = positions(n, m)
    return (i == j).scatter(1, random_keys(n, m, num_random, seed, layer_idx), True)


def star_pattern(n: int, m: int, relay: int) -> torch.Tensor:
    """[n, m] bool: |i - j| <= 1 or i == relay or j == relay."""
    i, j = positions(n, m)
    return ((i - j).abs() <= 1) | (i == relay) | (j == relay)


# ---- the same patterns as key lists per query (n == m): idx [n, K] valid positions and
# ok [n, K] bool (False: a slot that is no key, out of range or a repeat). For
# ``mechanisms._gathered``, which scores K keys per query instead of n. Cached per shape (a
# layer calls them on every forward): the tensors are shared, do not modify them.


@functools.lru_cache(maxsize=16)
def random_key_list(n: int, num_random: int, seed: int, layer_idx: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``random_pattern`` as keys: the query itself, then its draws (a draw of i repeats)."""
    own = torch.arange(n)[:, None]
    drawn = random_keys(n, n, num_random, seed, layer_idx)  # [n, r]
    idx = torch.cat([own, drawn], dim=1)
    return idx, torch.cat([torch.ones_like(own, dtype=torch.bool), drawn != own], dim=1)


@functools.lru_cache(maxsize=16)
def strided_key_list(n: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``strided_pattern`` as keys: |i - j| < l, then the other positions of i's residue
    class mod l (j = i % l + t l; j = i is already among the near keys)."""
    i = torch.arange(n)[:, None]
    near = i + torch.arange(-stride + 1, stride)  # [n, 2l-1]
    same = i.remainder(stride) + torch.arange(-(-n // stride)) * stride  # [n, ceil(n/l)]
    idx = torch.cat([near, same], dim=1)
    ok = torch.cat([(near >= 0) & (near < n), (same < n) & (same != i)], dim=1)
    return idx.clamp(0, n - 1), ok


def strided_pattern(n: int, m: int, stride: int) -> torch.Tensor:
    """Sparse Transformer strided: |i - j| < l or (i - j) % l == 0."""
    i, j = positions(n, m)
    return ((i - j).abs() < stride) | ((i - j).remainder(stride) == 0)


def fixed_pattern(n: int, m: int, stride: int, summary: int) -> torch.Tensor:
    """Sparse Transformer fixed: i // l == j // l or j % l >= l - c."""
    i, j = positions(n, m)
    return (i // stride == j // stride) | (j.remainder(stride) >= stride - summary)


def bigbird_random_blocks(
    nqb: int, nkb: int, window_blocks: int, num_random_blocks: int, global_blocks: int,
    seed: int, layer_idx: int, n: int, last_global: bool = False,
) -> torch.Tensor:
    """[nqb, r] key-block indices (-1 = none left): r distinct random blocks per query block.

    Drawn among the blocks outside the query block's window and outside the global
    blocks (the first ``global_blocks``, and the last one if ``last_global``), so no key
    counts twice; seeded by (seed, layer_idx, n).
    """
    r = min(num_random_blocks, nkb)
    qb = torch.arange(nqb)[:, None]
    kb = torch.arange(nkb)[None, :]
    free = ((qb - kb).abs() > window_blocks // 2) & (kb >= global_blocks)  # [nqb,nkb]
    if last_global:
        free &= kb != nkb - 1
    score = torch.rand(nqb, nkb, generator=seeded_generator(seed, layer_idx, n))
    score = score.masked_fill(~free, -1.0)
    top = score.topk(r, dim=-1)
    return top.indices.masked_fill(top.values < 0, -1)


def bigbird_layout(
    nqb: int, nkb: int, window_blocks: int, global_blocks: int, random_blocks: torch.Tensor,
    last_global: bool = False,
) -> torch.Tensor:
    """[nqb, nkb] bool block layout: window, global rows and columns (the first
    ``global_blocks``, and the last block if ``last_global``), random blocks."""
    qb = torch.arange(nqb)[:, None]
    kb = torch.arange(nkb)[None, :]
    layout = ((qb - kb).abs() <= window_blocks // 2) | (kb < global_blocks) | (qb < global_blocks)
    if last_global:
        layout |= (kb == nkb - 1) | (qb == nqb - 1)
    rnd = torch.zeros(nqb, nkb + 1, dtype=torch.bool)
    rnd.scatter_(1, random_blocks.masked_fill(random_blocks < 0, nkb), True)
    return layout | rnd[:, :nkb]
