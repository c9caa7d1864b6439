"""One explicit training loop on Hugging Face Accelerate.

Read top to bottom: build optimizer and schedule, (maybe) resume, then for each epoch a
seeded permutation of the training set, sharded across processes, micro-batches with
gradient accumulation, clipping, an optimizer step, logging, evaluation, checkpoints.
``accelerate launch`` / ``torchrun`` give multi-process DDP (CPU gloo or GPU) unchanged.

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
from safetensors.torch import load_model, save_model
from tqdm.auto import tqdm

from ..config import ExperimentConfig, with_optim_defaults
from .checkpoint import TrainerState, list_checkpoints, load_checkpoint, save_checkpoint

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")


@dataclass
class LoopParts:
    """What the loop needs from a recipe (components are passed in, not looked up).

    evaluate(model) -> metrics dict, run on the main process only.
    aux_loss(model) -> extra loss term or None (mechanism regularisers, Diff-Prune's L0).
    """

    model: torch.nn.Module
    train_features: Sequence[dict]
    collate: Callable[[list[dict]], dict]
    evaluate: Callable[[torch.nn.Module], dict[str, float]]
    main_metric: str
    greater_is_better: bool
    aux_loss: Callable[[torch.nn.Module], torch.Tensor | None] | None = None
    # id(parameter) -> its own optimizer options, e.g. Diff-Prune's log_alpha {"lr": 0.1}
    param_options: Callable[[torch.nn.Module], dict[int, dict]] | None = None


def use_fused_adamw(groups: list[dict], asked: bool | None) -> bool | None:
    """``optim.fused``, or when unset: the fused AdamW kernel wherever torch has one for
    every parameter (CPU, CUDA; floating dtypes), as Hugging Face's Trainer defaults to. It
    computes the same update as the per-tensor loop (tested to 1e-6), 4.6x faster on CPU
    (0.027 vs 0.126 s per step over MiniLM's 22.7 M parameters, docs/benchmarks.md)."""
    if asked is not None:
        return asked
    params = [p for g in groups for p in g["params"]]
    ok = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return True if params and ok else None


def param_groups(model: torch.nn.Module, weight_decay: float,
                 options: dict[int, dict] | None = None) -> list[dict]:
    """AdamW groups over trainable parameters: no decay on biases and LayerNorm weights.
    ``options`` (id(parameter) -> e.g. {"lr": 0.1, "weight_decay": 0.0}) puts those
    parameters in groups of their own; the schedule scales every group's lr alike."""
    options = options or {}
    decay, no_decay, own = [], [], {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in options:
            key = tuple(sorted(options[id(p)].items()))
            own.setdefault(key, []).append(p)
            continue
        (no_decay if any(k in name for k in NO_DECAY) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            *({"params": ps, "weight_decay": 0.0, **dict(key)} for key, ps in own.items())]


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, rank: int,
                  world: int, lengths: Sequence[int] | None = None) -> list[list[int]]:
    """This process's micro-batches of epoch ``epoch``: a (seed, epoch) permutation, sharded.

    lengths (one per example): group examples of similar length into the same batch, by
    Hugging Face's ``get_length_grouped_indices`` (a seeded permutation cut into megabatches
    of 50 global batches, fewer on small sets so there are at least 4, each sorted by
    length, the longest batch first); rank r takes every world-th index, so every
    process's batch k is cut from the same sorted run.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    if lengths is None:
        perm = torch.randperm(n, generator=g).tolist()
    else:
        from transformers.trainer_pt_utils import get_length_grouped_indices

        if len(lengths) != n:
            raise ValueError(f"{len(lengths)} lengths for {n} examples")
        perm = get_length_grouped_indices(list(lengths), batch_size * world, generator=g)
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
        keep = []
        for ln in self.path.read_text().splitlines():
            try:
                rec = json.loads(ln) if ln.strip() else None
            except json.JSONDecodeError:  # a line cut by the kill: dropped, it is replayed
                continue
            if rec is not None and rec.get("step", 0) <= step:
                keep.append(ln)
        self.path.write_text("".join(k + "\n" for k in keep))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record, default=float) + "\n")


def fit(cfg: ExperimentConfig, parts: LoopParts, accelerator, run_dir: Path,
        resume: bool = False, stop_after: int | None = None) -> TrainerState:
    """Train ``parts.model``; returns the final trainer state (best metric and history).

    stop_after: stop (as if killed) right after that optimizer step's checkpoint; used to
    test that ``resume`` reproduces an uninterrupted run.
    """
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    tc, oc = cfg.train, with_optim_defaults(cfg).optim
    rank, world = accelerator.process_index, accelerator.num_processes
    lengths = ([len(f["input_ids"]) for f in parts.train_features] if tc.group_by_length
               else None)
    n_batches = len(epoch_batches(len(parts.train_features), tc.batch_size, cfg.seed, 0, rank,
                                  world, lengths))
    if n_batches == 0:
        raise ValueError("the training set is empty (check task.train_limit / train_fraction)")
    steps_per_epoch = math.ceil(n_batches / tc.grad_accum)
    total = tc.max_steps or max(1, math.ceil(tc.epochs * steps_per_epoch))
    eval_every = tc.eval_every or steps_per_epoch
    save_every = tc.save_every or eval_every

    model = parts.model
    groups = param_groups(model, oc.weight_decay,
                          parts.param_options(model) if parts.param_options else None)
    optimizer = torch.optim.AdamW(groups, lr=oc.lr, betas=oc.betas, eps=oc.eps,
                                  fused=use_fused_adamw(groups, oc.fused))
    warmup = int(oc.warmup_ratio * total)
    if oc.schedule == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total)
    else:
        scheduler = get_constant_schedule_with_warmup(optimizer, warmup)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    trainable = [p for p in model.parameters() if p.requires_grad]

    state = TrainerState()
    log = MetricsLog(run_dir / "metrics.jsonl", accelerator.is_main_process)
    if resume and (ckpts := list_checkpoints(run_dir)):
        state = load_checkpoint(accelerator, ckpts[-1])
        log.truncate_after(state.step)
        accelerator.print(f"resumed from {ckpts[-1]} (step {state.step}/{total})")
    elif accelerator.is_main_process:  # a fresh start: nothing of an older run survives
        if log.path.exists():
            log.path.unlink()
        # an older run's checkpoints would be taken for this run's by a later --resume
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)

    # a terminal gets a live bar; a log file (nohup, CI) one line per 60 s, not one per step
    tty = sys.stderr.isatty()
    bar = tqdm(total=total, initial=state.step, desc=cfg.name, unit="step",
               disable=not accelerator.is_local_main_process, dynamic_ncols=tty,
               mininterval=0.1 if tty else 60.0)
    model.train()
    stop = _patience_spent(cfg, state)  # a run that stopped early stays stopped on resume
    running, t_start = 0.0, time.perf_counter()
    while state.step < total and not stop:
        batches = epoch_batches(len(parts.train_features), tc.batch_size, cfg.seed,
                                state.epoch, rank, world, lengths)
        for bi in range(state.batch_in_epoch, len(batches)):
            batch = parts.collate([parts.train_features[i] for i in batches[bi]])
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            sync = (bi + 1) % tc.grad_accum == 0 or bi == len(batches) - 1
            # micro-batches in this accumulation group: fewer in an epoch's last group, so
            # its update is their mean, not a fraction of it
            n_acc = min(tc.grad_accum, len(batches) - bi // tc.grad_accum * tc.grad_accum)
            with accelerator.autocast(), (nullcontext() if sync else accelerator.no_sync(model)):
                out = model(**batch)
                loss = out.loss
                extra = parts.aux_loss(accelerator.unwrap_model(model)) if parts.aux_loss else None
                if extra is not None:
                    loss = loss + extra
                accelerator.backward(loss / n_acc)
            running += loss.detach().float().item() / n_acc
            state.batch_in_epoch = bi + 1
            if state.batch_in_epoch == len(batches):  # epoch done: a checkpoint resumes the next
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if not sync:
                continue
            if oc.max_grad_norm is not None:
                accelerator.clip_grad_norm_(trainable, oc.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            bar.update(1)
            if state.step % tc.log_every == 0 or state.step == total:
                log.write({"step": state.step, "epoch": state.epoch, "loss": running,
                           "lr": scheduler.get_last_lr()[0]})
                bar.set_postfix(loss=f"{running:.4f}", refresh=False)  # shown at the next refresh
            running = 0.0
            if state.step % eval_every == 0 or state.step == total:
                state.train_seconds += time.perf_counter() - t_start
                stop = _evaluate(cfg, parts, accelerator, model, state, run_dir, log)
                t_start = time.perf_counter()
                model.train()
            if state.step % save_every == 0 or state.step == total or stop:
                save_checkpoint(accelerator, run_dir, state)
            if stop_after is not None and state.step >= stop_after:
                bar.close()
                return state
            if state.step >= total or stop:
                break
    bar.close()
    accelerator.wait_for_everyone()
    if tc.keep_best and (run_dir / "best.safetensors").exists():
        load_model(accelerator.unwrap_model(model), str(run_dir / "best.safetensors"),
                   strict=True)
    return state


def _evaluate(cfg, parts: LoopParts, accelerator, model, state: TrainerState, run_dir: Path,
              log: MetricsLog) -> bool:
    """Evaluate on the main process, keep the best weights; returns True to stop early."""
    metrics: list[Any] = [None]
    if accelerator.is_main_process:
        inner = accelerator.unwrap_model(model)
        inner.eval()
        with torch.no_grad():
            metrics[0] = parts.evaluate(inner)
    from accelerate.utils import broadcast_object_list

    metrics = broadcast_object_list(metrics)
    result = metrics[0]
    value = result[parts.main_metric]
    record = {"step": state.step, "epoch": state.epoch, "eval": result}
    state.evals.append(record)
    log.write(record)
    if improved(value, state.best_metric, parts.greater_is_better):
        state.best_metric, state.best_step = value, state.step
        state.evals_without_improvement = 0
        if accelerator.is_main_process and cfg.train.keep_best:
            tmp = run_dir / ".best.safetensors.tmp"
            save_model(accelerator.unwrap_model(model), str(tmp))
            tmp.replace(run_dir / "best.safetensors")
    else:
        state.evals_without_improvement += 1
    accelerator.wait_for_everyone()
    return _patience_spent(cfg, state)


def _patience_spent(cfg, state: TrainerState) -> bool:
    """Early stopping: ``early_stopping_patience`` evaluations in a row without improvement."""
    patience = cfg.train.early_stopping_patience
    return patience is not None and state.evals_without_improvement >= patience
