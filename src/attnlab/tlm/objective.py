"""TLM's joint objective: the stage-1 schedule, the loss, the task head, and its batches.

Yao, Zheng, Yang and Yang, "NLP From Scratch Without Large-Scale Pretraining: A Simple and
Efficient Framework", ICML 2022. Semantics read from the official code
(github.com/yaoxingcheng/TLM: ``src/model.py``, ``src/trainer.py``, ``src/run.py``,
``example_scripts/{train,finetune}.sh``).

Stage 1 trains a randomly initialised encoder on two streams of batches (``TlmObjective``):

- schedule: optimizer step ``s`` (0-based) takes a *task* batch iff
  ``(s + 1) % (rho1 + 1) == 0``, else an *external* batch (retrieved text). This is the
  official ``Trainer._get_batch(ratio)`` with ``ratio = external_ratio + 1`` and
  ``completed_steps = s``: the task batch is the LAST of each group of ``rho1 + 1`` steps
  (rho1 = 3: steps 3, 7, 11, ...); rho1 = 0 makes every step a task batch (the official
  ``ratio <= 1`` case, also used by stage 2 and by the "task data only" control).
- loss (official ``BertForMaskedLM.forward`` with ``mlm_weight = rho2``)::

      external batch:  L = L_mlm
      task batch:      L = (rho2 * L_mlm + L_task) / (rho2 + 1)

  Task batches are masked like external text (the official scripts pass ``--mask_task``):
  L_mlm is the masked-LM loss on the task text and L_task is computed on the same masked
  input, in the same forward pass.
- task head (``TaskHead``): Linear(d, d) - GELU - Linear(d, C) on the [CLS] position, with
  no pooler and no dropout (the official ``cls_layer``). For token classification
  (CoNLL-2003) the same head runs on every position (an extension: the official code has
  sequence tasks only).

Stage 2 is plain fine-tuning with the task loss alone (official ``finetune.sh``:
``mlm_weight 0``, ``external_ratio 0``, no masking) after ``TlmModel.reset_task_head``
re-initialises the task head (``--reset_cls``); the encoder and the MLM head keep their
stage-1 weights.

Shape glossary: b batch, n tokens, d hidden size, C task labels, V vocabulary, t masked
tokens in a batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from ..tasks.base import Feature

IGNORE = -100  # label of positions no loss is computed on (padding, unmasked tokens)


@dataclass(frozen=True, kw_only=True)
class TlmObjective:
    """The stage-1 mixture of TLM (Yao et al., "NLP From Scratch Without Large-Scale
    Pretraining", ICML 2022): which steps are task batches and how a task batch's two losses
    are weighted. Defaults: the official ``train.sh`` (external_ratio 999, mlm_weight 20).

    The paper's grids: rho1 in {1, 3, 7, 19, 99, 499, 999, 1999}, rho2 in {20, 100, 1000}.
    """

    rho1: int = 999  # ρ1: external batches per task batch (a task batch every ρ1+1 steps)
    rho2: float = 20.0  # ρ2: weight of L_mlm in a task batch, (ρ2 L_mlm + L_task)/(ρ2 + 1)

    def __post_init__(self) -> None:
        if isinstance(self.rho1, bool) or not isinstance(self.rho1, int) or self.rho1 < 0:
            raise ValueError(f"rho1 must be an integer >= 0 (external batches per task batch; "
                             f"0 = every step a task batch), got {self.rho1!r}")
        if not self.rho2 >= 0:
            raise ValueError(f"rho2 must be >= 0 (the weight of L_mlm in a task batch; the "
                             f"paper uses 20, 100 or 1000), got {self.rho2!r}")

    def is_task_step(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` takes a task batch."""
        return is_task_step(step, self.rho1)

    def task_steps_before(self, step: int) -> int:
        """Task batches among steps ``0 .. step-1`` (the task stream's position at ``step``)."""
        return step // (self.rho1 + 1)

    def external_steps_before(self, step: int) -> int:
        """External batches among steps ``0 .. step-1``."""
        return step - self.task_steps_before(step)


def is_task_step(step: int, rho1: int) -> bool:
    """The official rule: ``(step + 1) % (rho1 + 1) == 0`` (task batch last in its group)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return (step + 1) % (rho1 + 1) == 0


def joint_loss(mlm_loss: torch.Tensor, task_loss: torch.Tensor, rho2: float) -> torch.Tensor:
    """A task batch's loss: (rho2 * L_mlm + L_task) / (rho2 + 1)."""
    return (rho2 * mlm_loss + task_loss) / (rho2 + 1.0)


class TaskHead(nn.Module):
    """TLM's task head (Yao et al., ICML 2022; official ``cls_layer``): Linear(d, d), GELU,
    Linear(d, C), on the [CLS] position (``token_level=False``) or on every position
    (``token_level=True``, token classification: an extension of the paper's sequence-only
    head). No pooler, no dropout. Initialised with PyTorch's default ``nn.Linear`` init, as
    the official ``set_cls_layer`` builds it after BERT's ``init_weights``."""

    def __init__(self, hidden_size: int, num_labels: int, token_level: bool = False) -> None:
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        self.token_level = token_level
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = nn.GELU()
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden if self.token_level else hidden[:, 0]  # [b, n, d] or [b, d] ([CLS])
        return self.out(self.act(self.dense(x)))  # [b, n, C] or [b, C]

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """PyTorch's default ``nn.Linear`` init (weights Kaiming-uniform with a = sqrt(5),
        biases U(-1/sqrt(fan_in), 1/sqrt(fan_in))), drawn on the CPU from ``generator``
        (None: the global RNG) and copied to the parameters' device."""
        for layer in (self.dense, self.out):
            w = torch.empty(layer.weight.shape)  # [out, in]
            nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
            bound = 1.0 / math.sqrt(w.shape[1])
            b = torch.empty(layer.bias.shape).uniform_(-bound, bound, generator=generator)
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.copy_(b)


@dataclass
class TlmOutput(ModelOutput):
    """What ``TlmModel`` (TLM, Yao et al., ICML 2022) returns: ``loss`` (what is trained),
    ``logits`` (the task head's: [b, C] or [b, n, C]) and the two parts of the loss, each
    None when its labels were not given."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None
    task_loss: torch.Tensor | None = None


class TlmModel(nn.Module):
    """The TLM model (Yao et al., "NLP From Scratch Without Large-Scale Pretraining", ICML
    2022): a BERT encoder with its masked-LM head (``BertForMaskedLM``, composed, not
    subclassed) and the task head, trained with the joint objective.

    ``forward(input_ids, attention_mask, token_type_ids, labels=None, mlm_labels=None)``:
    ``labels`` are the task's (class ids [b], scores [b] for regression, or token tags
    [b, n] with -100 ignored), ``mlm_labels`` the masked-LM targets [b, n] (-100 = not
    predicted). Loss: both given -> (rho2 L_mlm + L_task)/(rho2 + 1); one -> that one.

    Fast path: the MLM head (transform and the d x V decoder) runs only on the t masked
    positions, not on all b*n; the mean cross-entropy over masked tokens is the same
    (``reference_mlm_loss`` is the naive all-positions form it is tested against, fp32
    1e-6). Deviations: a batch with no masked token has L_mlm = 0 (the official code gets
    NaN from a mean over nothing).
    """

    def __init__(self, mlm: nn.Module, task_head: TaskHead, *, problem_type: str,
                 rho2: float) -> None:
        super().__init__()
        if problem_type not in ("single_label_classification", "regression"):
            raise ValueError(f"problem_type must be 'single_label_classification' or "
                             f"'regression', got {problem_type!r}")
        if not hasattr(mlm, "cls"):
            raise ValueError(f"{type(mlm).__name__} has no BERT masked-LM head (.cls); build "
                             "the encoder as a BertForMaskedLM")
        self.mlm = mlm  # BertForMaskedLM: .bert (encoder, no pooler) and .cls (MLM head)
        self.task_head = task_head
        self.problem_type = problem_type
        self.rho2 = float(rho2)

    @property
    def encoder(self) -> nn.Module:
        return cast(nn.Module, self.mlm.base_model)  # BertModel without pooler

    @property
    def mlm_head(self) -> nn.Module:
        return cast(nn.Module, self.mlm.cls)  # BertOnlyMLMHead: transform, then d -> V

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                mlm_labels: torch.Tensor | None = None) -> TlmOutput:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state  # [b, n, d]
        logits = self.task_head(hidden)  # [b, C] or [b, n, C]
        task = self.task_loss(logits, labels) if labels is not None else None
        mlm = self.masked_lm_loss(hidden, mlm_labels) if mlm_labels is not None else None
        loss: torch.Tensor | None
        if task is not None and mlm is not None:
            loss = joint_loss(mlm, task, self.rho2)
        else:
            loss = task if task is not None else mlm
        return TlmOutput(loss=loss, logits=logits, mlm_loss=mlm, task_loss=task)

    def masked_lm_loss(self, hidden: torch.Tensor, mlm_labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the masked positions, the MLM head run on those only."""
        keep = mlm_labels != IGNORE  # [b, n]
        if not bool(keep.any()):
            return hidden.sum() * 0.0  # no masked token: 0, still on the graph
        scores = self.mlm_head(hidden[keep])  # [t, d] -> [t, V]
        return F.cross_entropy(scores.float(), mlm_labels[keep])

    def task_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.problem_type == "regression":
            return F.mse_loss(logits.squeeze(-1).float(), labels.float())
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               labels.reshape(-1).long(), ignore_index=IGNORE)

    def reset_task_head(self, seed: int) -> None:
        """Stage 2: a fresh task head (PyTorch's default init drawn from a generator seeded by
        ``seed``, the global RNG untouched); the encoder and the MLM head are kept."""
        self.task_head.reset_parameters(torch.Generator().manual_seed(seed))


def reference_mlm_loss(model: TlmModel, hidden: torch.Tensor, mlm_labels: torch.Tensor
                       ) -> torch.Tensor:
    """The naive form of ``TlmModel.masked_lm_loss`` (the official one): the MLM head on every
    position, then the mean cross-entropy over positions whose label is not -100."""
    scores = model.mlm_head(hidden)  # [b, n, V]
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]).float(),
                           mlm_labels.reshape(-1), ignore_index=IGNORE)


# ----------------------------------------------------------------------------- batches


def encode_passages(texts: Sequence[str], tokenizer: Any, max_length: int) -> list[Feature]:
    """External text line by line, as the official ``preprocess_external``: one feature per
    non-blank passage, ``[CLS] passage [SEP]`` truncated to ``max_length`` tokens (not packed
    across passages), with ``special_tokens_mask`` and ``block_index`` (its position) for the
    seeded masked-LM collator (``tasks.mlm.SeededMasking``).

    ``special_tokens_mask`` marks every id in ``tokenizer.all_special_ids`` ([CLS], [SEP],
    [PAD], [UNK], [MASK]), as the task batches' ``MaskedTaskCollator`` and ``tasks.mlm`` do,
    so both streams of stage 1 choose masked positions alike. (The tokenizer's own mask marks
    only the [CLS]/[SEP] it adds, so [UNK] and special-token strings in the text could be
    chosen; the official code uses that mask for both streams.)"""
    kept = [t for t in texts if t and not t.isspace()]
    special = set(tokenizer.all_special_ids)
    feats: list[Feature] = []
    for start in range(0, len(kept), 1024):
        enc = tokenizer(kept[start:start + 1024], truncation=True, max_length=max_length,
                        verbose=False)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        for i in range(len(enc["input_ids"])):
            f: Feature = {k: enc[k][i] for k in keys}
            f["special_tokens_mask"] = [int(t in special) for t in f["input_ids"]]
            f["block_index"] = len(feats)
            feats.append(f)
    return feats


@dataclass
class ExternalCollator:
    """Stage-1 external batches of TLM (Yao et al., ICML 2022): the masked-LM collator's
    ``labels`` renamed ``mlm_labels`` (``labels`` is the task's in ``TlmModel.forward``)."""

    masking: Callable[[list[Feature]], dict]

    def __call__(self, features: list[Feature]) -> dict[str, torch.Tensor]:
        batch = dict(self.masking(features))
        batch["mlm_labels"] = batch.pop("labels")  # [b, n]
        return batch


@dataclass
class MaskedTaskCollator:
    """Stage-1 task batches of TLM (Yao et al., ICML 2022; official ``--mask_task``): the
    task's features masked like external text, the task labels kept aside.

    masking: a masked-LM collator over ``input_ids``/``attention_mask``/``token_type_ids``/
    ``special_tokens_mask``/``block_index`` (``MlmTask.collator``: seeded per batch), which
    returns ``labels`` = the MLM targets; they become ``mlm_labels``, and ``labels`` holds the
    task's: class ids [b] (long), scores [b] (float), or token tags [b, n] right-padded
    with -100 (token classification).
    """

    masking: Callable[[list[Feature]], dict]
    special_ids: frozenset[int]

    def __call__(self, features: list[Feature]) -> dict[str, torch.Tensor]:
        plain = []
        for i, f in enumerate(features):
            g: Feature = {k: f[k] for k in ("input_ids", "attention_mask", "token_type_ids")
                          if k in f}
            g["special_tokens_mask"] = [int(t in self.special_ids) for t in f["input_ids"]]
            g["block_index"] = f.get("example_index", i)
            plain.append(g)
        batch = dict(self.masking(plain))
        batch["mlm_labels"] = batch.pop("labels")  # [b, n]
        batch["labels"] = task_labels([f["labels"] for f in features],
                                      width=batch["input_ids"].shape[1])
        return batch


def task_labels(labels: Sequence[Any], width: int) -> torch.Tensor:
    """Task labels as a tensor: token tags padded with -100 to ``width`` ([b, n]), float
    scores ([b], regression) or class ids ([b])."""
    if labels and isinstance(labels[0], (list, tuple)):
        out = torch.full((len(labels), width), IGNORE, dtype=torch.long)  # [b, n]
        for i, row in enumerate(labels):
            if len(row) > width:
                raise ValueError(f"token labels of length {len(row)} for a batch of width "
                                 f"{width}: labels must match input_ids")
            out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        return out
    if labels and isinstance(labels[0], float):
        return torch.tensor(labels, dtype=torch.float)
    return torch.tensor(labels, dtype=torch.long)
