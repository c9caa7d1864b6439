"""PASTA: parameter-efficient tuning with special token adaptation.

Xiaocong Yang, James Y. Huang, Wenxuan Zhou, Muhao Chen, "Parameter-Efficient Tuning with
Special Token Adaptation", EACL 2023 (arXiv 2210.04382; official code:
github.com/luka-group/PASTA, ``PASTA_modeling.py``).

Before every layer l the hidden states get a trainable vector at each special token:

    H'_l = H_l + sum_s Dropout(e_s^(l) * onehot(position of the s-th special token))

where H_1 is the embedding output (after its LayerNorm and dropout), the s-th special token
is counted per example in order of occurrence ([CLS] -> e_1, first [SEP] -> e_2, second
[SEP] -> e_3; RoBERTa pairs <s> A </s></s> B </s> use e_1..e_4), and each layer owns an
n x d table (``nn.Embedding(n, d)``, init N(0, 0.02^2)). Only the vectors and the task head
train; the pooler and everything else stay frozen. Cost: O(b*n*d) per layer.

How: a forward pre-hook on the backbone captures ``input_ids`` (and ``attention_mask``) and
computes, per example, which table row each position takes (-1 = none); a forward hook
clears it after the forward, even when the forward fails. A pre-hook on every encoder layer
adds the rows to the layer's input hidden states. Nothing inside the layers changes, so
PASTA composes with attention plans.

Deviations from the official code, all deliberate:
- special positions are found per example (the official code counts the specials of the
  first example and assigns vectors round-robin across the batch, which mislabels mixed
  batches); padding positions (``attention_mask == 0`` or the pad id) are never special;
- an example with more special tokens than rows is an error (the official code asserts).
Since an example's special positions are disjoint, one dropout over the summed additions is
the same distribution as the official per-vector dropouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .base import (
    BERT_SPECIAL_IDS,
    DOUBLE_SEP_FAMILIES,
    OptimRecipe,
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    TuningError,
    backbone_of,
    encoder_layers,
    finish_tuning,
    model_family,
    register_tuner,
    set_trainable,
    start_tuning,
)

# Attached to the backbone: parameters are named "<backbone>.pasta.vectors.<l>.weight".
MODULE_NAME = "pasta"


@dataclass(frozen=True, kw_only=True)
class PastaConfig(TunerConfig):
    """Special-token vectors added before every layer.

    ``recommended_optim`` holds the official scripts' settings (AdamW, weight decay 0,
    linear decay, no warmup, max length 128; GLUE: lr 2.5e-4, batch 32; their CoNLL-2003
    script uses lr 3e-3, batch 16). Their GLUE script builds ``transformers.AdamW``, whose
    eps is 1e-6 (the NER script: ``torch.optim.AdamW``, eps 1e-8); the runner's AdamW eps
    stays ``optim.eps`` (default 1e-8), which the recipe does not set. The scripts train
    150 (GLUE) and 100 (CoNLL-2003) epochs and keep the best dev epoch.
    ``dropout`` and ``init_std`` are constants here; the official code takes the model
    config's ``hidden_dropout_prob`` and, through ``from_pretrained``'s initialisation of
    missing weights, ``initializer_range`` (0.1 and 0.02 in the BERT and RoBERTa configs).
    """

    name = "pasta"
    recommended_optim = OptimRecipe(
        lr=2.5e-4, weight_decay=0.0, schedule="linear", warmup_ratio=0.0, max_length=128,
        batch_size=32,
        source="luka-group/PASTA main_glue.py defaults and scripts/CoLA.sh; "
               "scripts/CoNLL03.sh uses lr 3e-3, batch 16",
    )
    num_special_tokens: int | None = None  # n per layer; None: 2 single/ner, 3 pair, 4 RoBERTa pair
    special_ids: tuple[int, ...] | None = None  # ids counted as special; None: task's or family's
    dropout: float = 0.1  # p of the dropout on the added vectors (official: hidden_dropout_prob)
    init_std: float = 0.02  # std of the N(0, std^2) init of e_s^(l)

    def __post_init__(self) -> None:
        if self.num_special_tokens is not None and self.num_special_tokens < 1:
            raise ValueError("num_special_tokens must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout must be in [0, 1)")
        if self.special_ids is not None and len(self.special_ids) == 0:
            raise ValueError("special_ids must name at least one token id (or be None)")


class PastaVectors(nn.Module):
    """The per-layer tables and the per-forward special-token index.

    vectors[l]: nn.Embedding(n, d) for layer l.  ``index`` [b, L] long: row of each
    position, -1 where no vector is added; set by the backbone pre-hook for one forward.
    """

    def __init__(self, num_layers: int, n: int, d: int, special_ids: tuple[int, ...],
                 pad_id: int | None, p: float, init_std: float) -> None:
        super().__init__()
        tables = [nn.Embedding(n, d) for _ in range(num_layers)]
        for table in tables:
            nn.init.normal_(table.weight, mean=0.0, std=init_std)
        self.vectors = nn.ModuleList(tables)
        self.dropout = nn.Dropout(p)
        self.num_special = n
        self.special_ids = tuple(special_ids)
        self.pad_id = pad_id
        self.index: torch.Tensor | None = None

    def special_index(self, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[b, L] ids -> [b, L] row of e_s per position (order of occurrence), -1 elsewhere.

        More special tokens than n in an example is an error; fewer is allowed (the example
        uses e_1..e_k of its k tokens in order, e.g. text tokenized without [CLS]).
        """
        special = torch.isin(input_ids, torch.tensor(self.special_ids, device=input_ids.device))
        if self.pad_id is not None:
            special &= input_ids != self.pad_id
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("PASTA needs a 2-D attention_mask [batch, length] (1 = token)")
            special &= attention_mask.bool()
        order = special.long().cumsum(dim=1) - 1  # [b, L]: s-1 at the s-th special token
        counts = special.sum(dim=1)  # [b]
        if counts.numel() and int(counts.max()) > self.num_special:
            bad = int(counts.argmax())
            raise ValueError(
                f"example {bad} of the batch has {int(counts[bad])} special tokens but PASTA "
                f"has {self.num_special} vectors per layer (special ids {self.special_ids}); "
                "set num_special_tokens to the largest count, or check the special ids"
            )
        return torch.where(special, order, torch.full_like(order, -1))

    def addition(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """[b, L, d] vectors for layer ``layer`` (zeros away from special tokens)."""
        if self.index is None:
            raise RuntimeError(
                "PASTA found no special-token index for this forward: call the model (or its "
                "backbone) with input_ids; inputs_embeds alone cannot locate special tokens"
            )
        idx = self.index  # [b, L]
        if idx.shape != like.shape[:2]:
            raise ValueError(f"PASTA index {tuple(idx.shape)} does not match hidden states "
                             f"{tuple(like.shape[:2])}")
        rows = self.vectors[layer](idx.clamp(min=0))  # [b, L, d]
        rows = rows * (idx >= 0).unsqueeze(-1).to(rows.dtype)  # zero where not special
        return self.dropout(rows).to(like.dtype)

    # Hooks are bound methods (layer hooks via functools.partial) rather than closures so
    # that copy.deepcopy of a tuned model rebinds them to the copy's vectors.

    def capture_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Backbone pre-hook: compute the special-token index of this forward."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self.index = None if ids is None else self.special_index(ids, mask)

    def clear_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                   output: Any) -> None:
        """Backbone forward hook (also runs when the forward raised): forget the index."""
        self.index = None

    def add_hook(self, layer: int, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        """Layer pre-hook: H' = H + vectors at the special tokens."""
        if args:
            return (args[0] + self.addition(layer, args[0]), *args[1:]), kwargs
        hidden = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": hidden + self.addition(layer, hidden)}


def default_special_ids(model: nn.Module) -> tuple[int, ...]:
    """(bos, eos) for RoBERTa-style configs, else BERT's [CLS]/[SEP] = (101, 102)."""
    config = getattr(model, "config", None)
    if model_family(model) in DOUBLE_SEP_FAMILIES:
        bos, eos = getattr(config, "bos_token_id", None), getattr(config, "eos_token_id", None)
        if bos is not None and eos is not None:
            return (int(bos), int(eos))
    return BERT_SPECIAL_IDS


def special_token_count(model: nn.Module, kind: str) -> int:
    """Special tokens per example: 2 for one sentence, 3 for a pair (4 in RoBERTa)."""
    if kind in ("single", "ner"):
        return 2
    if kind in ("pair", "qa"):
        return 4 if model_family(model) in DOUBLE_SEP_FAMILIES else 3
    raise TuningError(
        f"PASTA cannot infer the number of special tokens for task kind {kind!r}: pass "
        "task=TaskInfo(kind='single'|'pair'|'ner'|'qa') or pasta(num_special_tokens=N)"
    )


@register_tuner(PastaConfig)
class PastaTuner(RequiresGradTuner):
    """Adds the per-layer special-token tables and hooks; trains them and the head."""

    def apply(self, model: nn.Module, cfg: PastaConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        task = task or TaskInfo()
        n = cfg.num_special_tokens or special_token_count(model, task.kind)
        special = cfg.special_ids or task.special_ids or default_special_ids(model)
        pad = task.pad_id if task.pad_id is not None else getattr(
            getattr(model, "config", None), "pad_token_id", None)
        if pad is not None and pad in special:
            raise TuningError(
                f"padding id {pad} is also a special id {tuple(special)}: padding is never "
                "special; pass the tokenizer's boundary ids without its pad id"
            )
        backbone = backbone_of(model)
        layers = encoder_layers(model)
        config: Any = model.config  # the Hugging Face config
        hidden = int(config.hidden_size)
        pasta = PastaVectors(len(layers), n, hidden, tuple(special), pad, cfg.dropout,
                             cfg.init_std)
        ref = next(backbone.parameters(), None)
        if ref is not None:
            pasta.to(device=ref.device)
        backbone.add_module(MODULE_NAME, pasta)
        backbone.register_forward_pre_hook(pasta.capture_hook, with_kwargs=True)
        backbone.register_forward_hook(pasta.clear_hook, with_kwargs=True, always_call=True)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(partial(pasta.add_hook, i), with_kwargs=True)
        keep = [n for n, p in model.named_parameters()
                if any(p is q for q in pasta.parameters())]
        set_trainable(model, keep)
        return finish_tuning(model, record)



def pasta_module(model: nn.Module) -> PastaVectors:
    """The ``PastaVectors`` of a model PASTA was applied to."""
    found = getattr(backbone_of(model), MODULE_NAME, None)
    if not isinstance(found, PastaVectors):
        raise ValueError("this model has no PASTA vectors; apply the pasta tuner first")
    return found
