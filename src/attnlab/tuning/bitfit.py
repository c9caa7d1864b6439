"""BitFit: train only the bias terms (and the task head).

Ben Zaken, Ravfogel, Goldberg, "BitFit: Simple Parameter-efficient Fine-tuning for
Transformer-based Masked Language-models", ACL 2022. Every parameter named ``*.bias`` in
the backbone trains: query/key/value, attention output, intermediate and output dense
layers, LayerNorm biases (the gains stay frozen) and the pooler's bias, as the official
code selects by name. On BERT-base that is about 0.1% of the backbone.
"""

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
    set_trainable,
    start_tuning,
    trainable_state,
)


@dataclass(frozen=True, kw_only=True)
class BitFitConfig(TunerConfig):
    """Which biases train."""

    name = "bitfit"
    include_layernorm: bool = True  # train LayerNorm biases (beta) too, as the paper does


@register_tuner(BitFitConfig)
class BitFitTuner:
    """Freeze everything but biases and the head."""

    def apply(self, model: nn.Module, cfg: BitFitConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        layer_norm_biases = {
            f"{mod_name}.bias" if mod_name else "bias"
            for mod_name, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
        }
        keep = [
            n for n, _ in model.named_parameters()
            if n.endswith(".bias") and (cfg.include_layernorm or n not in layer_norm_biases)
        ]
        set_trainable(model, keep)
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
