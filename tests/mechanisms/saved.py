"""What autograd keeps for the backward: the one helper of the memory tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Kept:
    """Saved tensors seen inside ``kept_for_backward``: their unique storages' bytes
    (a sparse tensor counts its indices and values) and their shapes."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self.shapes: list[tuple[int, ...]] = []

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(t.shape))
        if t.layout == torch.strided:
            self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:
            self.storages[id(t)] = sum(x.numel() * x.element_size()
                                       for x in (t._indices(), t._values()))
        return t


@contextmanager
def kept_for_backward() -> Iterator[Kept]:
    """Record what autograd saves for the backward of the graph built inside the block
    (activation checkpoints save their inputs only, so a recomputed region shows none of
    its own tensors)."""
    kept = Kept()
    with torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda t: t):
        yield kept
