"""Masked language modelling on plain text or JSON-lines documents.

Inputs (``data_dir``):
- a file: ``*.jsonl`` (one ``{"text": ...}`` object per line, other keys ignored) or plain
  text (``*.txt``, WikiText ``*.tokens``: each non-blank line is one document). A single file
  has no splits of its own, so document ``i`` goes to ``dev`` when
  ``i % holdout_every == holdout_every - 1`` and to ``train`` otherwise (5% held out by
  default);
- a folder with per-split files ``{split}.jsonl`` / ``{split}.txt`` / WikiText's
  ``wiki.{train,valid,test}.tokens`` (``dev`` reads ``valid``), looked up in the folder and
  in ``folder/<subpath>``; or, failing that, the single file ``folder/<subpath>`` (so the
  shared data root works: ``mlm`` reads ``corpus_en/docs.jsonl``, ``wikitext2`` reads
  ``corpus_en/wikitext-2/``);
- ``"builtin"``: the acceptable sentences of the package's CoLA-format sample (smoke runs).

Encoding packs documents RoBERTa-style ("full sentences"): every document is tokenized
without special tokens, documents are joined with [SEP], the stream is cut into blocks of
``max_length - 2`` tokens and each block is wrapped as ``[CLS] block [SEP]``; the last block
may be shorter (dynamic padding). Masking happens in the collator
(``DataCollatorForLanguageModeling``): 15% of non-special tokens are chosen; of those 80%
become [MASK], 10% a random token, 10% stay. Special tokens (including [UNK] and padding)
are never chosen. Masks are seeded per batch by (seed, its block indices)
(``SeededMasking``), so a batch is masked alike in every evaluation and after a resume.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import (
    BUILTIN,
    MODEL_INPUT_KEYS,
    DataFormatError,
    Feature,
    HeadType,
    KeepKeys,
    ProblemType,
    canonical_split,
    read_lines,
    register_task,
)
from .glue import GLUE_TASKS
from .metrics import perplexity

WIKI_NAMES = {"train": "train", "dev": "valid", "test": "test"}


@dataclass(frozen=True)
class TextExample:
    """One document (a jsonl object's text, or one line of a text file)."""

    guid: str
    text: str


def read_texts(path: Path) -> list[TextExample]:
    """Documents of a ``.jsonl`` or plain-text file; bad JSON raises DataFormatError."""
    out = []
    jsonl = path.suffix == ".jsonl"
    for lineno, line in read_lines(path):
        if not line.strip():
            continue
        if not jsonl:
            out.append(TextExample(guid=f"{path.name}:{lineno}", text=line.strip()))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(path, lineno, f"broken JSON: {e.msg} (column {e.colno})"
                                  ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataFormatError(path, lineno, 'expected an object with a "text" string')
        out.append(TextExample(guid=str(obj.get("id", f"{path.name}:{lineno}")),
                               text=obj["text"]))
    return out


@dataclass(frozen=True, kw_only=True)
class MlmTask:
    """Masked-LM: loss and perplexity over masked tokens (lower is better)."""

    name: str = "mlm"
    subpath: str = "corpus_en/docs.jsonl"  # default corpus under a data root
    mlm_probability: float = 0.15  # share of non-special tokens chosen for prediction
    mask_replace_prob: float = 0.8  # chosen tokens replaced by [MASK]
    random_replace_prob: float = 0.1  # chosen tokens replaced by a random token
    holdout_every: int = 20  # single-file corpora: every k-th document is dev
    splits: tuple[str, ...] = ("train", "dev", "test")
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("dev",)
    main_metric: str = "perplexity"
    greater_is_better: bool = False
    head: HeadType = "masked-lm"
    num_labels: int = 0
    label_names: tuple[str, ...] = ()
    problem_type: ProblemType | None = None

    def load(self, split: str, data_dir: str | Path | None = None) -> list[TextExample]:
        split = canonical_split(split, self.splits, self.name)
        if data_dir is None:
            raise ValueError(f"task {self.name!r} needs data_dir: a .jsonl/.txt file, a folder "
                             "of split files, a data root, or 'builtin'")
        if str(data_dir) == BUILTIN:
            return self._builtin(split)
        root = Path(data_dir).expanduser()
        if root.is_file():
            return self._holdout(read_texts(root), split, root)
        names = [f"{split}.jsonl", f"{split}.txt", f"wiki.{WIKI_NAMES[split]}.tokens"]
        tried = []
        for folder in (root, root / self.subpath):
            for name in names:
                if (folder / name).is_file():
                    return read_texts(folder / name)
                tried.append(str(folder / name))
        if (root / self.subpath).is_file():
            return self._holdout(read_texts(root / self.subpath), split, root / self.subpath)
        raise FileNotFoundError(f"{self.name} {split}: none of {', '.join(tried)} exists, nor "
                                f"the single corpus file {root / self.subpath}")

    def _holdout(self, docs: list[TextExample], split: str, path: Path) -> list[TextExample]:
        if split == "test":
            raise ValueError(f"{path} is a single corpus file: it has only train and dev "
                             f"(every {self.holdout_every}th document) splits")
        k = self.holdout_every
        return [d for i, d in enumerate(docs) if (i % k == k - 1) == (split == "dev")]

    def _builtin(self, split: str) -> list[TextExample]:
        if split == "test":
            raise ValueError("the built-in sample has only train and dev splits")
        rows = GLUE_TASKS["cola"].load(split, BUILTIN)
        return [TextExample(guid=r.guid, text=r.text_a) for r in rows if r.label == 1]

    def encode(self, examples: Sequence[TextExample], tokenizer: Any, max_length: int
               ) -> list[Feature]:
        """Pack documents into ``[CLS] block [SEP]`` rows of at most ``max_length`` tokens."""
        cls = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else \
            tokenizer.bos_token_id
        sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else \
            tokenizer.eos_token_id
        if cls is None or sep is None or tokenizer.mask_token_id is None:
            raise ValueError("masked-LM needs a tokenizer with cls/sep (or bos/eos) and mask "
                             "tokens, e.g. a BERT or RoBERTa tokenizer")
        if max_length < 3:
            raise ValueError(f"max_length must be at least 3, got {max_length}")
        stream: list[int] = []
        for i in range(0, len(examples), 256):
            texts = [e.text for e in examples[i:i + 256]]
            for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
                if ids:
                    stream.extend(ids)
                    stream.append(sep)
        stream = stream[:-1]  # no separator after the last document
        special = set(tokenizer.all_special_ids)
        with_types = "token_type_ids" in tokenizer.model_input_names
        block = max_length - 2
        feats: list[Feature] = []
        for k in range(0, len(stream), block):
            ids = [cls, *stream[k:k + block], sep]
            f: Feature = {"input_ids": ids, "attention_mask": [1] * len(ids),
                          "special_tokens_mask": [int(t in special) for t in ids]}
            if with_types:
                f["token_type_ids"] = [0] * len(ids)
            f["block_index"] = len(feats)
            feats.append(f)
        return feats

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]:
        # heavy: transformers; the CLI imports tasks at start
        from transformers import DataCollatorForLanguageModeling

        inner = DataCollatorForLanguageModeling(
            tokenizer, mlm_probability=self.mlm_probability,
            mask_replace_prob=self.mask_replace_prob,
            # seed=None: SeededMasking hands it a generator per batch. Given a seed, the
            # collator (transformers >= 5.24) replaces any generator set from outside with
            # one seeded by it on its first call in a process, so a resumed run's first
            # batch would be masked differently from the uninterrupted run's.
            random_replace_prob=self.random_replace_prob, seed=None,
        )
        return SeededMasking(KeepKeys(inner, MODEL_INPUT_KEYS | {"special_tokens_mask"}), seed)

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        """``(sum of NLL over masked tokens, masked tokens, correct argmax)`` per row."""
        logits = outputs["logits"].detach().float()  # [b, n, V]
        labels = batch["labels"].to(logits.device)  # [b, n], -100 = not predicted
        keep = labels != -100
        safe = labels.clamp(min=0)
        nll = -torch.log_softmax(logits, -1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        nll = (nll * keep).sum(1)  # [b]
        correct = ((logits.argmax(-1) == labels) & keep).sum(1)
        count = keep.sum(1)
        return [(float(a), int(c), int(r)) for a, c, r in zip(nll, count, correct, strict=True)]

    def compute_metrics(self, predictions: Sequence[Any], features: Sequence[Feature] = (),
                        examples: Sequence[Any] = ()) -> dict[str, float]:
        nll = sum(p[0] for p in predictions)
        count = sum(p[1] for p in predictions)
        out = perplexity(nll, count)
        out["accuracy"] = sum(p[2] for p in predictions) / count
        out["masked_tokens"] = float(count)
        return out


MLM = register_task(MlmTask())
WIKITEXT2 = register_task(MlmTask(name="wikitext2", subpath="corpus_en/wikitext-2"))


@dataclass
class SeededMasking:
    """Masks drawn from a generator seeded by (seed, the batch's block indices): the same
    batch always gets the same masks, whatever came before it. So a resumed run masks its
    batches exactly as the uninterrupted one did (the collator's own generator is not in
    the checkpoint), and every evaluation masks the dev blocks alike."""

    collate: KeepKeys  # around a DataCollatorForLanguageModeling
    seed: int

    def __call__(self, features: list[Feature]) -> dict:
        blocks = ",".join(str(f.get("block_index", -1)) for f in features)
        digest = hashlib.sha256(f"mlm:{self.seed}:{blocks}".encode()).digest()
        inner: Any = self.collate.inner  # a DataCollatorForLanguageModeling
        inner.generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
        return self.collate(features)

