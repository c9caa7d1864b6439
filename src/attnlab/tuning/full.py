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
    """All weights (backbone, any plan's mechanisms, head) train, optionally but the
    word-embedding table."""

    name = "full"
    # keep the input word-embedding table fixed (MiniLM: 11.7 M of 22.7 M parameters, which
    # AdamW would otherwise update densely every step although a batch uses a few rows)
    freeze_embeddings: bool = False


@register_tuner(FullConfig)
class FullTuner(RequiresGradTuner):
    """Full fine-tuning; saving writes every trainable weight (the whole model)."""

    def apply(self, model: nn.Module, cfg: FullConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        model.requires_grad_(True)
        if cfg.freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)  # type: ignore[operator]  # HF method
        return finish_tuning(model, record)
