"""``attnlab run``: fine-tune (or train from scratch) one config on one task, top to bottom.

1. resolve the config and make ``runs/<name>/`` (config.yaml, plan.json);
2. load the task's train and eval splits (seeded subset if asked);
3. build the model with the task's head (embedded MiniLM, a path, or ``scratch:SIZE``);
4. apply the attention plan, then the tuner;
5. train with ``train.loop.fit`` (Accelerate), evaluating on the dev split; tuners whose
   ``finalize`` changes the model (Diff-Prune's magnitude pruning) finalize the best model,
   which is then re-evaluated: that is the run's result and what is saved;
6. write ``summary.json`` (metrics, parameters trained, time per step, peak memory) and
   the model (``model/`` with plan.json, or only the tuned weights for adapters/peft).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..config import (
    ConfigError,
    ExperimentConfig,
    resolved_yaml,
    run_config_changes,
    with_optim_defaults,
)
from ..io import write_json
from ..train.checkpoint import list_checkpoints
from ..train.loop import LoopParts, fit
from ..train.memory import peak_rss_mb, reset_peak_rss
from .preflight import preflight
from .rundir import now, provenance, prune_finished

AUTO_CLASSES = {
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "masked-lm": "AutoModelForMaskedLM",
}


def task_kind(task) -> str:
    """Input layout for tuners: single / pair / ner / qa / other."""
    if task.head == "token-classification":
        return "ner"
    if task.head == "question-answering":
        return "qa"
    if task.head == "sequence-classification":
        return "pair" if len(getattr(task, "text_columns", ())) > 1 else "single"
    return "other"


def build_model(cfg: ExperimentConfig, task) -> tuple[torch.nn.Module, Any]:
    """(model with the task's head, tokenizer) from ``cfg.model``; heads are new (random)."""
    import transformers

    from ..models import encoder_config, load_default_model

    name, head = cfg.model.name, task.head
    id2label = dict(enumerate(task.label_names)) if task.label_names else None
    num_labels = max(task.num_labels, 1)
    if name == "default":
        model, tok = load_default_model(head, num_labels=num_labels, id2label=id2label,
                                        attn_implementation=cfg.model.attn_implementation)
    elif name.startswith("scratch:"):
        _, tok = load_default_model("base")
        config = encoder_config(name.split(":", 1)[1], num_labels=num_labels)
        if id2label:
            config.id2label, config.label2id = id2label, {v: k for k, v in id2label.items()}
        auto = getattr(transformers, AUTO_CLASSES[head])
        model = auto.from_config(config, attn_implementation=cfg.model.attn_implementation)
    else:
        auto = getattr(transformers, AUTO_CLASSES[head])
        kw = {"num_labels": num_labels} if head != "question-answering" else {}
        model = auto.from_pretrained(name, attn_implementation=cfg.model.attn_implementation,
                                     **kw)
        tok = transformers.AutoTokenizer.from_pretrained(name)
    if head == "sequence-classification":
        model.config.problem_type = task.problem_type
    if cfg.model.dropout is not None:
        for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if hasattr(model.config, attr):
                setattr(model.config, attr, cfg.model.dropout)
        for mod in model.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = cfg.model.dropout
    return model, tok


def subset(examples: list, fraction: float, limit: int | None, seed: int) -> list:
    """Seeded fraction of ``examples`` (order kept), then the first ``limit``."""
    if fraction < 1.0:
        keep = sorted(random.Random(seed).sample(range(len(examples)),
                                                 max(1, round(fraction * len(examples)))))
        examples = [examples[i] for i in keep]
    return examples[:limit] if limit is not None else examples


def make_evaluator(task, splits: dict[str, tuple[list, list]], tokenizer, seed: int,
                   batch_size: int):
    """evaluate(model) -> metrics; with several eval splits, names get a ``split/`` prefix.

    A fresh collator per evaluation, seeded the same, so masked-LM masks are identical in
    every evaluation. For single-label classification, ``evaluate.one_class`` gets, per
    call, whether every prediction of some split was the same class (see
    :func:`degenerate_warning`).
    """
    classify = (task.head == "sequence-classification"
                and getattr(task, "problem_type", None) == "single_label_classification")

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        result: dict[str, float] = {}
        one_class = False
        for split, (examples, features) in splits.items():
            collate = task.collator(tokenizer, seed=seed)
            preds: list = []
            for i in range(0, len(features), batch_size):
                batch = collate(features[i : i + batch_size])
                batch = {k: v.to(device) for k, v in batch.items()}
                preds += task.batch_predictions(model(**batch), batch)
            metrics = task.compute_metrics(preds, features, examples)
            if classify and len(preds) > 1:
                one_class |= len({int(torch.as_tensor(p).argmax()) for p in preds}) == 1
            if len(splits) == 1:
                result.update(metrics)
            else:
                result.update({f"{split}/{k}": v for k, v in metrics.items()})
        evaluate.one_class.append(one_class)
        return result

    evaluate.one_class = []
    return evaluate


def degenerate_warning(one_class: list[bool], evals: list[dict], best_step: int | None,
                       steps: int, lr: float) -> str | None:
    """A message when the kept model predicted one class for every dev example (MCC 0, the
    majority-class accuracy), else None. ``one_class`` holds this process's evaluations:
    the last ``len(one_class)`` of ``evals``, or, after a finalize (Diff-Prune), more than
    ``evals`` with the reported model's last."""
    if not one_class:
        return None
    if len(one_class) > len(evals):  # finalized: the last evaluation is the result
        kept = one_class[-1]
    else:
        mine = evals[len(evals) - len(one_class):]
        at_best = [o for o, e in zip(one_class, mine, strict=True) if e["step"] == best_step]
        kept = (at_best or one_class[-1:])[0]
    if not kept:
        return None
    return (f"the kept model predicts one class for every dev example (after {steps} steps "
            f"at lr {lr:g}): it learned only the majority class. Likely causes: too few "
            "steps (raise train.epochs) or a learning rate too low or too high (optim.lr).")


def eval_splits_of(cfg: ExperimentConfig, task) -> tuple[str, ...]:
    return (cfg.task.eval_split,) if cfg.task.eval_split else tuple(task.eval_splits)


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
    """Train and evaluate ``cfg``; returns (and writes) the run summary.

    The run folder is ``cfg.run_dir`` as given (``rundir.fresh_run`` picks a new one for the
    command line). A run that raises leaves ``summary.json`` with ``status: failed`` and the
    error (``interrupted`` for Ctrl-C), then re-raises. A finished run deletes its
    checkpoints and best-model copy unless ``train.keep_checkpoints``.
    """
    cfg = with_optim_defaults(cfg)  # config.yaml and resume checks see the values used
    preflight(cfg)  # what `attnlab validate` refuses, refused before anything is loaded
    started, t0 = now(), time.perf_counter()
    try:
        return _run_experiment(cfg, resume, stop_after, started, t0)
    except BaseException as e:
        if cfg.run_dir.is_dir():
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            write_json(cfg.run_dir / "summary.json", {
                "name": cfg.name, "task": cfg.task.name, "seed": cfg.seed, "status": status,
                "error": f"{type(e).__name__}: {e}", **provenance(), "started": started,
                "finished": now(), "wall_seconds": time.perf_counter() - t0,
            })
        raise


def _run_experiment(cfg: ExperimentConfig, resume: bool, stop_after: int | None,
                    started: str, t0: float) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from ..hf.plan import Plan
    from ..hf.surgery import apply_plan
    from ..tasks import get_task
    from ..tuning.accounting import count_parameters
    from ..tuning.base import TaskInfo, resolve_tuning

    reset_peak_rss()  # peak memory of this run, not of earlier runs in the process
    _release_other_precision(cfg.train.mixed_precision)
    accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision,
                              cpu=not torch.cuda.is_available())
    run_dir = cfg.run_dir
    if resume:
        check_resumable(run_dir, cfg)
    task = get_task(cfg.task.name)  # the data first: a run that cannot start writes nothing
    data_dir = cfg.task.data_dir
    train_ex = subset(task.load(cfg.task.train_split or task.train_split, data_dir),
                      cfg.task.train_fraction, cfg.task.train_limit, cfg.seed)
    eval_splits = eval_splits_of(cfg, task)
    eval_ex = {s: task.load(s, data_dir)[: cfg.task.eval_limit] for s in eval_splits}
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(resolved_yaml(cfg))

    set_seed(cfg.seed)  # model init (new heads) depends only on the seed
    model, tok = build_model(cfg, task)
    plan = Plan.parse(cfg.plan) if cfg.plan else None
    report = apply_plan(model, plan) if plan is not None else None
    tuner, tcfg = resolve_tuning(cfg.tuning.method)
    model = tuner.apply(model, tcfg, task=TaskInfo.from_tokenizer(tok, task_kind(task)))
    params = count_parameters(model, tuner)
    if accelerator.is_main_process:
        write_json(run_dir / "plan.json", {"plan": plan.to_list() if plan else []})

    max_len = cfg.model.max_length
    train_feats = task.encode(train_ex, tok, max_len)
    collate = task.collator(tok, seed=cfg.seed)
    splits = {s: (ex, task.encode(ex, tok, max_len)) for s, ex in eval_ex.items()}
    main_metric = task.main_metric if len(splits) == 1 else f"{eval_splits[0]}/{task.main_metric}"

    def aux(m):
        from ..hf.backend import aux_loss

        extra = [x for x in (aux_loss(m), getattr(tuner, "aux_loss", lambda _: None)(m))
                 if x is not None]
        return sum(extra) if extra else None

    parts = LoopParts(model=model, train_features=train_feats, collate=collate,
                      evaluate=make_evaluator(task, splits, tok, cfg.seed, cfg.eval.batch_size),
                      main_metric=main_metric, greater_is_better=task.greater_is_better,
                      aux_loss=aux, param_options=getattr(tuner, "param_options", None))
    state = fit(cfg, parts, accelerator, run_dir, resume=resume, stop_after=stop_after)
    best = next((e["eval"] for e in state.evals if e["step"] == state.best_step), {})
    interrupted = stop_after is not None and state.step >= stop_after
    best_metric, finalized, pruned, masked = state.best_metric, None, None, None
    if getattr(tuner, "finalize_changes_model", False) and not interrupted:
        # Diff-Prune: prune the (best) model to its target sparsity, then (mask_epochs > 0)
        # train the kept entries under the fixed mask; what is saved and what `attnlab
        # eval` re-measures is that final model, so its metric is the run's result.
        final_model = accelerator.unwrap_model(parts.model)
        tuner.finalize(final_model)
        final_model.eval()
        with torch.no_grad():
            pruned = parts.evaluate(final_model)
        finalized = pruned
        mask_epochs = getattr(tcfg, "mask_epochs", 0.0)
        if mask_epochs > 0:
            later = None if stop_after is None else max(stop_after - state.step, 0)
            masked = _masked_phase(cfg, parts, final_model, accelerator, run_dir, mask_epochs,
                                   getattr(tcfg, "mask_lr", None),
                                   resume, later)
            interrupted = later is not None and masked.step >= later
            finalized = next((e["eval"] for e in masked.evals if e["step"] == masked.best_step),
                             pruned)
        params = count_parameters(final_model, tuner)
        best_metric = finalized.get(main_metric, best_metric)
    masked_steps = masked.step if masked is not None else 0
    train_seconds = state.train_seconds + (masked.train_seconds if masked is not None else 0.0)
    summary = {
        "name": cfg.name,
        "task": task.name,
        "seed": cfg.seed,
        "status": "interrupted" if interrupted else "finished",
        "plan": plan.to_list() if plan else [],
        "tuning": tcfg.spec() if hasattr(tcfg, "spec") else cfg.tuning.method,
        "main_metric": main_metric,
        "greater_is_better": task.greater_is_better,
        "best_metric": best_metric,
        "best_step": state.best_step if masked is None else state.step + masked.best_step,
        "best_eval": finalized if finalized is not None else best,
        "before_finalize": ({"best_metric": state.best_metric, "best_eval": best}
                            if finalized is not None else None),
        "pruned_eval": pruned,  # Diff-Prune: right after pruning, before the masked epochs
        "masked_steps": masked_steps if masked is not None else None,
        "final_eval": state.evals[-1]["eval"] if state.evals else {},
        "steps": state.step + masked_steps,
        "train_examples": len(train_feats),
        "train_seconds": train_seconds,
        "seconds_per_step": train_seconds / max(state.step + masked_steps, 1),
        "peak_rss_mb": peak_rss_mb(),  # this run's own (reset when it started)
        "params": params,
        "surgery": report.to_dict() if report is not None else None,
        "interrupted": interrupted,
        "num_processes": accelerator.num_processes,
        "degenerate": degenerate_warning(parts.evaluate.one_class, state.evals,
                                         state.best_step, state.step,
                                         float(cfg.optim.lr or 0.0)),
        **provenance(),
        "started": started,
    }
    if accelerator.is_main_process:
        _export(accelerator.unwrap_model(parts.model), tok, tuner, run_dir)
        if not interrupted and not cfg.train.keep_checkpoints:
            prune_finished(run_dir)
        if summary["degenerate"]:  # loud, at the end of the run's output
            print(f"\n*** WARNING ({cfg.name}): {summary['degenerate']}\n", file=sys.stderr)
        summary.update(finished=now(), wall_seconds=time.perf_counter() - t0)
        write_json(run_dir / "summary.json", summary)  # last: the run is complete
    accelerator.wait_for_everyone()
    return {**summary, "is_main_process": accelerator.is_main_process}


def _masked_phase(cfg: ExperimentConfig, parts, model, accelerator, run_dir: Path,
                  epochs: float, lr: float | None, resume: bool, stop_after: int | None):
    """Diff-Prune's second stage: ``epochs`` more epochs of the pruned model with its mask
    fixed (only the kept diff entries and the head train; no L0 term), a fresh optimizer and
    schedule with the run's settings, evaluated and kept-best like the first stage. Its
    checkpoints and metrics go to ``run_dir/masked/``, so ``--resume`` continues it. ``lr``:
    its own learning rate (None: the run's)."""
    from dataclasses import replace

    cfg2 = replace(cfg, train=replace(cfg.train, epochs=epochs, max_steps=None),
                   optim=replace(cfg.optim, lr=cfg.optim.lr if lr is None else lr))
    if accelerator.is_main_process:
        (run_dir / "masked").mkdir(parents=True, exist_ok=True)
    parts2 = replace(parts, model=model, aux_loss=None)
    return fit(cfg2, parts2, accelerator, run_dir / "masked", resume=resume,
               stop_after=stop_after)


def _release_other_precision(mixed_precision: str) -> None:
    """Accelerate keeps one process-wide AcceleratorState and refuses a second Accelerator
    with another mixed precision ("restart your runtime"). Runs in one process (`attnlab
    compare --vary train.mixed_precision=no,bf16`, notebooks, tests) may differ there, so the
    precision part of that state is dropped when it differs; the distributed part
    (PartialState: process group, rank) is kept. ``_reset_state`` is Accelerate's own
    (internal) reset, the one its test suite uses."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision", mixed_precision) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def _export(model, tok, tuner, run_dir: Path) -> None:
    """Save the trained model: tuned weights only for partial tuners, else a full export."""
    from ..tuning.base import save_tuned

    save_tuned(model, tuner, run_dir / "tuned.safetensors")


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def evaluate_run(run_dir: str | Path, data_dir: str | None = None) -> dict[str, float]:
    """Rebuild a finished run from its config, plan and tuned weights; evaluate on dev."""
    from ..tasks import get_task

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


def load_run_model(run_dir: str | Path) -> tuple[torch.nn.Module, Any, ExperimentConfig]:
    """(model, tokenizer, config) of a finished run, rebuilt in eval mode.

    The run's config.yaml rebuilds the architecture with the task's head, the plan is
    re-applied, the tuner re-wraps the model, and ``tuned.safetensors`` fills in the trained
    weights, so the model computes exactly what the run evaluated. Shared by ``attnlab eval``,
    ``attnlab analyze heads`` and ``attnlab report``.
    """
    from accelerate.utils import set_seed

    from ..config import load_config
    from ..hf.plan import Plan
    from ..hf.surgery import apply_plan
    from ..tasks import get_task
    from ..tuning.base import TaskInfo, load_tuned_file, resolve_tuning

    run_dir = Path(run_dir)
    weights = run_dir / "tuned.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"{weights} not found: is {run_dir} a finished attnlab run?")
    cfg = load_config(run_dir / "config.yaml")
    task = get_task(cfg.task.name)
    set_seed(cfg.seed)  # as in run_experiment: a scratch backbone that was not tuned (and
    model, tok = build_model(cfg, task)  # so is not in tuned.safetensors) is its seeded init
    if cfg.plan:
        apply_plan(model, Plan.parse(cfg.plan))
    tuner, tcfg = resolve_tuning(cfg.tuning.method)
    model = tuner.apply(model, tcfg, task=TaskInfo.from_tokenizer(tok, task_kind(task)))
    load_tuned_file(model, tuner, weights)
    model.eval()
    return model, tok, cfg
