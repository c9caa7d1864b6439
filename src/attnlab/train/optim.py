"""AdamW and its learning-rate schedule, built from plain settings (no experiment config).

``build_optimizer`` is what a recipe calls before :func:`attnlab.train.loop.fit`: parameter
groups (no decay on biases and LayerNorm weights, by Hugging Face Trainer's rule; a tuner's
own options, e.g. Diff-Prune's ``log_alpha`` at lr 0.1, in groups of their own), the fused
AdamW kernel where torch has one, and a linear or constant schedule with warmup over
``total`` optimizer steps.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

# Hugging Face Trainer's ``get_decay_parameter_names``: no decay inside an nn.LayerNorm
# (its parametrizations too) nor on a parameter whose lower-cased name matches one of these
NO_DECAY_PATTERNS = tuple(re.compile(p) for p in (
    r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"))


@dataclass(frozen=True)
class OptimSettings:
    """lr: peak learning rate.  weight_decay: AdamW's decoupled decay.  warmup_ratio: share
    of the steps warmed up.  schedule: "linear" (then decay to 0) or "constant".  betas, eps:
    AdamW's.  fused: the fused kernel (None: wherever torch has one)."""

    lr: float
    weight_decay: float
    warmup_ratio: float
    schedule: str
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    fused: bool | None = None


def use_fused_adamw(groups: list[dict], asked: bool | None) -> bool | None:
    """``fused``, or when unset: the fused AdamW kernel wherever torch has one for every
    parameter (CPU, CUDA; floating dtypes), as Hugging Face's Trainer defaults to. It
    computes the same update as the per-tensor loop (tested to 1e-6), 4.6x faster on CPU
    (0.027 vs 0.126 s per step over MiniLM's 22.7 M parameters, docs/benchmarks-history.md)."""
    if asked is not None:
        return asked
    params = [p for g in groups for p in g["params"]]
    ok = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return True if params and ok else None


def no_decay_ids(model: torch.nn.Module) -> set[int]:
    """ids of the parameters Hugging Face's Trainer leaves undecayed: every parameter of an
    ``nn.LayerNorm`` module, and those whose name matches ``NO_DECAY_PATTERNS``."""
    ids = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
           for p in m.parameters()}
    return ids | {id(p) for name, p in model.named_parameters()
                  if any(r.search(name.lower()) for r in NO_DECAY_PATTERNS)}


def param_groups(model: torch.nn.Module, weight_decay: float,
                 options: dict[int, dict] | None = None) -> list[dict]:
    """AdamW groups over trainable parameters: no decay on biases and LayerNorm weights
    (:func:`no_decay_ids`); everything else is decayed, a plan's mechanism parameters and a
    tuner's added ones (adapters, PASTA vectors, prefix, LoRA) included. ``options``
    (id(parameter) -> e.g. {"lr": 0.1, "weight_decay": 0.0}) puts those parameters in
    groups of their own; the schedule scales every group's lr alike."""
    options = options or {}
    skip = no_decay_ids(model)
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    own: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in options:
            key = tuple(sorted(options[id(p)].items()))
            own.setdefault(key, []).append(p)
            continue
        (no_decay if id(p) in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            *({"params": ps, "weight_decay": 0.0, **dict(key)} for key, ps in own.items())]


def warmup_steps(ratio: float, total: int) -> int:
    """floor(ratio x total): the whole steps within the warmup share (Hugging Face's Trainer
    rounds up instead, docs/decisions.md). The product is rounded to 9 decimals first, so
    float noise does not drop a step (0.29 x 100 is 28.999999999999996 in floats)."""
    return math.floor(round(ratio * total, 9))


def build_optimizer(model: torch.nn.Module, settings: OptimSettings, total: int,
                    options: dict[int, dict] | None = None):
    """(AdamW over the model's trainable parameters, its schedule over ``total`` steps)."""
    groups = param_groups(model, settings.weight_decay, options)
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas,
                                  eps=settings.eps, fused=use_fused_adamw(groups, settings.fused))
    warmup = warmup_steps(settings.warmup_ratio, total)
    if settings.schedule == "linear":
        return optimizer, get_linear_schedule_with_warmup(optimizer, warmup, total)
    return optimizer, get_constant_schedule_with_warmup(optimizer, warmup)
