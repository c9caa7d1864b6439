"""BitFit: train only the bias terms (and the task head).

Ben Zaken, Ravfogel, Goldberg, "BitFit: Simple Parameter-efficient Fine-tuning for
Transformer-based Masked Language-models", ACL 2022. Every parameter named ``*.bias`` in
the backbone trains: query/key/value, attention output, intermediate and output dense
layers, LayerNorm biases (the gains stay frozen) and the pooler's bias, as the official
code selects by name. On BERT-base that is about 0.1% of the backbone. The biases of
mechanisms an attention plan added (``hf.AttnlabLayer``, e.g. ``sac``'s projections) are
not the model's and stay frozen, as every weight a plan adds does under bitfit
(docs/decisions.md, "Tuning"). A model with no bias to train outside the task head
(ModernBERT's default config: ``attention_bias``, ``mlp_bias`` and ``norm_bias`` false) is
refused (``UnsupportedModelError``) rather than tuned as a head-only model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..hf.arch import UnsupportedModelError
from ..hf.backend import AttnlabLayer
from .base import (
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    backbone_parameter_ids,
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


# config switches (ModernBERT, Llama and kin) that leave the backbone's layers without biases
_BIAS_SWITCHES = ("attention_bias", "mlp_bias", "norm_bias")


def _no_biases(model: nn.Module, only_layernorm: bool) -> str:
    """Why bitfit finds nothing to train outside the head, and what to do instead."""
    what = type(model).__name__
    if only_layernorm:
        return (f"bitfit(include_layernorm=False): the only bias terms of {what} outside the "
                "task head are LayerNorm biases; set include_layernorm=True, or use lora or "
                "pasta")
    config = getattr(model, "config", None)
    off = [k for k in _BIAS_SWITCHES if getattr(config, k, None) is False]
    why = f" (its config sets {', '.join(off)} to False)" if off else ""
    return (f"bitfit: {what} has no bias terms outside the task head{why}; use lora or "
            f"pasta{', or build the model with those biases' if off else ''}")


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
        backbone = backbone_parameter_ids(model)
        biases = [n for n, p in model.named_parameters()
                  if n.endswith(".bias") and n not in planned and id(p) in backbone]
        keep = [n for n in biases if cfg.include_layernorm or n not in layer_norm_biases]
        if not keep:
            raise UnsupportedModelError(_no_biases(model, only_layernorm=bool(biases)))
        set_trainable(model, keep)
        return finish_tuning(model, record)
