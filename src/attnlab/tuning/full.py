"""Full fine-tuning: every parameter trains. The default tuner."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import (
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    finish_tuning,
    register_tuner,
    start_tuning,
)


@dataclass(frozen=True, kw_only=True)
class FullConfig(TunerConfig):
    """No options: all weights (backbone, any plan's mechanisms, head) train."""

    name = "full"


@register_tuner(FullConfig)
class FullTuner(RequiresGradTuner):
    """Full fine-tuning; saving writes every trainable weight (the whole model)."""

    def apply(self, model: nn.Module, cfg: FullConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        model.requires_grad_(True)
        return finish_tuning(model, record)
