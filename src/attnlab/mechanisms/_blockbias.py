"""The masks of the blocked sparse-attention engine (``_blocksparse``): which keys of each
query block's window and extra keys the pattern allows, as an additive bias, and the bias
of the dense (global) query rows.

Building a pattern's bias takes passes over [nqb, B, L+R] (about 15% of band(128)'s
forward at n = 4096 on one CPU thread), so it is cached per pattern and shape when the
caller names its pattern (``key``); a batch's key mask is applied on top per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

Pattern = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _neg(dtype: torch.dtype) -> float:
    # A finite "minus infinity": fully masked rows give a finite uniform softmax (then
    # zeroed), never NaN; exp(NEG - lse) underflows to exactly 0 elsewhere.
    return torch.finfo(dtype).min / 2


def build_block_bias(
    n: int,
    block: int,
    left: int,
    width: int,
    pattern: Pattern,
    extra: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
    key: Hashable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Additive biases (0 / NEG) of the window [b|1, nqb, B, L] and of the extra keys
    [b|1, nqb, B, R] (None without extras), each contiguous (the engine copies a chunk of
    each per step, and a strided copy out of one [.., L+R] tensor is slower), and the live
    rows [b|1, nqb, B] (bool).

    ``pattern(i, j)`` gets query positions i [nqb, B, 1] and window key positions
    j [nqb, 1, L] and returns which pairs the pattern allows inside the window. Extra keys
    (``extra`` [nqb, R] positions, -1 = unused) are allowed for every query of their block.
    Bounds (0 <= j < n, i < n), ``causal`` (j <= i) and ``key_mask`` [b, n] are added here.

    ``key``: a hashable that names ``pattern`` and ``extra`` completely (the caller's
    pattern settings). With it the key-mask-free part is cached per (key, shape, causal,
    device) (``BIAS_CACHE_SIZE`` entries, least recently used dropped), and so is the whole
    result when there is no padding: building it takes about as long as 15% of band(128)'s
    forward at n = 4096. The cached tensors are shared, never written to.
    """
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None  # no padding: one bias for the whole batch
    base = None if key is None else (key, n, block, left, width, causal, str(device))

    def pattern_part() -> tuple[torch.Tensor, torch.Tensor]:
        return _cached(base, lambda: _allowed(n, block, left, width, pattern, extra, causal,
                                              device))

    if key_mask is None:
        return _cached(None if base is None else (*base, dtype),
                       lambda: _to_bias(*pattern_part(), None, n, dtype, width))
    return _to_bias(*pattern_part(), key_mask, n, dtype, width)


BIAS_CACHE_SIZE = 16
_BIAS_CACHE: OrderedDict[Hashable, Any] = OrderedDict()


def _cached(key: Hashable | None, build: Callable[[], Any]) -> Any:
    """``build()``, remembered under ``key`` (not at all when key is None)."""
    if key is None:
        return build()
    if key in _BIAS_CACHE:
        _BIAS_CACHE.move_to_end(key)
        return _BIAS_CACHE[key]
    value = _BIAS_CACHE[key] = build()
    while len(_BIAS_CACHE) > BIAS_CACHE_SIZE:
        _BIAS_CACHE.popitem(last=False)
    return value


def _allowed(n: int, block: int, left: int, width: int, pattern: Pattern,
             extra: torch.Tensor | None, causal: bool, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pattern, bounds and causal rule: allowed [nqb, B, L+R] (bool) and the key
    positions j [nqb, 1, L+R] of its columns."""
    nqb = -(-n // block)
    u = torch.arange(nqb, device=device)
    i = (u[:, None] * block + torch.arange(block, device=device))[:, :, None]  # [nqb,B,1]
    jw = (u * block - left)[:, None, None] + torch.arange(width, device=device)  # [nqb,1,L]
    allowed = pattern(i, jw) & (jw >= 0) & (jw < n)  # [nqb,B,L]
    j = jw
    if extra is not None and extra.shape[-1] > 0:
        jx = extra.to(device)[:, None, :]  # [nqb,1,R]
        ax = ((jx >= 0) & (jx < n)).expand(nqb, block, -1)
        allowed = torch.cat([allowed.expand(nqb, block, width), ax], dim=-1)
        j = torch.cat([jw, jx], dim=-1)  # [nqb,1,L+R]
    allowed = allowed & (i < n)
    if causal:
        allowed = allowed & (j <= i)
    return allowed, j


def _to_bias(allowed: torch.Tensor, j: torch.Tensor, key_mask: torch.Tensor | None, n: int,
             dtype: torch.dtype, width: int
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``build_block_bias``' result from the pattern part and the key mask."""
    if key_mask is not None:
        km = key_mask.to(device=allowed.device, dtype=torch.bool)[:, j.clamp(0, n - 1)]
        allowed = allowed[None] & km  # [b,nqb,B,L+R]
    else:
        allowed = allowed[None]
    live = allowed.any(-1)  # [b|1,nqb,B]

    def bias(part: torch.Tensor) -> torch.Tensor:
        return torch.zeros(part.shape, dtype=dtype, device=part.device).masked_fill_(
            ~part, _neg(dtype))

    extra = allowed.shape[-1] > width
    return bias(allowed[..., :width]), bias(allowed[..., width:]) if extra else None, live


def row_bias(rows: torch.Tensor, n: int, key_mask: torch.Tensor | None, causal: bool,
             dtype: torch.dtype) -> torch.Tensor:
    """Additive bias [b|1, G, n] of dense query rows: every key, minus padding and (causal)
    keys after the row."""
    allowed = torch.ones(1, rows.shape[0], n, dtype=torch.bool, device=rows.device)
    if causal:
        allowed = allowed & (torch.arange(n, device=rows.device) <= rows[:, None])
    if key_mask is not None and not bool(key_mask.all()):
        allowed = allowed & key_mask.to(device=rows.device, dtype=torch.bool)[:, None, :]
    return torch.zeros(allowed.shape, dtype=dtype, device=rows.device).masked_fill_(
        ~allowed, _neg(dtype))
