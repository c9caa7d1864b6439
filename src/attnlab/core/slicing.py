"""Run a per-head computation over groups of heads, so that no intermediate is large.

Why: on CPU, glibc serves every allocation above its mmap threshold (at most 32 MiB) with a
fresh mapping, and the kernel zero-fills each page on first touch. A mechanism whose
intermediates are [b, h, n, r] fp32 tensors above that size pays those page faults on
every op (the before and after timings are in docs/benchmarks-history.md, "The map §3.1-3.4",
with their command). Computing a few heads at a time keeps each intermediate under
``SLICE_BYTES``, where freed blocks are reused, and changes nothing else: heads are
independent in these mechanisms, so the result is identical (tested), and autograd saves
the same total memory. Output and weights are concatenated once along the head axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .protocol import AttnOutput

# Largest intermediate of one head group, in bytes (below glibc's 32 MiB mmap ceiling, and
# small enough to stay in the last-level cache on the machines we benchmark).
SLICE_BYTES = 8 << 20


def head_slices(h: int, bytes_per_head: int, budget: int | None = None) -> list[slice]:
    """Consecutive head groups whose intermediates are each at most ``budget`` bytes
    (one head per group when a single head is already larger); budget None: SLICE_BYTES."""
    budget = SLICE_BYTES if budget is None else budget
    per = max(1, budget // max(1, bytes_per_head))
    return [slice(i, min(i + per, h)) for i in range(0, h, per)]


def over_head_groups(
    fn: Callable[..., AttnOutput], tensors: Sequence[torch.Tensor], bytes_per_head: int,
    budget: int | None = None, per_head: Sequence[torch.Tensor] = (),
) -> AttnOutput:
    """``fn(*parts)`` computes one group of heads from ``tensors`` (each [b, h, ...]) cut
    along dim 1, followed by ``per_head`` (each [h, ...], e.g. per-head random rotations)
    cut along dim 0, and returns its AttnOutput; the groups' outputs (and weights, when
    present) are concatenated along dim 1, aux losses add up. The cut is one
    ``torch.split`` per tensor, whose backward writes each gradient once (indexing
    ``x[:, g]`` per group would allocate a full-size zero gradient per group). A single
    group calls ``fn`` on the tensors themselves."""
    h = tensors[0].shape[1]
    groups = head_slices(h, bytes_per_head, budget)
    if len(groups) == 1:
        return fn(*tensors, *per_head)
    sizes = [g.stop - g.start for g in groups]
    splits = [t.split(sizes, dim=1) for t in tensors] + [t.split(sizes) for t in per_head]
    parts = [fn(*group) for group in zip(*splits, strict=True)]
    probs = None
    if parts[0].probs is not None:
        probs = torch.cat([p.probs for p in parts], dim=1)  # type: ignore[misc]
    aux = [p.aux_loss for p in parts if p.aux_loss is not None]
    return AttnOutput(torch.cat([p.out for p in parts], dim=1), probs,
                      torch.stack(aux).sum() if aux else None)
