"""Key-padding masks and position-pattern builders.

A pattern is a boolean [n, m] tensor, True where query i may attend key j. ``pattern_bias``
turns one into the additive 0 / -inf bias that ``reference_attention`` takes.
"""

from __future__ import annotations

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
