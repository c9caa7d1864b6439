"""``attnlab run``: fine-tune (or train from scratch) one config on one task, top to bottom.

1. resolve the config and make ``runs/<name>/`` (config.yaml, plan.json);
2. load the task's train and eval splits (seeded subset if asked);
3. build the model with the task's head (embedded MiniLM, a path, or ``scratch:SIZE``);
4. apply the attention plan, then the tuner (warning when LoRA's targets include a Q or K
   projection no head of its layer reads, ``hf.unread``);
5. train with ``train.loop.fit`` (Accelerate), evaluating on the dev split; tuners whose
   ``finalize`` changes the model (Diff-Prune's magnitude pruning) finalize the best model,
   which is then re-evaluated: that is the run's result and what is saved;
6. write ``summary.json`` (metrics, parameters trained, time per step, peak memory; for
   ``wo_sparse`` the heads' W_O subspace overlap before and after training) and the model
   (``model/`` with plan.json, or only the tuned weights for adapters/peft).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils import set_seed

from ..analysis.overlap import format_overlap, model_overlap
from ..config import (
    ConfigError,
    ExperimentConfig,
    resolved_yaml,
    run_config_changes,
    with_optim_defaults,
)
from ..hf.backend import aux_loss as mechanism_aux_loss
from ..hf.unread import unread_projections, untrained_warning
from ..io import write_json
from ..tasks import get_task
from ..train.accel import run_accelerator
from ..train.checkpoint import TrainerState, list_checkpoints
from ..train.loop import LoopParts, LoopSettings, fit, plan_steps
from ..train.memory import peak_rss_mb, reset_peak_rss
from ..train.optim import OptimSettings, build_optimizer
from ..tuning.accounting import count_parameters
from ..tuning.base import TaskInfo, resolve_tuning, save_tuned
from .evaluation import degenerate_warning, eval_splits_of, make_evaluator, subset
from .head_select import Selection, resolve_run_plan
from .preflight import nonempty, preflight
from .rundir import finished_summary, now, provenance, prune_finished
from .runmodel import apply_run_plan, build_model, load_run_model, task_kind
from .summary import RunSummary, write_summary

# Tuners whose runs store the heads' W_O subspace overlap before and after training
# (summary.json "head_overlap", attnlab.analysis.overlap).
OVERLAP_TUNERS = ("wo_sparse",)


def check_resumable(run_dir: Path, cfg: ExperimentConfig) -> None:
    """Refuse to continue checkpoints written under another config: the result would be
    neither run. (No checkpoint: nothing to continue, the run starts fresh.)"""
    if not (list_checkpoints(run_dir) or list_checkpoints(run_dir / "masked")):
        return
    changes = run_config_changes(run_dir, cfg)
    if changes:
        raise ConfigError(
            f"cannot resume {run_dir}: its checkpoints were written under another config ("
            + "; ".join(changes) + "). Give the run another name or output_dir, or delete "
            f"{run_dir} to start it again.")


def run_experiment(cfg: ExperimentConfig, resume: bool = False,
                   stop_after: int | None = None) -> dict[str, Any]:
    """Train and evaluate ``cfg``; returns (and writes) the run summary as a dict.

    The run folder is ``cfg.run_dir`` as given (``rundir.fresh_run`` picks a new one for the
    command line). A run that raises leaves ``summary.json`` with ``status: failed`` and the
    error (``interrupted`` for Ctrl-C, and for SIGTERM under the CLI), then re-raises. A
    finished run deletes its checkpoints and best-model copy unless
    ``train.keep_checkpoints``. With ``resume``, a run that has finished is read back, not
    trained again (refused if ``cfg`` asks for other settings: ``rundir.finished_summary``),
    and checkpoints of another config are refused (``check_resumable``); neither refusal
    touches the run's files.
    """
    cfg = with_optim_defaults(cfg)  # config.yaml and resume checks see the values used
    preflight(cfg)  # what `attnlab validate` refuses, refused before anything is loaded
    cfg, selection = resolve_run_plan(cfg)  # class:/score selectors -> explicit heads
    if resume:  # checked before the try: a refusal must not mark the run it protects failed
        done = finished_summary(cfg)
        if done is not None:  # nothing to continue: report it, do not train it again
            print(f"{cfg.run_dir} has finished: nothing to resume (its summary follows)")
            return {**done.to_dict(), "is_main_process": os.environ.get("RANK", "0") == "0"}
        check_resumable(cfg.run_dir, cfg)
    started, t0 = now(), time.perf_counter()
    try:
        return _run_experiment(cfg, resume, stop_after, started, t0, selection)
    except BaseException as e:
        if cfg.run_dir.is_dir():
            write_summary(cfg.run_dir, RunSummary(
                name=cfg.name, task=cfg.task.name, seed=cfg.seed, error=f"{type(e).__name__}: {e}",
                status="interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                interrupted=isinstance(e, KeyboardInterrupt),
                **provenance(), started=started, finished=now(),
                wall_seconds=time.perf_counter() - t0))
        raise


def _run_experiment(cfg: ExperimentConfig, resume: bool, stop_after: int | None,
                    started: str, t0: float, selection: Selection | None) -> dict[str, Any]:
    reset_peak_rss()  # peak memory of this run, not of earlier runs in the process
    accelerator = run_accelerator(cfg.train.mixed_precision)
    if selection is not None and accelerator.is_main_process:
        print(selection)  # the heads the plan's class:/score selectors matched
    run = _prepare(cfg, accelerator)
    state = _fit_stage(cfg, run, run.model, accelerator, cfg.run_dir, resume, stop_after,
                       loop_settings(cfg), optim_settings(cfg), run.aux_loss)
    end = _finalize(cfg, run, state, accelerator, resume, stop_after)
    summary = _summary(cfg, run, state, end, accelerator.num_processes, started)
    if accelerator.is_main_process:
        save_tuned(accelerator.unwrap_model(run.model), run.tuner,
                   cfg.run_dir / "tuned.safetensors")
        if summary.status == "finished" and not cfg.train.keep_checkpoints:
            prune_finished(cfg.run_dir)
        if summary.head_overlap is not None:
            print(format_overlap(summary.head_overlap["before"], summary.head_overlap["after"]))
        if summary.degenerate:  # loud, at the end of the run's output
            print(f"\n*** WARNING ({cfg.run_dir}): {summary.degenerate}\n", file=sys.stderr)
        summary = replace(summary, finished=now(), wall_seconds=time.perf_counter() - t0)
        write_summary(cfg.run_dir, summary)  # last: the run is complete
    accelerator.wait_for_everyone()
    return {**summary.to_dict(), "is_main_process": accelerator.is_main_process}


@dataclass
class _Run:
    """What a run trains, built from its config by :func:`_prepare`."""

    task: Any
    tokenizer: Any
    model: torch.nn.Module
    plan: Any  # Plan or None
    report: Any  # SurgeryReport or None
    tuner: Any
    tuner_cfg: Any
    train_features: list
    collate: Any
    evaluate: Any
    main_metric: str
    params: dict[str, Any]
    overlap_before: dict[str, Any] | None = None  # OVERLAP_TUNERS: W_O overlap before training

    def aux_loss(self, model: torch.nn.Module) -> torch.Tensor | None:
        """The mechanisms' regularisers plus the tuner's (Diff-Prune's L0), or None."""
        extra = [x for x in (mechanism_aux_loss(model), self.tuner.aux_loss(model))
                 if x is not None]
        return cast(torch.Tensor, sum(extra)) if extra else None  # non-empty: a Tensor


def _prepare(cfg: ExperimentConfig, accelerator) -> _Run:
    """Data (first: a run that cannot start writes nothing), the run folder, the model with
    its plan and tuner, the encoded features and the evaluator."""
    task = get_task(cfg.task.name)
    train_split = cfg.task.train_split or task.train_split
    train_ex = subset(nonempty(task.load(train_split, cfg.task.data_dir), cfg, train_split),
                      cfg.task.train_fraction, cfg.task.train_limit, cfg.seed)
    eval_splits = eval_splits_of(cfg, task)
    eval_ex = {s: nonempty(task.load(s, cfg.task.data_dir), cfg, s)[: cfg.task.eval_limit]
               for s in eval_splits}
    if accelerator.is_main_process:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "config.yaml").write_text(resolved_yaml(cfg))
    set_seed(cfg.seed)  # model init (new heads) depends only on the seed
    model, tok = build_model(cfg, task)
    plan, report = apply_run_plan(model, cfg)
    unread = unread_projections(model, report.unread if report is not None else {})
    tuner, tcfg = resolve_tuning(cfg.tuning.method)
    model = tuner.apply(model, tcfg, task=TaskInfo.from_tokenizer(tok, task_kind(task)))
    # tuners that adapt the modules a user names: the targets are a choice (hf.unread)
    dead = untrained_warning(model, unread) if hasattr(tcfg, "target_modules") else None
    if dead is not None and accelerator.is_main_process:
        warnings.warn(f"{tcfg.name}: {dead}", stacklevel=2)
    if accelerator.is_main_process:
        write_json(cfg.run_dir / "plan.json", {"plan": plan.to_list() if plan else []})
    overlap = model_overlap(model) if tcfg.name in OVERLAP_TUNERS else None
    max_len = cfg.model.max_length
    splits = {s: (ex, task.encode(ex, tok, max_len)) for s, ex in eval_ex.items()}
    return _Run(
        task=task, tokenizer=tok, model=model, plan=plan, report=report, tuner=tuner,
        tuner_cfg=tcfg, train_features=task.encode(train_ex, tok, max_len),
        collate=task.collator(tok, seed=cfg.seed),
        evaluate=make_evaluator(task, splits, tok, cfg.seed, cfg.eval.batch_size),
        main_metric=(task.main_metric if len(splits) == 1
                     else f"{eval_splits[0]}/{task.main_metric}"),
        params=count_parameters(model, tuner), overlap_before=overlap)


def loop_settings(cfg: ExperimentConfig) -> LoopSettings:
    t = cfg.train
    return LoopSettings(
        name=cfg.name, seed=cfg.seed, batch_size=t.batch_size, grad_accum=t.grad_accum,
        epochs=t.epochs, max_steps=t.max_steps, eval_every=t.eval_every,
        save_every=t.save_every, log_every=t.log_every,
        early_stopping_patience=t.early_stopping_patience, keep_best=t.keep_best,
        group_by_length=t.group_by_length, max_grad_norm=cfg.optim.max_grad_norm)


def optim_settings(cfg: ExperimentConfig) -> OptimSettings:
    o = with_optim_defaults(cfg).optim
    # with_optim_defaults fills every None of these
    assert o.lr is not None and o.weight_decay is not None and o.warmup_ratio is not None
    return OptimSettings(lr=float(o.lr), weight_decay=float(o.weight_decay),
                         warmup_ratio=float(o.warmup_ratio), schedule=str(o.schedule),
                         betas=o.betas, eps=o.eps, fused=o.fused)


def _fit_stage(cfg: ExperimentConfig, run: _Run, model: torch.nn.Module, accelerator,
               run_dir: Path, resume: bool, stop_after: int | None, settings: LoopSettings,
               optim: OptimSettings, aux_loss) -> TrainerState:
    """One training stage of ``model``: its step plan, a fresh optimizer and schedule, fit."""
    steps = plan_steps(settings, run.train_features, accelerator.process_index,
                       accelerator.num_processes)
    optimizer, scheduler = build_optimizer(model, optim, steps.total,
                                           run.tuner.param_options(model))
    parts = LoopParts(model=model, optimizer=optimizer, scheduler=scheduler,
                      train_features=run.train_features, collate=run.collate,
                      evaluate=run.evaluate, main_metric=run.main_metric,
                      greater_is_better=run.task.greater_is_better, aux_loss=aux_loss,
                      before_step=run.tuner.before_step)
    return fit(parts, settings, steps, accelerator, run_dir, resume=resume,
               stop_after=stop_after)


@dataclass
class _End:
    """How training ended: interrupted, and (tuners with a finalize stage) the finalized
    model's evaluation and the fixed-mask stage's state."""

    interrupted: bool
    finalized: dict[str, float] | None = None
    pruned: dict[str, float] | None = None
    masked: TrainerState | None = None


def _finalize(cfg: ExperimentConfig, run: _Run, state: TrainerState, accelerator,
              resume: bool, stop_after: int | None) -> _End:
    """Diff-Prune: prune the (best) model to its target sparsity, then (epochs > 0) train
    the kept entries under the fixed mask; what is saved and what `attnlab eval` re-measures
    is that final model, so its metric is the run's result. Its second stage's checkpoints
    and metrics go to ``run_dir/masked/``, so ``--resume`` continues it."""
    interrupted = stop_after is not None and state.step >= stop_after
    stage = run.tuner.finalize_stage(run.tuner_cfg)
    if stage is None or interrupted:
        return _End(interrupted)
    model = run.model = accelerator.unwrap_model(run.model)
    run.tuner.finalize(model)
    model.eval()
    with torch.no_grad():
        pruned = run.evaluate(model)
    run.params = count_parameters(model, run.tuner)
    if stage.epochs <= 0:
        return _End(False, pruned, pruned)
    later = None if stop_after is None else max(stop_after - state.step, 0)
    if accelerator.is_main_process:
        (cfg.run_dir / "masked").mkdir(parents=True, exist_ok=True)
    optim = optim_settings(cfg)
    masked = _fit_stage(cfg, run, model, accelerator, cfg.run_dir / "masked", resume, later,
                        replace(loop_settings(cfg), epochs=stage.epochs, max_steps=None),
                        replace(optim, lr=optim.lr if stage.lr is None else stage.lr), None)
    best = next((e["eval"] for e in masked.evals if e["step"] == masked.best_step), pruned)
    return _End(later is not None and masked.step >= later, best, pruned, masked)


def _summary(cfg: ExperimentConfig, run: _Run, state: TrainerState, end: _End,
             num_processes: int, started: str) -> RunSummary:
    best: dict[str, float] = next(
        (e["eval"] for e in state.evals if e["step"] == state.best_step), {})
    masked_steps = end.masked.step if end.masked is not None else 0
    seconds = state.train_seconds + (end.masked.train_seconds if end.masked else 0.0)
    final = end.finalized
    finalized = final is not None
    overlap = None
    if run.overlap_before is not None:
        overlap = {"before": run.overlap_before, "after": model_overlap(run.model)}
    return RunSummary(
        name=cfg.name, task=run.task.name, seed=cfg.seed,
        status="interrupted" if end.interrupted else "finished",
        plan=run.plan.to_list() if run.plan else [], tuning=run.tuner_cfg.spec(),
        main_metric=run.main_metric, greater_is_better=run.task.greater_is_better,
        best_metric=(final.get(run.main_metric, state.best_metric) if final is not None
                     else state.best_metric),
        best_step=(state.best_step if end.masked is None
                   else state.step + (end.masked.best_step or 0)),
        best_eval=final if final is not None else best,
        before_finalize=({"best_metric": state.best_metric, "best_eval": best}
                         if finalized else None),
        pruned_eval=end.pruned, masked_steps=masked_steps if end.masked else None,
        final_eval=state.evals[-1]["eval"] if state.evals else {},
        steps=state.step + masked_steps, train_examples=len(run.train_features),
        train_seconds=seconds, seconds_per_step=seconds / max(state.step + masked_steps, 1),
        peak_rss_mb=peak_rss_mb(), params=run.params,
        surgery=run.report.to_dict() if run.report is not None else None,
        head_overlap=overlap, interrupted=end.interrupted, num_processes=num_processes,
        degenerate=degenerate_warning(run.evaluate.one_class, state.evals, state.best_step,
                                      state.step, float(cfg.optim.lr or 0.0),
                                      by_steps=cfg.train.max_steps is not None),
        **provenance(), started=started)


def evaluate_run(run_dir: str | Path, data_dir: str | None = None) -> dict[str, float]:
    """Rebuild a finished run from its config, plan and tuned weights; evaluate on dev."""
    model, tok, cfg = load_run_model(run_dir)
    task = get_task(cfg.task.name)
    d = data_dir if data_dir is not None else cfg.task.data_dir
    eval_splits = eval_splits_of(cfg, task)
    splits = {}
    for s in eval_splits:
        ex = task.load(s, d)[: cfg.task.eval_limit]
        splits[s] = (ex, task.encode(ex, tok, cfg.model.max_length))
    evaluate = make_evaluator(task, splits, tok, cfg.seed, cfg.eval.batch_size)
    with torch.no_grad():
        return evaluate(model)
