"""The model of a run: built for training (``build_model`` + ``apply_run_plan``) and rebuilt
from a finished run (``load_run_model``).

One home for both, so that a reloaded run computes exactly what it evaluated: ``attnlab run``
(``recipes.finetune``), ``attnlab eval``, ``attnlab analyze`` / ``attnlab report``
(``recipes.analyze``) and the head selectors that analyse the model a run starts from
(``recipes.head_select``) all build it here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed

from ..config import ExperimentConfig, load_config
from ..hf.backend import set_task_id
from ..hf.plan import Plan
from ..hf.surgery import SurgeryReport, apply_plan
from ..models import load_model
from ..tasks import get_task
from ..tuning.base import TaskInfo, TaskKind, load_tuned_file, resolve_tuning
from .rundir import is_tlm_run


def task_kind(task) -> TaskKind:
    """Input layout for tuners: single / pair / ner / qa / other."""
    if task.head == "token-classification":
        return "ner"
    if task.head == "question-answering":
        return "qa"
    if task.head == "sequence-classification":
        return "pair" if len(getattr(task, "text_columns", ())) > 1 else "single"
    return "other"


def build_model(cfg: ExperimentConfig, task) -> tuple[torch.nn.Module, Any]:
    """(model with the task's head, tokenizer) from ``cfg.model`` (``models.load_model``:
    the embedded MiniLM, ``scratch:SIZE`` or a folder); heads are new (random)."""
    head = task.head
    model, tok = load_model(cfg.model.name, head, num_labels=max(task.num_labels, 1),
                            id2label=(dict(enumerate(task.label_names)) if task.label_names
                                      else None),
                            attn_implementation=cfg.model.attn_implementation)
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


def apply_run_plan(model: torch.nn.Module, cfg: ExperimentConfig
                   ) -> tuple[Plan | None, SurgeryReport | None]:
    """Apply the run's attention plan (if any) and give task-conditioned mechanisms
    (``camtl_prior``) the run's ``task.task_id``; the same in training and on reload."""
    plan = Plan.parse(cfg.plan) if cfg.plan else None
    report = apply_plan(model, plan) if plan is not None else None
    if cfg.task.task_id is not None:  # preflight: a plan exists when a task id is set
        set_task_id(model, cfg.task.task_id)
    return plan, report


def load_run_model(run_dir: str | Path) -> tuple[torch.nn.Module, Any, ExperimentConfig]:
    """(model, tokenizer, config) of a finished run, rebuilt in eval mode.

    The run's config.yaml rebuilds the architecture with the task's head, the plan is
    re-applied, the tuner re-wraps the model, and ``tuned.safetensors`` fills in the trained
    weights, so the model computes exactly what the run evaluated. Shared by ``attnlab eval``,
    ``attnlab analyze heads`` and ``attnlab report``.
    """
    run_dir = Path(run_dir)
    weights = run_dir / "tuned.safetensors"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a folder; give the folder of a finished "
                                "attnlab run (e.g. runs/<name>)")
    if not weights.exists():
        raise FileNotFoundError(_no_weights(run_dir, weights))
    cfg = load_config(run_dir / "config.yaml")
    task = get_task(cfg.task.name)
    set_seed(cfg.seed)  # as in run_experiment: a scratch backbone that was not tuned (and
    model, tok = build_model(cfg, task)  # so is not in tuned.safetensors) is its seeded init
    apply_run_plan(model, cfg)
    tuner, tcfg = resolve_tuning(cfg.tuning.method)
    model = tuner.apply(model, tcfg, task=TaskInfo.from_tokenizer(tok, task_kind(task)))
    load_tuned_file(model, tuner, weights)
    model.eval()
    return model, tok, cfg


def _no_weights(run_dir: Path, weights: Path) -> str:
    """Why a folder without tuned weights is no finished run, and what to give instead."""
    if is_tlm_run(run_dir):
        return (f"{run_dir} is a run of `attnlab tlm`, which this command does not read; its "
                f"dev metrics are in {run_dir / 'summary.json'} (`attnlab collect` tabulates "
                "them)")
    runs = sorted(p for pattern in ("seed-*", "*/seed-*") for p in run_dir.glob(pattern)
                  if p.is_dir())
    if runs:
        return (f"{run_dir} holds the runs of `attnlab compare`, not one run; give one of "
                f"them, e.g. {runs[0]}")
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    if status in ("interrupted", "failed"):
        return (f"{run_dir} has not finished (status: {status}); continue it with: attnlab "
                f"run {run_dir}/config.yaml --resume")
    return f"{weights} not found: is {run_dir} a finished attnlab run?"
