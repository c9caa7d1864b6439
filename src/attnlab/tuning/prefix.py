"""Deep prefix tuning, through attnlab's own attention call.

- Li & Liang, "Prefix-Tuning: Optimizing Continuous Prompts for Generation", ACL 2021:
  trained key/value prefixes in every layer, optionally reparameterised by an MLP.
- Liu, Ji, Fu, Tam, Du, Yang, Tang, "P-Tuning v2: Prompt Tuning Can Be Comparable to
  Fine-tuning Universally Across Scales and Tasks", ACL 2022: the same on encoders for
  classification and tagging. Prefix length 20 as in the PASTA paper's re-run.

Layer l's attention sees ``num_virtual_tokens`` extra keys and values,
K' = [P_k^l ; K], V' = [P_v^l ; V] (``attnlab.hf.prefix``). Trained: the prefix (or its MLP
and embedding) and the task head; the backbone is frozen. The model is switched to the
"attnlab" attention function, which prepends the prefix; heads keep whatever mechanism a
plan gave them, except mechanisms that read key j as token j (refused, see below).

The weights have peft's ``PrefixEncoder`` layout and token positions start after the prefix
as with peft on Hugging Face BERT (``shift_positions``), so a prefix trained here computes
what peft's ``PrefixTuningConfig`` computes with the same weights (tested against peft where
the installed transformers still takes peft's key/value cache, and against logits recorded
from peft 0.21.2 with transformers 5.23).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core import mechanism_class, parse_spec
from ..hf.arch import inspect_model
from ..hf.prefix import install_prefix
from ..hf.surgery import applied_report, switch_to_attnlab
from .base import (
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    TuningError,
    finish_tuning,
    register_tuner,
    set_trainable,
    start_tuning,
)


@dataclass(frozen=True, kw_only=True)
class PrefixTunerConfig(TunerConfig):
    """Deep prefix tuning (P-tuning v2) on attnlab's attention call."""

    name = "prefix"
    num_virtual_tokens: int = 20  # p: prefix length (PASTA paper's re-run of P-tuning v2: 20)
    prefix_projection: bool = False  # reparameterise P = MLP(P') (Li & Liang 2021, 4.3)
    encoder_hidden_size: int | None = None  # hidden size of that MLP; None: the model's
    shift_positions: bool = True  # tokens take positions p..p+n-1, as peft/P-tuning v2 on BERT

    def __post_init__(self) -> None:
        if self.num_virtual_tokens < 1:
            raise ValueError("num_virtual_tokens must be >= 1")
        if self.encoder_hidden_size is not None and self.encoder_hidden_size < 1:
            raise ValueError("encoder_hidden_size must be >= 1")


def token_keyed(table: Sequence[Sequence[Any]]) -> list[tuple[int, str]]:
    """(layer, mechanism name) of every layer of a [layer][head] table of specs (or configs)
    whose mechanism reads key j as token j (``caps.keys_are_tokens``: band, linformer,
    jat, ...), which prefix tuning's extra keys would shift."""
    names = [[parse_spec(spec)[0] if isinstance(spec, str) else getattr(spec, "name", None)
              for spec in row if spec] for row in table]
    return sorted({(li, name) for li, row in enumerate(names) for name in row
                   if name and mechanism_class(name).caps.keys_are_tokens})


def refuse_token_keyed(table: Sequence[Sequence[Any]], num_virtual_tokens: int) -> None:
    """Raise :class:`TuningError` when a layer of ``table`` (see :func:`token_keyed`) holds a
    mechanism that reads key j as token j."""
    bad = token_keyed(table)
    if bad:
        where = ", ".join(f"{name} in layer {li}" for li, name in bad[:4])
        raise TuningError(
            f"prefix tuning adds {num_virtual_tokens} virtual keys in front of every "
            f"layer's keys, but the plan puts mechanisms that read key j as token j "
            f"there ({where}{', ...' if len(bad) > 4 else ''}). Use another tuner (pasta, "
            "lora, adapter, bitfit) with this plan, or keep such mechanisms out of the plan."
        )


def _refuse_incompatible_plan(model: nn.Module, cfg: PrefixTunerConfig) -> None:
    """Prefix tuning prepends virtual keys (m = n + p); mechanisms that read key j as token j
    (band, linformer, jat, ...) would pair query i with the wrong keys, and a layer whose K/V
    projections were shrunk (mqa) has fewer K/V heads than the prefix."""
    report = applied_report(model)
    if report is None:
        return
    refuse_token_keyed(report.table, cfg.num_virtual_tokens)
    if report.kv_heads or report.head_dims:
        changed = sorted({*report.kv_heads, *report.head_dims})
        raise TuningError(
            f"prefix tuning needs every K/V head at the host's head size, but the applied "
            f"plan shrank the K/V projections or re-sized the heads of layers {changed}; use "
            "another tuner with it")


@register_tuner(PrefixTunerConfig)
class PrefixTuner(RequiresGradTuner):
    """Trains a key/value prefix per layer (and the head); everything else is frozen."""

    def apply(self, model: nn.Module, cfg: PrefixTunerConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        _refuse_incompatible_plan(model, cfg)
        record = start_tuning(model, cfg)
        host = inspect_model(model)
        mid = (cfg.encoder_hidden_size or host.num_heads * host.head_dim
               if cfg.prefix_projection else None)
        encoder = install_prefix(host, cfg.num_virtual_tokens, mid, cfg.shift_positions)
        switch_to_attnlab(model, host)
        keep = {n for n, p in model.named_parameters()
                if any(p is q for q in encoder.parameters())}
        set_trainable(model, keep)
        return finish_tuning(model, record)
