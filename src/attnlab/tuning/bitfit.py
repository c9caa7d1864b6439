"""BitFit: train only the bias terms (and the task head).

Ben Zaken, Ravfogel, Goldberg, "BitFit: Simple Parameter-efficient Fine-tuning for
Transformer-based Masked Language-models", ACL 2022. Every parameter named ``*.bias`` in
the backbone trains: query/key/value, attention output, intermediate and output dense
layers, LayerNorm biases (the gains stay frozen) and the pooler's bias, as the official
code selects by name. On BERT-base that is about 0.1% of the backbone. The biases of
mechanisms an attention plan added (``hf.AttnlabLayer``, e.g. ``sac``'s projections) are
not the model's and stay frozen, as every weight a plan adds does under bitfit
(docs/decisions.md, "Tuning").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..hf.backend import AttnlabLayer
from .base import (
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    finish_tuning,
    register_tuner,
    set_trainable,
    start_tuning,
)


@dataclass(frozen=True, kw_only=True)
class BitFitConfig(TunerConfig):
    """Which biases train."""

    name = "bitfit"
    include_layernorm: bool = True  # train LayerNorm biases (beta) too, as the paper does


@register_tuner(BitFitConfig)
class BitFitTuner(RequiresGradTuner):
    """Freeze everything but biases and the head."""

    def apply(self, model: nn.Module, cfg: BitFitConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        layer_norm_biases = {
            f"{mod_name}.bias" if mod_name else "bias"
            for mod_name, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
        }
        planned = {  # parameters of the mechanisms a plan installed
            f"{mod_name}.{name}" for mod_name, mod in model.named_modules()
            if isinstance(mod, AttnlabLayer) for name, _ in mod.named_parameters()
        }
        keep = [
            n for n, _ in model.named_parameters()
            if n.endswith(".bias") and n not in planned
            and (cfg.include_layernorm or n not in layer_norm_biases)
        ]
        set_trainable(model, keep)
        return finish_tuning(model, record)
