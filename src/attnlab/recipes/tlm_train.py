"""TLM's two training stages (the pipeline is ``recipes.tlm``, the config ``recipes.tlm_config``).

Stage 1 has its own loop, :func:`train_stage1`: ``train.loop.fit`` walks one dataset epoch
by epoch, while stage 1 draws each step's batch from one of two streams by a fixed
schedule (``TlmObjective.is_task_step``), so the loop is written out here. It uses the
same parts as ``fit``: AdamW and its schedule from ``train.optim.build_optimizer`` (no decay
on biases and LayerNorm; warmup, then linear decay), Accelerate, ``train.checkpoint``
(atomic checkpoints with model, optimizer, schedule and every RNG state) and
``train.loop.epoch_batches`` (the data order of each stream's epoch e depends only on
(seed, e)). A stream's position is a function of the step (``task_steps_before``), and the
masks of a batch depend only on its examples (``tasks.mlm.SeededMasking``), so a run
resumed from a checkpoint takes the same batches, masks and dropout as an uninterrupted
one: its weights end equal.

Stage 2 is ordinary fine-tuning, so it is ``train.loop.fit`` itself, on the stage-1 model
whose task head is re-initialised (:func:`stage2_model`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, set_seed
from safetensors.torch import load_model, save_model
from tqdm.auto import tqdm

from ..config import ConfigError
from ..io import atomic_path, write_json
from ..models import default_model_path, encoder_config
from ..tasks import get_task
from ..tasks.base import Feature
from ..tlm.objective import (
    ExternalCollator,
    MaskedTaskCollator,
    TaskHead,
    TlmModel,
    TlmObjective,
    encode_passages,
)
from ..train.accel import run_accelerator
from ..train.checkpoint import TrainerState, save_checkpoint
from ..train.loop import (
    LoopParts,
    LoopSettings,
    MetricsLog,
    epoch_batches,
    fit,
    optimizer_step,
    plan_steps,
    start_state,
)
from ..train.memory import peak_rss_mb
from ..train.optim import OptimSettings, build_optimizer
from .evaluation import degenerate_warning, make_evaluator, subset
from .rundir import TLM_RECORD, now, provenance, prune_finished
from .summary import RunSummary, write_summary
from .tlm_config import TlmConfig, external_file, read_external, tuning_spec

# Seed offsets: the external stream's order and the task batches' masks use seeds of their
# own, so neither repeats the task stream's order or the external masks.
EXTERNAL_ORDER_SEED = 1_000_003
TASK_MASK_SEED = 2_000_003


@dataclass
class TlmData:
    """What both stages train and evaluate on, built once by :func:`prepare`."""

    task: Any
    tokenizer: Any
    train_examples: list
    train_features: list[Feature]
    eval_splits: dict[str, tuple[list, list]]  # split -> (examples, features)
    main_metric: str
    source: dict[str, Any]  # the external set (external.json)
    external_features: list[Feature] | None  # None: task data only

    def evaluator(self, seed: int, batch_size: int):
        return make_evaluator(self.task, self.eval_splits, self.tokenizer, seed, batch_size)


@contextmanager
def quiet_tied_weights() -> Iterator[None]:
    """Accelerate warns at every checkpoint that it saved the MLM decoder once, as it is tied
    to the word embeddings (and its bias to the head's); loading restores the tie
    (``safetensors.torch.load_model``), so the warning is dropped while a stage trains."""
    log = logging.getLogger("accelerate.utils.other")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def load_tokenizer():
    """The embedded model's tokenizer (uncased WordPiece, 30,522 tokens), offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)


def prepare(cfg: TlmConfig, progress: bool = True, external: bool = True) -> TlmData:
    """Task data (train subset, eval splits, encoded) and, when ``external``, the external
    set of ``cfg.external`` (retrieved or drawn and cached on first use), encoded."""
    task = get_task(cfg.task.name)
    t = cfg.task
    train_ex = subset(task.load(t.train_split or task.train_split, t.data_dir),
                      t.train_fraction, t.train_limit, cfg.seed)
    if not train_ex:
        raise ConfigError(f"task {task.name!r}: no training examples (check task.train_limit)")
    splits = (t.eval_split,) if t.eval_split else tuple(task.eval_splits)
    tok = load_tokenizer()
    n = cfg.model.max_length
    evals = {}
    for s in splits:
        ex = task.load(s, t.data_dir)[: t.eval_limit]
        evals[s] = (ex, task.encode(ex, tok, n))
    source: dict[str, Any] = {"condition": cfg.external, "file": None, "passages": 0, "k": None}
    ext = None
    if external and cfg.external != "none":
        source = external_file(cfg, train_ex, progress)
        ext = encode_passages(read_external(source), tok, n)
    return TlmData(task=task, tokenizer=tok, train_examples=train_ex,
                   train_features=task.encode(train_ex, tok, n), eval_splits=evals,
                   main_metric=(task.main_metric if len(splits) == 1
                                else f"{splits[0]}/{task.main_metric}"),
                   source=source, external_features=ext)


def build_tlm_model(cfg: TlmConfig, task: Any) -> TlmModel:
    """A random ``BertForMaskedLM`` of ``model.size`` (``models.encoder_config``) with the
    task head; initialised from the global RNG (call ``set_seed`` first)."""
    from transformers import AutoModelForMaskedLM

    config = encoder_config(cfg.model.size, **cfg.model.config)
    mlm = AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa")
    head = TaskHead(config.hidden_size, max(task.num_labels, 1),
                    token_level=task.head == "token-classification")
    return TlmModel(mlm, head, problem_type=task.problem_type or "single_label_classification",
                    rho2=cfg.stage1.rho2)


def objective_of(cfg: TlmConfig) -> TlmObjective:
    """Stage 1's schedule and weights; external=none makes every step a task batch."""
    s = cfg.stage1
    return TlmObjective(rho1=0 if cfg.external == "none" else s.rho1, rho2=s.rho2)


# ----------------------------------------------------------------------------- stage 1


@dataclass(frozen=True)
class Stage1Settings:
    """name: progress-bar label.  seed: data order.  batch_size: examples per step.  steps:
    optimizer steps.  eval_every: steps between dev evaluations (None: at the end).
    save_every: steps between checkpoints (and at the end).  log_every: steps per
    metrics.jsonl line.  max_grad_norm: clipping (None: off)."""

    name: str
    seed: int
    batch_size: int
    steps: int
    eval_every: int | None = None
    save_every: int = 500
    log_every: int = 10
    max_grad_norm: float | None = None


@dataclass
class Stage1Parts:
    """What the stage-1 loop works on. external_features None: task data only (the objective
    must then have rho1 = 0)."""

    model: TlmModel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    objective: TlmObjective
    task_features: Sequence[Feature]
    task_collate: Callable[[list[Feature]], dict]
    external_features: Sequence[Feature] | None
    external_collate: Callable[[list[Feature]], dict] | None
    evaluate: Callable[[torch.nn.Module], dict[str, float]]


class _Stream:
    """Batch ``k`` of one data stream: batch ``k % per_epoch`` of epoch ``k // per_epoch``'s
    seeded permutation (``train.loop.epoch_batches``)."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int, world: int) -> None:
        self.n, self.bs, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.per_epoch = len(epoch_batches(n, batch_size, seed, 0, rank, world))
        if self.per_epoch == 0:
            raise ValueError("a stage-1 data stream is empty")
        self._epoch, self._batches = -1, [[0]]

    def epoch_of(self, k: int) -> int:
        return k // self.per_epoch

    def batch(self, k: int) -> list[int]:
        epoch, i = divmod(k, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches = epoch_batches(self.n, self.bs, self.seed, epoch, self.rank,
                                          self.world)
        return self._batches[i]


class _Window:
    """Losses of the steps since the last metrics.jsonl line."""

    def __init__(self) -> None:
        self.steps, self.loss, self.mlm, self.n_mlm, self.task, self.n_task = 0, 0.0, 0.0, 0, \
            0.0, 0

    def add(self, out: Any) -> None:
        self.steps += 1
        self.loss += float(out.loss.detach())
        if out.mlm_loss is not None:
            self.mlm, self.n_mlm = self.mlm + float(out.mlm_loss.detach()), self.n_mlm + 1
        if out.task_loss is not None:
            self.task, self.n_task = self.task + float(out.task_loss.detach()), self.n_task + 1

    def record(self, step: int, lr: float) -> dict[str, Any]:
        return {"step": step, "loss": self.loss / max(self.steps, 1),
                "mlm_loss": self.mlm / self.n_mlm if self.n_mlm else None,
                "task_loss": self.task / self.n_task if self.n_task else None,
                "task_batches": self.n_task, "lr": lr}


def train_stage1(parts: Stage1Parts, settings: Stage1Settings, accelerator, run_dir: Path,
                 resume: bool = False, stop_after: int | None = None) -> TrainerState:
    """Stage 1: ``settings.steps`` optimizer steps, step s on a task batch when
    ``parts.objective.is_task_step(s)``, else on an external batch; returns the state.

    stop_after: stop (as if killed) right after that step's checkpoint (tests of resume).
    """
    if parts.external_features is None and parts.objective.rho1 != 0:
        raise ValueError("stage 1 without external data needs rho1 = 0 (every step a task "
                         f"batch), got rho1 = {parts.objective.rho1}")
    model, optimizer = accelerator.prepare(parts.model, parts.optimizer)
    accelerator.register_for_checkpointing(parts.scheduler)
    rank, world = accelerator.process_index, accelerator.num_processes
    log = MetricsLog(run_dir / "metrics.jsonl", accelerator.is_main_process)
    state = start_state(accelerator, run_dir, log, resume, settings.steps, what="stage 1 ")
    bs = settings.batch_size
    task = _Stream(len(parts.task_features), bs, settings.seed, rank, world)
    ext = (None if parts.external_features is None else
           _Stream(len(parts.external_features), bs, settings.seed + EXTERNAL_ORDER_SEED,
                   rank, world))
    trainable = [p for p in model.parameters() if p.requires_grad]
    tty = sys.stderr.isatty()
    bar = tqdm(total=settings.steps, initial=state.step, desc=settings.name, unit="step",
               disable=not accelerator.is_local_main_process, dynamic_ncols=tty,
               mininterval=0.1 if tty else 60.0)
    window = _Window()
    model.train()
    while state.step < settings.steps:
        t0, step = time.perf_counter(), state.step
        k_task = parts.objective.task_steps_before(step)
        if ext is None or parts.objective.is_task_step(step):
            feats, collate, idx = parts.task_features, parts.task_collate, task.batch(k_task)
        else:
            assert parts.external_features is not None and parts.external_collate is not None
            feats, collate = parts.external_features, parts.external_collate
            idx = ext.batch(parts.objective.external_steps_before(step))
        batch = collate([feats[i] for i in idx])
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.autocast():
            out = model(**batch)
            accelerator.backward(out.loss)
        optimizer_step(accelerator, optimizer, parts.scheduler, trainable,
                       settings.max_grad_norm)
        state.step += 1
        state.epoch = task.epoch_of(parts.objective.task_steps_before(state.step))
        state.train_seconds += time.perf_counter() - t0
        window.add(out)
        bar.update(1)
        last = state.step == settings.steps
        if state.step % settings.log_every == 0 or last:
            log.write(window.record(state.step, parts.scheduler.get_last_lr()[0]))
            bar.set_postfix(loss=f"{window.loss / max(window.steps, 1):.4f}", refresh=False)
            window = _Window()
        if last or (settings.eval_every and state.step % settings.eval_every == 0):
            _evaluate(parts, accelerator, model, state, log)
            model.train()
        cut = stop_after is not None and state.step >= stop_after
        if state.step % settings.save_every == 0 or last or cut:
            save_checkpoint(accelerator, run_dir, state)
        if cut:
            break
    bar.close()
    accelerator.wait_for_everyone()
    return state


def _evaluate(parts: Stage1Parts, accelerator, model, state: TrainerState,
              log: MetricsLog) -> None:
    """The task head on the dev split (main process; unmasked inputs), logged."""
    metrics: list[Any] = [None]
    if accelerator.is_main_process:
        inner = accelerator.unwrap_model(model)
        inner.eval()
        with torch.no_grad():
            metrics[0] = parts.evaluate(inner)
    metrics = broadcast_object_list(metrics)
    record = {"step": state.step, "eval": metrics[0]}
    state.evals.append(record)
    log.write(record)


def run_stage1(cfg: TlmConfig, data: TlmData, run_dir: Path, resume: bool = False,
               stop_after: int | None = None) -> dict[str, Any] | None:
    """Stage 1 of ``cfg`` in ``run_dir/stage1``; its result (also ``stage1/state.json``,
    with the final weights in ``stage1/model.safetensors``), or None if stopped early."""
    from ..tasks.mlm import MlmTask

    folder = run_dir / "stage1"
    folder.mkdir(parents=True, exist_ok=True)
    accelerator = run_accelerator()  # TLM trains in full precision
    set_seed(cfg.seed)  # the model's init depends on the seed only
    model = build_tlm_model(cfg, data.task)
    s = cfg.stage1
    optimizer, scheduler = build_optimizer(
        model, OptimSettings(lr=s.lr, weight_decay=s.weight_decay, warmup_ratio=s.warmup_ratio,
                             schedule="linear"), s.steps)
    mlm = MlmTask()
    tok = data.tokenizer
    parts = Stage1Parts(
        model=model, optimizer=optimizer, scheduler=scheduler, objective=objective_of(cfg),
        task_features=data.train_features,
        task_collate=MaskedTaskCollator(mlm.collator(tok, seed=cfg.seed + TASK_MASK_SEED),
                                        frozenset(tok.all_special_ids)),
        external_features=data.external_features,
        external_collate=(ExternalCollator(mlm.collator(tok, seed=cfg.seed))
                          if data.external_features is not None else None),
        evaluate=data.evaluator(cfg.seed, cfg.eval.batch_size))
    settings = Stage1Settings(name=f"{cfg.name} stage 1", seed=cfg.seed,
                              batch_size=s.batch_size, steps=s.steps, eval_every=s.eval_every,
                              save_every=s.save_every, log_every=s.log_every,
                              max_grad_norm=s.max_grad_norm)
    with quiet_tied_weights():
        state = train_stage1(parts, settings, accelerator, folder, resume=resume,
                             stop_after=stop_after)
    if state.step < s.steps:
        return None
    objective = parts.objective
    n_task = objective.task_steps_before(state.step)
    result = {"steps": state.step, "task_steps": n_task, "external_steps": state.step - n_task,
              "rho1": objective.rho1, "rho2": objective.rho2,
              "train_seconds": state.train_seconds,
              "seconds_per_step": state.train_seconds / max(state.step, 1),
              "external_passages": len(data.external_features or []),
              "evals": state.evals, "final_eval": state.evals[-1]["eval"] if state.evals else {}}
    if accelerator.is_main_process:
        with atomic_path(folder / "model.safetensors") as tmp:
            save_model(accelerator.unwrap_model(model), str(tmp))
        write_json(folder / "state.json", result)  # last: stage 1 is complete
    accelerator.wait_for_everyone()
    return result


def stage1_result(run_dir: Path) -> dict[str, Any] | None:
    """A finished stage 1's result, or None."""
    folder = Path(run_dir) / "stage1"
    if not ((folder / "model.safetensors").is_file() and (folder / "state.json").is_file()):
        return None
    return json.loads((folder / "state.json").read_text())


# ----------------------------------------------------------------------------- stage 2


def head_seed(seed: int) -> int:
    """The seed of stage 2's task-head init, derived from (seed, "stage 2 head")."""
    digest = hashlib.sha256(f"tlm-stage2-head:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def stage2_model(cfg: TlmConfig, task: Any, run_dir: Path) -> TlmModel:
    """The stage-1 model (``stage1/model.safetensors``) with its task head re-initialised:
    the encoder and the MLM head keep their stage-1 weights (official ``--reset_cls``)."""
    model = build_tlm_model(cfg, task)
    path = Path(run_dir) / "stage1" / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} has no finished stage 1; run "
                                "`attnlab tlm train` (or --resume it) first")
    load_model(model, str(path), strict=True)
    model.reset_task_head(head_seed(cfg.seed))
    return model


def load_tlm_run(run_dir: str | Path) -> tuple[TlmModel, Any]:
    """A finished TLM run's reported model (``run_dir/model.safetensors``, stage 2's best on
    dev) and the tokenizer it was trained with, in eval mode (head analysis reads
    ``model.encoder``)."""
    from .tlm_config import load_tlm_config

    run_dir = Path(run_dir)
    path = run_dir / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a finished TLM run "
                                "(`attnlab tlm train` writes it at the end of stage 2)")
    cfg = load_tlm_config(run_dir / "config.yaml")
    model = build_tlm_model(cfg, get_task(cfg.task.name))
    load_model(model, str(path), strict=True)
    return model.eval(), load_tokenizer()


@dataclass
class Stage2Result:
    """Stage 2's trainer state, whether each evaluation predicted one class (for
    ``evaluation.degenerate_warning``) and the model's parameter counts."""

    state: TrainerState
    one_class: list[bool] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)


def run_stage2(cfg: TlmConfig, data: TlmData, run_dir: Path, resume: bool = False
               ) -> Stage2Result:
    """Fine-tune (``train.loop.fit``) in ``run_dir/stage2``; the best dev model is kept and
    saved as ``run_dir/model.safetensors``."""
    folder = run_dir / "stage2"
    folder.mkdir(parents=True, exist_ok=True)
    accelerator = run_accelerator()  # TLM trains in full precision
    set_seed(cfg.seed)
    model = stage2_model(cfg, data.task, run_dir)
    s = cfg.stage2
    settings = LoopSettings(
        name=f"{cfg.name} stage 2", seed=cfg.seed, batch_size=s.batch_size, epochs=s.epochs,
        max_steps=s.max_steps, eval_every=s.eval_every, log_every=s.log_every,
        early_stopping_patience=s.early_stopping_patience, keep_best=True,
        max_grad_norm=s.max_grad_norm)
    plan = plan_steps(settings, data.train_features, accelerator.process_index,
                      accelerator.num_processes)
    optimizer, scheduler = build_optimizer(
        model, OptimSettings(lr=s.lr, weight_decay=s.weight_decay, warmup_ratio=s.warmup_ratio,
                             schedule="linear"), plan.total)
    evaluate = data.evaluator(cfg.seed, cfg.eval.batch_size)
    parts = LoopParts(model=model, optimizer=optimizer, scheduler=scheduler,
                      train_features=data.train_features,
                      collate=data.task.collator(data.tokenizer, seed=cfg.seed),
                      evaluate=evaluate, main_metric=data.main_metric,
                      greater_is_better=data.task.greater_is_better)
    with quiet_tied_weights():
        state = fit(parts, settings, plan, accelerator, folder, resume=resume)
    if accelerator.is_main_process:
        with atomic_path(run_dir / "model.safetensors") as tmp:
            save_model(accelerator.unwrap_model(model), str(tmp))
    accelerator.wait_for_everyone()
    return Stage2Result(state, list(getattr(evaluate, "one_class", [])),
                        params_record(model, tuning_spec(cfg)))


def params_record(model: TlmModel, spec: str) -> dict[str, Any]:
    """Parameter counts in ``tuning.accounting``'s keys: the backbone is the whole
    BertForMaskedLM (encoder + MLM head, tied weights once), all of it trained."""
    backbone = sum(p.numel() for p in model.mlm.parameters())
    head = sum(p.numel() for p in model.task_head.parameters())
    encoder = sum(p.numel() for p in model.encoder.parameters())
    return {"trainable_total": backbone + head, "trainable_without_head": backbone,
            "backbone_total": backbone, "percent_of_backbone": 100.0,
            "effective_without_head": backbone, "backbone_name": "BertForMaskedLM (scratch)",
            "tuner": spec, "encoder": encoder, "mlm_head": backbone - encoder,
            "task_head": head}


def write_results(cfg: TlmConfig, data: TlmData, run_dir: Path, stage1: dict[str, Any],
                  result: Stage2Result, started: str, t0: float) -> dict[str, Any]:
    """``tlm.json`` (both stages) and ``summary.json`` (the run's result: stage 2's best dev
    evaluation; steps and time of both stages)."""
    stage2 = result.state
    best: dict[str, float] = next(
        (e["eval"] for e in stage2.evals if e["step"] == stage2.best_step), {})
    steps = int(stage1["steps"]) + stage2.step
    seconds = float(stage1["train_seconds"]) + stage2.train_seconds
    spec = tuning_spec(cfg)
    stage2_info = {"steps": stage2.step, "train_seconds": stage2.train_seconds,
                   "seconds_per_step": stage2.train_seconds / max(stage2.step, 1),
                   "best_step": stage2.best_step, "best_metric": stage2.best_metric,
                   "evals": stage2.evals}
    write_json(run_dir / TLM_RECORD, {"external": data.source, "stage1": stage1,
                                      "stage2": stage2_info})
    summary = RunSummary(
        name=str(cfg.name), task=data.task.name, seed=cfg.seed, status="finished",
        tuning=spec, main_metric=data.main_metric,
        greater_is_better=data.task.greater_is_better, best_metric=stage2.best_metric,
        best_step=stage2.best_step, best_eval=best,
        final_eval=stage2.evals[-1]["eval"] if stage2.evals else {}, steps=steps,
        train_examples=len(data.train_features), train_seconds=seconds,
        seconds_per_step=seconds / max(steps, 1), peak_rss_mb=peak_rss_mb(),
        params=result.params,
        degenerate=degenerate_warning(result.one_class, stage2.evals, stage2.best_step, stage2.step,
                                      cfg.stage2.lr, by_steps=cfg.stage2.max_steps is not None,
                                      section="stage2", lr_key="stage2.lr"),
        **provenance(), started=started, finished=now(), wall_seconds=time.perf_counter() - t0)
    write_summary(run_dir, summary)
    return summary.to_dict()


def prune(folder: Path) -> None:
    """A finished stage's checkpoints and best-model copy (``rundir.prune_finished``)."""
    prune_finished(folder)
