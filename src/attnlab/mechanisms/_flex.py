"""Optional FlexAttention backend for the sparse patterns, used only when q is on CUDA.

Why: on a GPU, ``torch.nn.attention.flex_attention`` with a ``BlockMask`` runs fused
block-sparse kernels (forward and backward) that beat the blocked engine. On CPU (torch
2.13) FlexAttention has no backward, so the CPU path stays the blocked engine
(``_blocksparse``), which this backend is tested against.

How: the pattern (``mech.bias(n, m) == 0``, with causal folded in) becomes a
``BlockMask``, built once per (mechanism config, layer, n, m, causal, device) and cached
(``create_block_mask`` is slow). The key-padding mask changes per batch, so it is applied
as a ``score_mod`` (-inf for padded keys) instead of entering the cached mask.
FlexAttention returns zeros for rows with no allowed key. No attention dropout here (the
caller falls back to the blocked engine when dropout is active). Inputs are padded along
the sequence to a power of two (at least FLEX_BLOCK), so varying lengths share a few
compiled shapes: compiled FlexAttention (``dynamic=False``) compiles once per shape, and
past dynamo's recompile limit it falls back to eager FlexAttention, which materialises the
n x m scores. Padded keys are outside the pattern and padded query rows have no key, so
their blocks are skipped by the block mask; the calls raise the recompile limit to
RECOMPILE_LIMIT for FlexAttention alone (seen on an H200: a ListOps run with lengths
varying in multiples of 128 reached the default limit of 8 within its first steps).
Cost: the cached pattern is an [n, m] bool lookup table (n*m bytes on the GPU); the
compute is block-sparse.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from ..core import causal_mask

CACHE_SIZE = 64  # BlockMasks kept (least recently used dropped)
FLEX_BLOCK = 128  # FlexAttention's block size
RECOMPILE_LIMIT = 64  # compiled shapes per FlexAttention call site (dynamo's default: 8)
_MASKS: OrderedDict[tuple, object] = OrderedDict()


def available(q: torch.Tensor) -> bool:
    """True when q is on CUDA with a head dim FlexAttention supports (>= 16) and this
    torch has FlexAttention."""
    if not q.is_cuda or q.shape[-1] < 16:
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def padded_length(n: int) -> int:
    """The length a sequence of ``n`` is padded to: the next power of two, >= FLEX_BLOCK."""
    return max(FLEX_BLOCK, 1 << (n - 1).bit_length())


def recompile_limit():
    """A context raising dynamo's per-function recompile limit to RECOMPILE_LIMIT."""
    import torch._dynamo

    name = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
            else "cache_size_limit")
    return torch._dynamo.config.patch(**{name: RECOMPILE_LIMIT})


@functools.cache
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def compiled_block_mask():
    """``torch.compile(create_block_mask)``, made once (what ``create_block_mask(...,
    _compile=True)`` did; that flag is deprecated)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def block_mask(
    allowed_fn: Callable[[], torch.Tensor], key: Hashable, n: int, m: int, causal: bool,
    device: torch.device, compile_mask: bool = True,
):
    """The cached BlockMask of ``allowed_fn() -> [n, m] bool`` (and j <= i when causal)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ck = (key, n, m, causal, str(device))
    if ck in _MASKS:
        _MASKS.move_to_end(ck)
        return _MASKS[ck]
    allowed = allowed_fn().to(device=device, dtype=torch.bool)  # [n,m]
    if causal:
        allowed = allowed & causal_mask(n, m, device)

    def mask_mod(b, h, qi, kj):
        return allowed[qi, kj]

    make = compiled_block_mask() if compile_mask else create_block_mask
    with recompile_limit():
        bm = make(mask_mod, None, None, n, m, device=device, BLOCK_SIZE=FLEX_BLOCK)
    _MASKS[ck] = bm
    while len(_MASKS) > CACHE_SIZE:
        _MASKS.popitem(last=False)
    return bm


def flex_pattern_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed_fn: Callable[[], torch.Tensor],
    key: Hashable,
    *,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    compiled: bool = True,
) -> torch.Tensor:
    """Exact masked softmax over the pattern with FlexAttention: [b,h,n,dv].

    q, k, v are zero-padded along the sequence to ``padded_length`` (padded keys are
    outside the pattern, padded query rows are dropped from the output), so batches of
    varying length reuse a few compiled shapes instead of recompiling per length (see the
    module docstring). ``compiled=False`` runs eager FlexAttention (forward only on CPU;
    used by the tests).
    """
    from torch.nn.attention.flex_attention import flex_attention

    n, m = q.shape[2], k.shape[2]
    pn, pm = padded_length(n) - n, padded_length(m) - m  # padding to the shape bucket

    def padded_allowed() -> torch.Tensor:  # [n + pn, m + pm]: the pattern, causal folded in
        allowed = allowed_fn().to(torch.bool)
        if causal:
            allowed = allowed & causal_mask(n, m, allowed.device)
        return torch.nn.functional.pad(allowed, (0, pm, 0, pn))  # pads are not allowed

    if pn or pm:
        q = torch.nn.functional.pad(q, (0, 0, 0, pn))
        k = torch.nn.functional.pad(k, (0, 0, 0, pm))
        v = torch.nn.functional.pad(v, (0, 0, 0, pm))
    bm = block_mask(padded_allowed, (key, n, m, causal), n + pn, m + pm, False, q.device,
                    compile_mask=compiled)
    score_mod = None
    if key_mask is not None:
        km = key_mask.to(device=q.device, dtype=torch.bool)  # [b,m]
        km = torch.nn.functional.pad(km, (0, pm))  # padded keys: masked

        def score_mod(score, b, h, qi, kj):
            return torch.where(km[b, kj], score, float("-inf"))

    fn = compiled_flex() if compiled else flex_attention
    with recompile_limit():
        out = fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale)
    return out[:, :, :n]
