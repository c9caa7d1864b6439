"""Parameter accounting, the same way for every tuner.

``count_parameters`` returns::

    trainable_total         every parameter the optimizer updates (head included)
    trainable_without_head  the same without the task head (what papers report); a
                            parameter of ``model.base_model`` is never head, also where
                            a head module shares it (tied word embeddings)
    backbone_total          the encoder model without the head, as it was before tuning
                            (e.g. ``BertModel``: embeddings, layers and pooler)
    percent_of_backbone     100 * trainable_without_head / backbone_total
    effective_without_head  non-head values that end up differing from the pretrained
                            model; equals trainable_without_head except for diff pruning
                            after ``finalize`` (the kept diff entries)

``params_report`` builds a published architecture from its config with random weights on
the ``meta`` device (no download, no memory) and counts one tuner on it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
)

from .base import (
    TaskInfo,
    Tuner,
    backbone_of,
    backbone_parameter_ids,
    requires_grad_parameters,
    resolve_tuning,
    tuning_record,
)

ModelConfigName = Literal["bert-large", "bert-base", "roberta-large", "roberta-base", "minilm"]
TaskType = Literal["single", "pair", "ner"]

_BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                   intermediate_size=4096)
_ROBERTA = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1,
                layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)
# name -> (family, config kwargs, the Hugging Face checkpoint whose config.json it mirrors)
PUBLISHED_CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "bert-base": ("bert", {}, "bert-base-uncased"),
    "bert-large": ("bert", _BERT_LARGE, "bert-large-uncased"),
    "roberta-base": ("roberta", _ROBERTA, "roberta-base"),
    "roberta-large": ("roberta", {**_ROBERTA, **_BERT_LARGE}, "roberta-large"),
    "minilm": ("bert", dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536), "sentence-transformers/all-MiniLM-L6-v2"),
}
_NUM_LABELS = {"single": 2, "pair": 2, "ner": 9}  # binary GLUE task; CoNLL-2003 BIO tags


def count_parameters(model: nn.Module, tuner: Tuner | None = None) -> dict[str, Any]:
    """Trainable counts of a tuned model against its backbone (see the module docstring)."""
    record = tuning_record(model)
    backbone_ids = backbone_parameter_ids(model)  # what a tuner adds sits in the backbone
    trainable = requires_grad_parameters(model)
    total = sum(p.numel() for _, p in trainable)
    head = sum(p.numel() for _, p in trainable if id(p) not in backbone_ids)
    if record is not None:
        backbone_total, backbone_name = record.backbone_total, record.backbone_name
    else:
        backbone = backbone_of(model)
        backbone_total = sum(p.numel() for p in backbone.parameters())
        backbone_name = type(backbone).__name__
    without_head = total - head
    effective = without_head
    effective_fn = getattr(tuner, "effective_without_head", None)
    if callable(effective_fn):
        found = effective_fn(model)
        effective = without_head if found is None else found
    return {
        "trainable_total": total,
        "trainable_without_head": without_head,
        "backbone_total": backbone_total,
        "percent_of_backbone": 100.0 * without_head / backbone_total if backbone_total else 0.0,
        "effective_without_head": effective,
        "backbone_name": backbone_name,
        "tuner": record.spec if record is not None else "(none applied)",
    }


def build_published(model_config: str, task_type: TaskType = "single",
                    device: str | torch.device = "meta") -> nn.Module:
    """A random-init model of a published architecture with the task's head."""
    if model_config not in PUBLISHED_CONFIGS:
        raise ValueError(f"unknown model config {model_config!r}; choose one of "
                         f"{', '.join(PUBLISHED_CONFIGS)}")
    if task_type not in _NUM_LABELS:
        raise ValueError(f"unknown task type {task_type!r}; choose one of "
                         f"{', '.join(_NUM_LABELS)}")
    family, kwargs, _ = PUBLISHED_CONFIGS[model_config]
    config_cls = BertConfig if family == "bert" else RobertaConfig
    # num_labels: a PreTrainedConfig keyword that the @strict dataclass signature omits
    cfg = config_cls(**kwargs, num_labels=_NUM_LABELS[task_type])  # type: ignore[call-arg]
    classes = {
        ("bert", False): BertForSequenceClassification,
        ("bert", True): BertForTokenClassification,
        ("roberta", False): RobertaForSequenceClassification,
        ("roberta", True): RobertaForTokenClassification,
    }
    with torch.device(device):
        return classes[family, task_type == "ner"](cfg)


def params_report(model_config: ModelConfigName = "bert-large", tuning: str = "pasta",
                  task_type: TaskType = "single") -> dict[str, Any]:
    """Count ``tuning`` on a published architecture (built on the meta device).

    PASTA on BERT-large: 24 x 2 x 1024 = 49,152 (single), 24 x 3 x 1024 = 73,728 (pair);
    RoBERTa-large pairs: 24 x 4 x 1024 = 98,304.
    """
    tuner, cfg = resolve_tuning(tuning)
    model = build_published(model_config, task_type)
    with torch.device("meta"):  # parameters the tuner adds stay on meta too
        model = tuner.apply(model, cfg, task=TaskInfo(kind=task_type))
    counts = count_parameters(model, tuner)
    return {
        "model_config": model_config,
        "mirrors": PUBLISHED_CONFIGS[model_config][2],
        "tuning": counts.pop("tuner"),
        "task_type": task_type,
        **counts,
    }


def format_params(report: dict[str, Any]) -> str:
    """Human-readable lines, thousands separators and the denominator spelled out."""
    pct = report["percent_of_backbone"]
    where = ""
    if "model_config" in report:
        where = (f" on {report['model_config']} ({report['mirrors']} config, random init), "
                 f"task type {report['task_type']}")
    lines = [
        f"tuning {report.get('tuning', '?')}{where}",
        f"  trainable without head: {report['trainable_without_head']:,}",
        f"  trainable with head:    {report['trainable_total']:,}",
        f"  backbone ({report['backbone_name']}, head excluded): "
        f"{report['backbone_total']:,}",
        f"  share of backbone: {report['trainable_without_head']:,} / "
        f"{report['backbone_total']:,} = {pct:.3f}%",
    ]
    if report.get("effective_without_head", report["trainable_without_head"]) != \
            report["trainable_without_head"]:
        lines.append(f"  effective (kept diff entries): {report['effective_without_head']:,}")
    return "\n".join(lines)
