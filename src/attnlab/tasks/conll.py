"""CoNLL-2003 English named-entity recognition (token classification).

Files: ``train.txt``, ``valid.txt`` (split ``dev``) and ``test.txt`` in the standard column
format: one ``TOKEN POS CHUNK NER`` line per token, a blank line after each sentence,
``-DOCSTART-`` lines between documents. Tags may be IOB1 (the original ``eng.train``) or IOB2;
both become IOB2 on load, so ``B-`` always starts an entity.

Labelling: the first sub-word of each word carries the word's tag; later sub-words and
special tokens get -100 (ignored by the loss), using the fast tokenizer's ``word_ids()``.
Evaluation maps predictions back to words (the first sub-word's class) and scores against
the full gold sentence with seqeval (entity-level micro F1, conlleval rules); words cut off
by ``max_length`` count as predicted ``O``, so truncation can only lower the score.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .base import (
    BUILTIN,
    MODEL_INPUT_KEYS,
    DataFormatError,
    Feature,
    HeadType,
    KeepKeys,
    ProblemType,
    canonical_split,
    find_dir,
    read_lines,
    register_task,
    require_fast,
    to_numpy,
    unpad,
)
from .metrics import ner_metrics

ENTITY_TYPES = ("PER", "ORG", "LOC", "MISC")
# Label ids in the Hugging Face conll2003 order.
NER_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
FILES = {"train": "train.txt", "dev": "valid.txt", "test": "test.txt"}


@dataclass(frozen=True)
class NerExample:
    """One sentence; tags are IOB2 strings, one per token."""

    guid: str
    tokens: tuple[str, ...]
    pos_tags: tuple[str, ...]
    chunk_tags: tuple[str, ...]
    ner_tags: tuple[str, ...]


def iob1_to_iob2(tags: Sequence[str]) -> list[str]:
    """IOB1 -> IOB2: an ``I-X`` that does not continue an ``X`` entity becomes ``B-X``.

    IOB2 input comes back unchanged, so the conversion is safe to apply to any file.
    """
    out: list[str] = []
    prev = "O"
    for tag in tags:
        if tag.startswith("I-") and (prev == "O" or prev[2:] != tag[2:]):
            tag = "B-" + tag[2:]
        out.append(tag)
        prev = tag
    return out


def read_conll(path: Path, split: str = "train",
               entity_types: Sequence[str] = ENTITY_TYPES) -> list[NerExample]:
    """Parse a CoNLL-2003 file; a malformed line raises DataFormatError(path, line)."""
    valid = {"O"} | {f"{p}-{t}" for t in entity_types for p in ("B", "I")}
    out: list[NerExample] = []
    rows: list[list[str]] = []
    start = 0

    def flush() -> None:
        if rows:
            tok, pos, chunk, ner = (tuple(c) for c in zip(*rows, strict=True))
            out.append(NerExample(
                guid=f"{split}-{start}", tokens=tok, pos_tags=pos,
                chunk_tags=tuple(iob1_to_iob2(chunk)), ner_tags=tuple(iob1_to_iob2(ner)),
            ))
            rows.clear()

    for lineno, line in read_lines(path):
        cols = line.split()
        if not cols or cols[0] == "-DOCSTART-":
            flush()
            continue
        if len(cols) != 4:
            raise DataFormatError(
                path, lineno, f"expected 4 space-separated columns (TOKEN POS CHUNK NER), "
                f"found {len(cols)}: {line!r}"
            )
        if cols[3] not in valid:
            raise DataFormatError(
                path, lineno, f"bad NER tag {cols[3]!r}; expected O or B-/I- with one of "
                f"{', '.join(entity_types)}"
            )
        if not rows:
            start = lineno
        rows.append(cols)
    flush()
    return out


@dataclass(frozen=True, kw_only=True)
class ConllTask:
    """CoNLL-2003 NER: 9 IOB2 labels, first-sub-word labelling, seqeval entity F1."""

    name: str = "conll2003"
    label_names: tuple[str, ...] = NER_LABELS
    splits: tuple[str, ...] = ("train", "dev", "test")
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("dev",)
    main_metric: str = "f1"
    greater_is_better: bool = True
    head: HeadType = "token-classification"
    problem_type: ProblemType | None = "single_label_classification"

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def load(self, split: str, data_dir: str | Path | None = None) -> list[NerExample]:
        split = canonical_split(split, self.splits, self.name)
        if data_dir is None or str(data_dir) == BUILTIN:
            raise ValueError(
                f"task {self.name!r} reads local files only: pass data_dir with "
                "train.txt/valid.txt/test.txt (e.g. ../shared/data or ../shared/data/conll2003)"
            )
        folder = find_dir(data_dir, ["", "conll2003"], FILES[split], f"{self.name} {split}")
        types = sorted({n[2:] for n in self.label_names if n != "O"})
        return read_conll(folder / FILES[split], split, types)

    def encode(self, examples: Sequence[NerExample], tokenizer: Any, max_length: int
               ) -> list[Feature]:
        """One feature per sentence; metadata ``word_ids`` maps positions back to words."""
        require_fast(tokenizer, self.name)
        if not examples:
            return []
        label2id = {n: i for i, n in enumerate(self.label_names)}
        enc = tokenizer([list(e.tokens) for e in examples], is_split_into_words=True,
                        truncation=True, max_length=max_length)
        keys = [k for k in enc.keys() if k in MODEL_INPUT_KEYS]
        feats = []
        for i, ex in enumerate(examples):
            word_ids = enc.word_ids(i)
            labels, prev = [], None
            for wid in word_ids:  # first sub-word of each word gets the tag, the rest -100
                labels.append(-100 if wid is None or wid == prev else label2id[ex.ner_tags[wid]])
                prev = wid
            f: Feature = {k: enc[k][i] for k in keys}
            f.update(labels=labels, example_index=i, word_ids=word_ids)
            feats.append(f)
        return feats

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]:
        # heavy: transformers; the CLI imports tasks at start
        from transformers import DataCollatorForTokenClassification

        return KeepKeys(DataCollatorForTokenClassification(tokenizer), MODEL_INPUT_KEYS)

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        """Predicted class id per real token of each feature (``[n_i]`` int arrays)."""
        return unpad(to_numpy(outputs["logits"]).argmax(-1), batch)

    def word_predictions(self, predictions: Sequence[Any], features: Sequence[Feature],
                         examples: Sequence[NerExample]) -> list[list[str]]:
        """Word-level predicted tags per example (first sub-word's class; unseen words O)."""
        tags = [["O"] * len(ex.tokens) for ex in examples]
        for pred, feat in zip(predictions, features, strict=True):
            word_ids = feat["word_ids"]
            pred = np.asarray(pred)
            if len(pred) != len(word_ids):
                raise ValueError(
                    f"prediction of length {len(pred)} for a feature of {len(word_ids)} tokens"
                )
            out = tags[feat["example_index"]]
            prev = None
            for pos, wid in enumerate(word_ids):
                if wid is not None and wid != prev:
                    out[wid] = self.label_names[int(pred[pos])]
                prev = wid
        return tags

    def compute_metrics(self, predictions: Sequence[Any], features: Sequence[Feature],
                        examples: Sequence[NerExample]) -> dict[str, float]:
        pred_tags = self.word_predictions(predictions, features, examples)
        return ner_metrics([list(ex.ner_tags) for ex in examples], pred_tags)


CONLL2003 = register_task(ConllTask())
