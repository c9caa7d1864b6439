"""One explicit training loop on Hugging Face Accelerate.

Read top to bottom: (maybe) resume, then for each epoch a seeded permutation of the training
set, sharded across processes, micro-batches with gradient accumulation, clipping, an
optimizer step, logging, evaluation, checkpoints. ``accelerate launch`` / ``torchrun`` give
multi-process DDP (CPU gloo or GPU) unchanged.

The loop takes resolved parts (:class:`LoopParts`: model, optimizer and schedule from
``train.optim.build_optimizer``, data, evaluation and loss callbacks) and its own settings
(:class:`LoopSettings`); it knows nothing of experiment configs or tuners.

Exact resume: the data order of epoch e depends only on (seed, e); checkpoints hold the
model, optimizer, scheduler, every RNG state and the position in the epoch, so a resumed
run replays the same batches with the same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from safetensors.torch import load_model, save_model
from tqdm.auto import tqdm
from transformers.trainer_pt_utils import get_length_grouped_indices

from ..io import append_jsonl, atomic_path, atomic_write, read_jsonl
from .checkpoint import (
    TrainerState,
    current_chunk_elems,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


@dataclass(frozen=True)
class LoopSettings:
    """The loop's own settings (the ``train`` section of an experiment config, resolved).

    name: progress-bar label.  seed: data order.  batch_size: examples per micro-batch and
    process.  grad_accum: micro-batches per optimizer step.  epochs / max_steps: length
    (max_steps wins).  eval_every / save_every: optimizer steps between evaluations /
    checkpoints (None: once per epoch / at evaluations).  log_every: steps between
    metrics.jsonl lines (each line: the mean loss of the steps since the last one, as
    Hugging Face's Trainer logs, and the schedule's lr after its step, i.e. the next step's:
    docs/decisions.md).  early_stopping_patience:
    evaluations without improvement before stopping.  keep_best: restore the best
    evaluated weights at the end.  group_by_length: batches of similar lengths.
    max_grad_norm: gradient clipping (None: off).
    """

    name: str
    seed: int
    batch_size: int
    grad_accum: int = 1
    epochs: float = 3.0
    max_steps: int | None = None
    eval_every: int | None = None
    save_every: int | None = None
    log_every: int = 10
    early_stopping_patience: int | None = None
    keep_best: bool = True
    group_by_length: bool = False
    max_grad_norm: float | None = 1.0


@dataclass
class LoopParts:
    """What the loop works on (components are passed in, not looked up).

    optimizer, scheduler: from ``train.optim.build_optimizer`` over :func:`plan_steps`'s total.
    evaluate(model) -> metrics dict, run on the main process only.
    aux_loss(model) -> extra loss term or None (mechanism regularisers, Diff-Prune's L0).
    before_step(model, step) -> None, called before each micro-batch with the 0-based index
    of the optimizer step it belongs to (a tuner's per-step schedule: MAE's gate-only and
    expert steps switch ``requires_grad``; parameters left without a gradient are skipped
    by the optimizer). Under multi-process DDP, switching needs ``find_unused_parameters``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_features: Sequence[dict]
    collate: Callable[[list[dict]], dict]
    evaluate: Callable[[torch.nn.Module], dict[str, float]]
    main_metric: str
    greater_is_better: bool
    aux_loss: Callable[[torch.nn.Module], torch.Tensor | None] | None = None
    before_step: Callable[[torch.nn.Module, int], None] | None = None


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer steps, and when to evaluate and save (see :func:`plan_steps`)."""

    steps_per_epoch: int
    total: int
    eval_every: int
    save_every: int
    lengths: list[int] | None  # per example, when batches are grouped by length


def plan_steps(settings: LoopSettings, features: Sequence[dict], rank: int = 0,
               world: int = 1) -> StepPlan:
    """The step counts of a run over ``features`` (this process's share of each epoch)."""
    lengths = ([len(f["input_ids"]) for f in features] if settings.group_by_length else None)
    n_batches = len(epoch_batches(len(features), settings.batch_size, settings.seed, 0, rank,
                                  world, lengths, settings.grad_accum))
    if n_batches == 0:
        raise ValueError("the training set is empty (check task.train_limit / train_fraction)")
    per_epoch = math.ceil(n_batches / settings.grad_accum)
    total = settings.max_steps or max(1, math.ceil(settings.epochs * per_epoch))
    eval_every = settings.eval_every or per_epoch
    return StepPlan(per_epoch, total, eval_every, settings.save_every or eval_every, lengths)


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, rank: int,
                  world: int, lengths: Sequence[int] | None = None,
                  accum: int = 1) -> list[list[int]]:
    """This process's micro-batches of epoch ``epoch``: a (seed, epoch) permutation, sharded.

    lengths (one per example): group examples of similar length into the same batch, by
    Hugging Face's ``get_length_grouped_indices`` over the examples of one optimizer step
    (batch_size x accum x world; the Trainer's ``LengthGroupedSampler`` takes batch size x
    gradient accumulation): a seeded permutation cut into megabatches of 50 steps'
    examples, fewer on small sets so there are at least 4, each sorted by length, the
    longest example first; rank r takes every world-th index, so every process's batch k
    is cut from the same sorted run.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    if lengths is None:
        perm = torch.randperm(n, generator=g).tolist()
    else:
        if len(lengths) != n:
            raise ValueError(f"{len(lengths)} lengths for {n} examples")
        perm = get_length_grouped_indices(list(lengths), batch_size * accum * world,
                                          generator=g)
    perm = perm[: len(perm) - len(perm) % world] if world > 1 else perm
    mine = perm[rank::world]
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def improved(value: float, best: float | None, greater_is_better: bool) -> bool:
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value > best if greater_is_better else value < best


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended by the main process."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint (they will be replayed)."""
        if not (self.enabled and self.path.exists()):
            return
        # a line cut by the kill is dropped too: it is replayed
        keep = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            append_jsonl(self.path, record, default=float)


def fit(parts: LoopParts, settings: LoopSettings, plan: StepPlan, accelerator,
        run_dir: Path, resume: bool = False, stop_after: int | None = None) -> TrainerState:
    """Train ``parts.model``; returns the final trainer state (best metric and history).

    stop_after: stop (as if killed) right after that optimizer step's checkpoint; used to
    test that ``resume`` reproduces an uninterrupted run.
    """
    model, optimizer = accelerator.prepare(parts.model, parts.optimizer)
    accelerator.register_for_checkpointing(parts.scheduler)
    trainable = [p for p in model.parameters() if p.requires_grad]
    rank, world = accelerator.process_index, accelerator.num_processes
    log = MetricsLog(run_dir / "metrics.jsonl", accelerator.is_main_process)
    state = start_state(accelerator, run_dir, log, resume, plan.total)
    bar = _progress_bar(settings.name, plan.total, state.step, accelerator)
    model.train()
    stop = _patience_spent(settings, state)  # a run that stopped early stays stopped on resume
    running, t_start = 0.0, time.perf_counter()  # running: this optimizer step's loss
    running_aux: float | None = None  # aux-loss part of ``running`` (None: no aux loss)
    while state.step < plan.total and not stop:
        batches = epoch_batches(len(parts.train_features), settings.batch_size, settings.seed,
                                state.epoch, rank, world, plan.lengths, settings.grad_accum)
        for bi in range(state.batch_in_epoch, len(batches)):
            accum = settings.grad_accum
            sync = (bi + 1) % accum == 0 or bi == len(batches) - 1
            # micro-batches in this accumulation group: fewer in an epoch's last group, so
            # its update is their mean, not a fraction of it
            n_acc = min(accum, len(batches) - bi // accum * accum)
            if parts.before_step is not None:
                parts.before_step(accelerator.unwrap_model(model), state.step)
            loss_share, aux_share = _micro_step(parts, model, accelerator, batches[bi], n_acc,
                                                sync)
            running += loss_share
            if aux_share is not None:
                running_aux = (running_aux or 0.0) + aux_share
            state.batch_in_epoch = bi + 1
            if state.batch_in_epoch == len(batches):  # epoch done: a checkpoint resumes the next
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if not sync:
                continue
            optimizer_step(accelerator, optimizer, parts.scheduler, trainable,
                            settings.max_grad_norm)
            state.step += 1
            bar.update(1)
            state.log_steps, state.log_loss = state.log_steps + 1, state.log_loss + running
            if running_aux is not None:
                state.log_aux = (state.log_aux or 0.0) + running_aux
            if state.step % settings.log_every == 0 or state.step == plan.total:
                _log_train(log, bar, state, parts.scheduler.get_last_lr()[0])
            running, running_aux = 0.0, None
            if state.step % plan.eval_every == 0 or state.step == plan.total:
                state.train_seconds += time.perf_counter() - t_start
                stop = _evaluate(parts, settings, accelerator, model, state, run_dir, log)
                t_start = time.perf_counter()
                model.train()
            if state.step % plan.save_every == 0 or state.step == plan.total or stop:
                save_checkpoint(accelerator, run_dir, state)
            if stop_after is not None and state.step >= stop_after:
                bar.close()
                return state
            if state.step >= plan.total or stop:
                break
    bar.close()
    accelerator.wait_for_everyone()
    if settings.keep_best and (run_dir / "best.safetensors").exists():
        load_model(accelerator.unwrap_model(model), str(run_dir / "best.safetensors"),
                   strict=True)
    return state


def optimizer_step(accelerator, optimizer, scheduler, trainable: list,
                    max_grad_norm: float | None) -> None:
    """Clip (after unscaling, in Accelerate), step, advance the schedule. An update the fp16
    loss scaler skipped (inf/NaN gradients) leaves the schedule where it is, as in
    Accelerate's contract and Hugging Face's Trainer."""
    if max_grad_norm is not None:
        accelerator.clip_grad_norm_(trainable, max_grad_norm)
    optimizer.step()
    if not accelerator.optimizer_step_was_skipped:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _log_train(log: MetricsLog, bar, state: TrainerState, lr: float) -> None:
    """One metrics.jsonl line: the mean loss (and aux loss) of the steps since the last
    line, and ``lr``; the window lives in ``state``, so a resumed run logs what an
    uninterrupted one does."""
    loss = state.log_loss / state.log_steps
    record = {"step": state.step, "epoch": state.epoch, "loss": loss, "lr": lr}
    if state.log_aux is not None:  # the aux part of "loss" (already weighted)
        record["aux_loss"] = state.log_aux / state.log_steps
    log.write(record)
    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # shown at the next refresh
    state.log_steps, state.log_loss, state.log_aux = 0, 0.0, None


def _micro_step(parts: LoopParts, model, accelerator, indices: list[int], n_acc: int,
                sync: bool) -> tuple[float, float | None]:
    """Forward and backward of one micro-batch (loss / n_acc); returns its shares of the
    total loss and of the auxiliary loss in it (None without one)."""
    batch = parts.collate([parts.train_features[i] for i in indices])
    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
    with accelerator.autocast(), (nullcontext() if sync else accelerator.no_sync(model)):
        loss = model(**batch).loss
        extra = parts.aux_loss(accelerator.unwrap_model(model)) if parts.aux_loss else None
        if extra is not None:
            loss = loss + extra
        accelerator.backward(loss / n_acc)
    aux = None if extra is None else extra.detach().float().item() / n_acc
    return loss.detach().float().item() / n_acc, aux


def start_state(accelerator, run_dir: Path, log: MetricsLog, resume: bool, total: int,
                what: str = "") -> TrainerState:
    """The state to start from: the last checkpoint (``resume``), or a fresh one, in which
    case nothing of an older run in the folder survives. ``what`` names the stage in the
    resume message (e.g. "stage 1 ")."""
    if resume and (ckpts := list_checkpoints(run_dir)):
        state = load_checkpoint(accelerator, ckpts[-1])
        log.truncate_after(state.step)
        accelerator.print(f"resumed {what}from {ckpts[-1]} (step {state.step}/{total})")
        return state
    if accelerator.is_main_process:
        log.path.unlink(missing_ok=True)
        # an older run's checkpoints would be taken for this run's by a later --resume, and
        # its best weights restored at the end of a run none of whose evaluations counted
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        (run_dir / "best.safetensors").unlink(missing_ok=True)
    return TrainerState(chunk_elems=current_chunk_elems())


def _progress_bar(name: str, total: int, initial: int, accelerator):
    """A live bar on a terminal; in a log file (nohup, CI) one line per 60 s."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=name, unit="step",
                disable=not accelerator.is_local_main_process, dynamic_ncols=tty,
                mininterval=0.1 if tty else 60.0)


def _evaluate(parts: LoopParts, settings: LoopSettings, accelerator, model,
              state: TrainerState, run_dir: Path, log: MetricsLog) -> bool:
    """Evaluate on the main process, keep the best weights; returns True to stop early."""
    metrics: list[Any] = [None]
    if accelerator.is_main_process:
        inner = accelerator.unwrap_model(model)
        inner.eval()
        with torch.no_grad():
            metrics[0] = parts.evaluate(inner)
    metrics = broadcast_object_list(metrics)
    result = metrics[0]
    value = result[parts.main_metric]
    record = {"step": state.step, "epoch": state.epoch, "eval": result}
    state.evals.append(record)
    log.write(record)
    if improved(value, state.best_metric, parts.greater_is_better):
        state.best_metric, state.best_step = value, state.step
        state.evals_without_improvement = 0
        if accelerator.is_main_process and settings.keep_best:
            with atomic_path(run_dir / "best.safetensors") as tmp:
                save_model(accelerator.unwrap_model(model), str(tmp))
    else:
        state.evals_without_improvement += 1
    accelerator.wait_for_everyone()
    return _patience_spent(settings, state)


def _patience_spent(settings: LoopSettings, state: TrainerState) -> bool:
    """Early stopping: ``early_stopping_patience`` evaluations in a row without improvement."""
    patience = settings.early_stopping_patience
    return patience is not None and state.evals_without_improvement >= patience
