"""Full fine-tuning: every parameter trains. The default tuner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .base import (
    TaskInfo,
    TunerConfig,
    finish_tuning,
    load_exact,
    register_tuner,
    requires_grad_parameters,
    start_tuning,
    trainable_state,
)


@dataclass(frozen=True, kw_only=True)
class FullConfig(TunerConfig):
    """No options: all weights (backbone, any plan's mechanisms, head) train."""

    name = "full"


@register_tuner(FullConfig)
class FullTuner:
    """Full fine-tuning; saving writes every trainable weight (the whole model)."""

    def apply(self, model: nn.Module, cfg: FullConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        model.requires_grad_(True)
        return finish_tuning(model, record)

    def trainable_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return requires_grad_parameters(model)

    def state_dict_to_save(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return trainable_state(model)

    def load_tuned(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        load_exact(model, state, (n for n, _ in requires_grad_parameters(model)))

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        return None

    def finalize(self, model: nn.Module) -> None:
        return None
