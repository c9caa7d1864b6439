"""Atomic, resumable checkpoints.

A checkpoint is a folder ``<run>/checkpoints/step-<N>/`` written by Accelerate's
``save_state`` (model weights as safetensors, optimizer, scheduler and every RNG state)
plus ``trainer_state.json`` (step, epoch, position in the epoch, best metric, history).
It is written into a temporary sibling folder and renamed into place, so an interrupted
save never leaves a half-written checkpoint that ``--resume`` would pick up.

Weights shared under several names (a plan's cross-layer ties: ``luna``'s P,
``linformer(share='layerwise')``'s E; a masked-LM decoder tied to the embeddings) are one
tensor: safetensors stores it once and Accelerate warns, at every checkpoint, that it
removed the other names. The resumed run ties them again (the plan, the model's own
``tie_weights``) and ends as the uninterrupted one (tests/train/test_resume.py: luna under
full tuning and Diff-Prune, masked LM), so that warning is left out of the console.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..io import write_json

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """Where training stands; enough to continue exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch (0-based)
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed
    best_metric: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    train_seconds: float = 0.0
    evals: list[dict[str, Any]] = field(default_factory=list)
    # the blocked engine's chunk size (ATTNLAB_CHUNK_ELEMS): sparse patterns draw their
    # attention-dropout masks per chunk, so a resumed run must chunk alike (None: not recorded)
    chunk_elems: int | None = None
    # the steps since the last metrics.jsonl line: their count and summed loss / aux loss
    log_steps: int = 0
    log_loss: float = 0.0
    log_aux: float | None = None


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


class _NoSharedTensorNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)  # Accelerate prefixes the process: "[RANK 0] Removed ..."
        return not ("Removed shared tensor" in msg and "while saving" in msg)


@contextmanager
def _quiet_shared_tensors():
    """Drop Accelerate's "Removed shared tensor ... while saving" notice (module doc)."""
    logger = logging.getLogger("accelerate.utils.other")
    notice = _NoSharedTensorNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def save_checkpoint(accelerator, run_dir: Path, state: TrainerState, keep: int = 1) -> Path:
    """Save model/optimizer/scheduler/RNG + trainer state atomically; keep the newest ``keep``."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = final.with_name(f".{final.name}.tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    with _quiet_shared_tensors():
        accelerator.save_state(str(tmp), safe_serialization=True)
    if accelerator.is_main_process:
        write_json(tmp / STATE_FILE, asdict(state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (those with a trainer state), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())


def load_checkpoint(accelerator, path: Path) -> TrainerState:
    """Restore model/optimizer/scheduler/RNG from ``path``; return its trainer state.

    Refuses (``ConfigError``) a checkpoint taken with another ``ATTNLAB_CHUNK_ELEMS``: the
    run would go on with other dropout masks and not reach the uninterrupted result."""
    state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    check_chunking(state, path)
    accelerator.load_state(str(path))
    return state


def current_chunk_elems() -> int:
    from ..mechanisms import chunk_elems  # the one home of the setting

    return chunk_elems()


def check_chunking(state: TrainerState, path: Path) -> None:
    """A checkpoint resumes only under the chunk size it was trained with."""
    now = current_chunk_elems()
    if state.chunk_elems is not None and state.chunk_elems != now:
        from ..config import ConfigError

        raise ConfigError(
            f"{path} was trained with ATTNLAB_CHUNK_ELEMS={state.chunk_elems}, this process "
            f"has {now}: set ATTNLAB_CHUNK_ELEMS={state.chunk_elems} to resume to the same "
            "result (sparse patterns draw their dropout masks per chunk)")
