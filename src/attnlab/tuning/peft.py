"""LoRA through the ``peft`` library (not re-implemented).

- LoRA: Hu, Shen, Wallis, Allen-Zhu, Li, Wang, Wang, Chen, "LoRA: Low-Rank Adaptation of
  Large Language Models", ICLR 2022. W x + (alpha / r) B A x on the targeted projections
  (peft's default for BERT/RoBERTa: query and value), B initialised to zero.

Prefix tuning is attnlab's own (``tuning.prefix``): peft passes the prefix as a key/value
cache through the host's ``forward``, which transformers 5.24 renamed, so peft 0.21.2
refuses BERT there.

``peft.get_peft_model`` wraps the model: ``apply`` returns the wrapper (a ``PeftModel``),
which the runner must use from then on. The peft task type follows the model's head
(``*ForSequenceClassification`` -> SEQ_CLS, ``*ForTokenClassification`` -> TOKEN_CLS,
``*ForQuestionAnswering`` -> QUESTION_ANS, a bare encoder -> FEATURE_EXTRACTION). Every
top-level module of the task head trains (``modules_to_save``: BERT's ``classifier``,
DistilBERT's ``pre_classifier`` and ``classifier``, ModernBERT's ``head`` and
``classifier``), as under the other tuners; peft by itself keeps only ``classifier`` /
``score`` / ``qa_outputs``. Saving and loading use peft's own ``get_peft_model_state_dict`` /
``set_peft_model_state_dict``.

Target modules: peft's default for the model type (BERT, RoBERTa, XLM-R, ELECTRA: query
and value), else ``LORA_TARGETS`` for the families attnlab knows that peft 0.21 has none
for; ModernBERT's Q, K and V are one fused ``Wqkv``, so LoRA adapts all three there.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..hf.arch import UnsupportedModelError
from .base import (
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    TuningError,
    backbone_of,
    finish_tuning,
    head_prefixes,
    model_family,
    register_tuner,
    start_tuning,
    unwrap_peft,
)

# what peft adds to modules_to_save by itself, per task type
_PEFT_HEAD_NAMES = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"),
                    "QUESTION_ANS": ("qa_outputs",)}
_HEAD_SUFFIX_TO_TASK = {
    "ForSequenceClassification": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
    "ForQuestionAnswering": "QUESTION_ANS",
}


def peft_task_type(model: nn.Module) -> str:
    """The peft ``TaskType`` name for a Hugging Face model's head."""
    cls = type(unwrap_peft(model)).__name__
    for suffix, task in _HEAD_SUFFIX_TO_TASK.items():
        if cls.endswith(suffix):
            return task
    if backbone_of(model) is unwrap_peft(model):
        return "FEATURE_EXTRACTION"
    raise ValueError(
        f"no peft task type for {cls}: supported heads are "
        f"{', '.join('*' + s for s in _HEAD_SUFFIX_TO_TASK)} and bare encoders"
    )


@dataclass(frozen=True, kw_only=True)
class LoraTunerConfig(TunerConfig):
    """LoRA through peft's ``LoraConfig``."""

    name = "lora"
    r: int = 8  # r: rank of the update B A
    alpha: int = 16  # alpha: the update is scaled by alpha / r
    dropout: float = 0.0  # p of the dropout on the LoRA branch input (peft default)
    target_modules: tuple[str, ...] | None = None  # modules to adapt; None: the family's default
    bias: Literal["none", "all", "lora_only"] = "none"  # which biases also train

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError("r must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout must be in [0, 1)")
        names = self.target_modules
        if names is not None and (not names or not all(t.strip() for t in names)):
            raise ValueError("target_modules must name modules, e.g. ('query', 'value'), or "
                             "be None for the model family's default")


# model type -> default LoRA targets, for the families peft 0.21 has no default for (the
# query and value projections, as peft's default for BERT; ModernBERT's fused Q/K/V)
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "camembert": ("query", "value"),
    "ernie": ("query", "value"),
    "roberta-prelayernorm": ("query", "value"),
    "distilbert": ("q_lin", "v_lin"),
    "modernbert": ("Wqkv",),
}


def default_lora_targets(family: str) -> tuple[str, ...] | None:
    """The modules LoRA adapts by default on model type ``family``: peft's default, else
    ``LORA_TARGETS``; None when neither has one (``lora_targets`` then refuses)."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    if family in PEFT_DEFAULTS:
        return tuple(PEFT_DEFAULTS[family])
    return LORA_TARGETS.get(family)


def lora_targets(model: nn.Module, cfg: LoraTunerConfig) -> list[str] | None:
    """The modules LoRA adapts: the config's, else peft's default for the model type (None),
    else ``LORA_TARGETS``; a model type with none of these is an UnsupportedModelError
    naming the option to set."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    if cfg.target_modules:
        modules = dict(model.named_modules())
        missing = [t for t in cfg.target_modules
                   if not any(n == t or n.endswith("." + t) for n in modules)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items()
                             if isinstance(m, nn.Linear)})
            raise TuningError(
                f"lora: no module of {type(model).__name__} is named {missing[0]!r} (peft "
                f"matches the end of a module's name); its linear layers are named "
                f"{', '.join(linear[:12])}")
        return list(cfg.target_modules)
    family = model_family(model)
    if family in PEFT_DEFAULTS:
        return None
    if family in LORA_TARGETS:
        return list(LORA_TARGETS[family])
    raise UnsupportedModelError(
        f"lora: neither peft nor attnlab has default target modules for model type "
        f"{family or type(model).__name__!r}; set lora(target_modules=(...)) to the names of "
        "its attention projections (e.g. target_modules=('query', 'value'))")


def head_modules_to_save(model: nn.Module, task_type: str) -> list[str] | None:
    """The head's top-level modules, for peft's ``modules_to_save`` (None: no head). peft
    wraps (trains in full) every module whose name ends with one of them or with its own
    names for the task type, so a backbone module whose name does is refused."""
    heads = head_prefixes(model)
    if not heads:
        return None
    wrapped = (*heads, *_PEFT_HEAD_NAMES.get(task_type, ()))
    clash = [name for name, _ in backbone_of(model).named_modules() if name.endswith(wrapped)]
    if clash:
        raise UnsupportedModelError(
            f"lora: backbone module {clash[0]!r} ends with the name of a task-head module "
            f"({', '.join(wrapped)}), so peft would train it in full as part of the head; "
            "use another tuner (pasta, bitfit, adapter) with this model")
    return list(heads)


def _wrap(model: nn.Module, peft_config) -> nn.Module:
    import peft  # heavy: peft, imported on use

    with warnings.catch_warnings():  # peft 0.21 calls an API transformers 5 deprecated
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        return peft.get_peft_model(model, peft_config)


def _peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """peft's own adapter state (LoRA matrices or prefix, plus the head's trained copy)."""
    from peft import get_peft_model_state_dict  # heavy: peft, imported on use

    return {k: v.detach().clone().contiguous()
            for k, v in get_peft_model_state_dict(model).items()}


def _peft_load(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict  # heavy: peft, imported on use

    expected = set(_peft_state(model))
    if set(state) != expected:
        raise KeyError(
            f"tuned state does not match the peft model: missing "
            f"{sorted(expected - set(state))[:5]}, unexpected "
            f"{sorted(set(state) - expected)[:5]}. Apply the same tuner and config first."
        )
    result = set_peft_model_state_dict(model, dict(state))
    # peft loads "prompt_embeddings" into the prompt encoder itself, yet lists it unexpected.
    unused = [k for k in getattr(result, "unexpected_keys", []) if k != "prompt_embeddings"]
    if unused:
        raise KeyError(f"peft did not use {unused[:5]}")


class _PeftTuner(RequiresGradTuner):
    """peft keeps its own adapter state (LoRA matrices / prefix + the head's trained copy)."""

    def state_dict_to_save(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return _peft_state(model)

    def load_tuned(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        _peft_load(model, state)


@register_tuner(LoraTunerConfig)
class LoraTuner(_PeftTuner):
    """LoRA via ``peft.get_peft_model(model, LoraConfig(...))``."""

    def apply(self, model: nn.Module, cfg: LoraTunerConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        from peft import LoraConfig, TaskType  # heavy: peft, imported on use

        record = start_tuning(model, cfg)
        task_type = peft_task_type(model)
        targets = lora_targets(model, cfg)
        heads = head_modules_to_save(model, task_type)
        peft_cfg = LoraConfig(
            task_type=TaskType[task_type], r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
            bias=cfg.bias, target_modules=targets, modules_to_save=heads,
        )
        return finish_tuning(_wrap(model, peft_cfg), record)
