"""The Accelerator of a run, in the run's own mixed precision.

Accelerate keeps one process-wide ``AcceleratorState``. A second ``Accelerator`` with
another mixed precision is refused ("restart your runtime"), and one created without a
precision silently takes the state's. Runs in one process (`attnlab compare --vary
train.mixed_precision=no,bf16`, TLM after a bf16 fine-tune, notebooks, tests) may differ
there, so ``run_accelerator`` drops the precision part of that state when it differs and
always names the run's precision; the distributed part (``PartialState``: process group,
rank) is kept. ``_reset_state`` is Accelerate's own (internal) reset, the one its test
suite uses.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator


def release_other_precision(mixed_precision: str) -> None:
    """Drop the process-wide precision state when it is not ``mixed_precision``."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision", mixed_precision) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def run_accelerator(mixed_precision: str = "no") -> Accelerator:
    """An Accelerator in ``mixed_precision`` ("no", "bf16", "fp16"), on the GPU when there
    is one, whatever an earlier run in this process used."""
    release_other_precision(mixed_precision)
    return Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
