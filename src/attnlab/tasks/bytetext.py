"""Byte-level long-text classification (task ``text``): a seeded generator built from SST-2,
the JSONL loader and the task.

The Long Range Arena's Text task (Tay et al., ICLR 2021) classifies IMDb reviews read as
bytes, truncated or padded to 4K. IMDb is not staged here, so ``generate_text`` builds
documents of LRA-Text-like lengths from the GLUE SST-2 sentences (``../shared/data``), with
one designated, marked segment whose sentiment is the label:

- each document draws its label first (0 or 1 with equal probability, so the majority class
  is 50%), then its designated sentence uniformly among the split's sentences of that label
  whose marked form fits; then a target length uniform in ``[min_bytes, max_bytes]``;
- distractor sentences are drawn uniformly (either label) from the same split and appended
  while the document stays within the target; the first that does not fit ends the list.
  So ``max_bytes`` bounds every document, while ``min_bytes`` bounds only the target: a
  document can end below it. With the defaults (1,000-4,000 bytes, seed 0) 1.4% of the
  training and 2.2% of the dev documents are shorter than 1,000 bytes (the shortest 839),
  medians 2,449 and 2,419 bytes. At short targets whole sentences rarely fit: at 63-126
  bytes (``bench lra --length 128``) 48% of the training and 95% of the dev documents are
  the marked sentence alone (SST-2's training rows are mostly phrases, its dev rows whole
  sentences, about twice as long);
- the designated sentence goes, wrapped in the control bytes ``MARK_OPEN`` (0x02) and
  ``MARK_CLOSE`` (0x03), at a uniform position among the segments; segments are joined by
  one space (sentences are stripped first; SST-2 holds no control bytes);
- the label is the designated sentence's SST-2 label. Distractors carry random labels, so
  the document's overall sentiment says nothing: the model has to find the marked segment,
  anywhere in the document, and read it.

Splits come from the source's own: ``train`` documents only from SST-2 ``train.tsv``,
``dev`` documents only from ``dev.tsv`` (train sentences that equal a dev sentence are
dropped), so no sentence is shared between training and evaluation. Seeds:
``random.Random(f"text:{seed}:{split}")``, so a split never depends on another's size.
Dev documents may share a designated sentence (SST-2 dev has 872).

Encoding: ``[CLS]`` + the UTF-8 bytes of the document + ``[SEP]``, one id per byte
(``symbols.BYTE_NAMES`` through ``symbols.symbol_ids``), truncated to ``max_length``
(generate with ``max_bytes <= max_length - 2`` so that no marked segment is cut off).
Binary sequence classification, accuracy.

File format (``attnlab data text``): ``{train,dev}.jsonl``, one document per line::

    {"text": "... \\u0002a gorgeous film\\u0003 ...", "label": 1, "source": "train-1234"}

``source`` is the designated sentence's SST-2 split and file line. The loader checks the
markers and the label and names ``file:line`` on the first fault.
"""

from __future__ import annotations

import functools
import json
import random
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..io import atomic_path, write_splits
from .base import (
    BUILTIN,
    DataFormatError,
    Feature,
    HeadType,
    ProblemType,
    canonical_split,
    find_dir,
    logit_rows,
    padding_collator,
    read_lines,
    register_task,
)
from .metrics import argmax_accuracy
from .symbols import BYTE_NAMES, symbol_ids

MARK_OPEN, MARK_CLOSE, SEPARATOR = "\x02", "\x03", " "
MIN_BYTES, MAX_BYTES = 1000, 4000  # document lengths (LRA Text: up to 4K bytes)
NUM_TRAIN, NUM_DEV = 25_000, 1_000  # IMDb's 25,000 training reviews; a dev set for speed
FILES = {"train": "train.jsonl", "dev": "dev.jsonl"}
LABEL_NAMES = ("negative", "positive")  # SST-2's 0 and 1
GENERATE_HINT = ("generate them with `attnlab data text --out DIR` (from GLUE SST-2), then "
                 "task.data_dir=DIR")


@dataclass(frozen=True)
class Sentence:
    """A source sentence: stripped text, label 0/1, and where it came from (``split-line``)."""

    text: str
    label: int
    source: str


@dataclass(frozen=True)
class ByteTextExample:
    """One document; ``text`` holds exactly one marked segment."""

    guid: str
    text: str
    label: int
    source: str


# ----------------------------------------------------------------------------- generator


def sst2_sentences(data_dir: str | Path) -> dict[str, tuple[Sentence, ...]]:
    """SST-2 train and dev sentences from the GLUE files under ``data_dir`` (stripped; train
    sentences equal to a dev sentence dropped). Cached per folder and file modification
    time: the 67,349 training rows are read once per process."""
    if str(data_dir) == BUILTIN:
        raise FileNotFoundError("the text task is built from the GLUE SST-2 files; give the "
                                "data root holding glue/SST-2 (e.g. ../shared/data)")
    from .glue import GLUE_TASKS  # the one SST-2 reader

    folder = find_dir(data_dir, ["", "SST-2", "glue/SST-2", "glue_data/SST-2"], "train.tsv",
                      "GLUE SST-2 (the text task's source)")
    stamp = tuple((folder / f"{s}.tsv").stat().st_mtime_ns for s in ("train", "dev")
                  if (folder / f"{s}.tsv").is_file())
    return _read_sst2(str(folder.resolve()), stamp, GLUE_TASKS["sst2"])


@functools.lru_cache(maxsize=4)
def _read_sst2(folder: str, stamp: tuple[int, ...], sst2: Any
               ) -> dict[str, tuple[Sentence, ...]]:
    out: dict[str, tuple[Sentence, ...]] = {}
    for split in ("dev", "train"):
        rows = sst2.load(split, folder)
        out[split] = tuple(Sentence(r.text_a.strip(), int(r.label), r.guid) for r in rows
                           if r.label is not None and r.text_a.strip())
    dev_texts = {s.text for s in out["dev"]}
    return {"train": tuple(s for s in out["train"] if s.text not in dev_texts),
            "dev": out["dev"]}


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def make_document(rng: random.Random, sentences: Sequence[Sentence],
                  by_label: Sequence[Sequence[Sentence]], min_bytes: int, max_bytes: int
                  ) -> tuple[str, int, str]:
    """``(text, label, source)`` of one document, drawn as the module docstring says."""
    label = rng.randrange(2)
    designated = rng.choice(by_label[label])
    marked = f"{MARK_OPEN}{designated.text}{MARK_CLOSE}"
    target = rng.randint(min_bytes, max_bytes)
    size, parts = _nbytes(marked), []
    while True:
        s = rng.choice(sentences)
        grow = _nbytes(s.text) + len(SEPARATOR)
        if size + grow > target:
            break
        parts.append(s.text)
        size += grow
    parts.insert(rng.randrange(len(parts) + 1), marked)
    return SEPARATOR.join(parts), label, designated.source


def generate_text(data_dir: str | Path, num_train: int = NUM_TRAIN, num_dev: int = NUM_DEV, *,
                  min_bytes: int = MIN_BYTES, max_bytes: int = MAX_BYTES, seed: int = 0
                  ) -> dict[str, list[ByteTextExample]]:
    """``{"train": [...], "dev": [...]}`` documents from SST-2 under ``data_dir``, seeded."""
    if num_train < 0 or num_dev < 0:
        raise ValueError("document counts must be >= 0")
    if not 0 < min_bytes <= max_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    counts = {"train": num_train, "dev": num_dev}
    out = {}
    for split, sentences in sst2_sentences(data_dir).items():
        fits = [s for s in sentences if _nbytes(s.text) + 2 <= max_bytes]
        by_label = [[s for s in fits if s.label == c] for c in (0, 1)]
        if not all(by_label):
            raise ValueError(f"no SST-2 {split} sentence of some label fits max_bytes="
                             f"{max_bytes} with its two markers; raise max_bytes")
        rng = random.Random(f"text:{seed}:{split}")
        docs = (make_document(rng, sentences, by_label, min_bytes, max_bytes)
                for _ in range(counts[split]))
        out[split] = [ByteTextExample(f"{split}-{i}", text, label, source)
                      for i, (text, label, source) in enumerate(docs)]
    return out


def write_jsonl(examples: Iterable[ByteTextExample], path: str | Path) -> Path:
    """One JSON object per line (module docstring); atomic (``io``)."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for ex in examples:
            fh.write(json.dumps({"text": ex.text, "label": ex.label, "source": ex.source},
                                ensure_ascii=True) + "\n")
    return path


def write_text(out_dir: str | Path, data_dir: str | Path, **kwargs: Any) -> dict[str, Path]:
    """Generate (``generate_text`` arguments) and write ``{train,dev}.jsonl``
    (``io.write_splits``: nothing is made when an argument is refused or a write fails)."""
    return write_splits(Path(out_dir).expanduser(), generate_text(data_dir, **kwargs), FILES,
                        write_jsonl)


def marked_segment(text: str) -> str:
    """The designated sentence of a document; ValueError unless there is exactly one
    ``MARK_OPEN ... MARK_CLOSE`` pair, in that order."""
    if text.count(MARK_OPEN) != 1 or text.count(MARK_CLOSE) != 1:
        raise ValueError("expected exactly one marked segment (one \\u0002 and one \\u0003)")
    start, end = text.index(MARK_OPEN), text.index(MARK_CLOSE)
    if end < start:
        raise ValueError("the segment's closing mark \\u0003 comes before its opening \\u0002")
    if end == start + 1:
        raise ValueError("the marked segment is empty (\\u0002 right before \\u0003); the "
                         "label needs a sentence between the marks")
    return text[start + 1 : end]


# ----------------------------------------------------------------------------- task


def read_jsonl(path: Path, split: str) -> list[ByteTextExample]:
    """Parse one file; a malformed line raises DataFormatError naming ``file:line``."""
    out = []
    for lineno, line in read_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(path, lineno, f"not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or set(rec) != {"text", "label", "source"}:
            raise DataFormatError(path, lineno, "expected an object with the keys text, "
                                  "label, source")
        if not isinstance(rec["text"], str) or not isinstance(rec["source"], str):
            raise DataFormatError(path, lineno, "text and source must be strings")
        if type(rec["label"]) is not int or rec["label"] not in (0, 1):
            raise DataFormatError(path, lineno, f"bad label {rec['label']!r}; expected 0 or 1")
        try:
            marked_segment(rec["text"])
        except ValueError as e:
            raise DataFormatError(path, lineno, str(e)) from None
        out.append(ByteTextExample(f"{split}-{lineno}", rec["text"], rec["label"], rec["source"]))
    return out


@dataclass(frozen=True, kw_only=True)
class ByteTextTask:
    """Byte-level classification of long documents by their marked segment (module doc)."""

    name: str = "text"
    head: HeadType = "sequence-classification"
    num_labels: int = 2
    problem_type: ProblemType | None = "single_label_classification"
    label_names: tuple[str, ...] = LABEL_NAMES
    main_metric: str = "accuracy"
    greater_is_better: bool = True
    splits: tuple[str, ...] = ("train", "dev")
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("dev",)

    def load(self, split: str, data_dir: str | Path | None = None) -> list[ByteTextExample]:
        """``data_dir``: the data root (``text/`` below it) or the folder of the files."""
        split = canonical_split(split, self.splits, self.name)
        if data_dir is None or str(data_dir) == BUILTIN:
            raise FileNotFoundError(f"text has no hub or built-in copy; {GENERATE_HINT}")
        try:
            folder = find_dir(data_dir, ["", "text"], FILES[split], f"text {split}")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} {GENERATE_HINT}.") from None
        return read_jsonl(folder / FILES[split], split)

    def encode(self, examples: Sequence[ByteTextExample], tokenizer: Any, max_length: int
               ) -> list[Feature]:
        """``[CLS] bytes [SEP]``, one id per byte, truncated to ``max_length``."""
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 ([CLS] and [SEP]), got {max_length}")
        ids = np.asarray(symbol_ids(tokenizer, BYTE_NAMES), dtype=np.int64)
        cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
        feats, cut = [], 0
        for i, ex in enumerate(examples):
            data = ex.text.encode("utf-8")
            cut += data.find(MARK_CLOSE.encode()) >= max_length - 2  # the segment's end is lost
            raw = np.frombuffer(data[: max_length - 2], dtype=np.uint8)
            body = ids[raw].tolist()
            feats.append({"input_ids": [cls, *body, sep], "attention_mask": [1] * (len(body) + 2),
                          "labels": ex.label, "example_index": i})
        if cut:
            warnings.warn(f"text: {cut} of {len(examples)} documents lose (part of) their marked "
                          f"segment at max_length {max_length}, so their label cannot be read; "
                          f"generate documents of at most {max_length - 2} bytes (`attnlab data "
                          f"text --max-bytes {max_length - 2}` with a --min-bytes below it) or "
                          "raise max_length", stacklevel=2)
        return feats

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]:
        return padding_collator(tokenizer)

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        """One logits row ``[2]`` per feature."""
        return logit_rows(outputs)

    def compute_metrics(self, predictions: Sequence[Any], features: Sequence[Feature],
                        examples: Sequence[Any] = ()) -> dict[str, float]:
        return argmax_accuracy(predictions, features)


TEXT = register_task(ByteTextTask())
