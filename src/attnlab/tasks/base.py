"""The Task protocol, the task registry, and the small helpers every loader shares.

A task bundles what one training loop needs to handle any head uniformly::

    task = get_task("cola")
    examples = task.load(task.train_split, data_dir="../shared/data")   # typed dataclasses
    features = task.encode(examples, tokenizer, max_length=128)         # list[dict]
    loader = DataLoader(features, batch_size=32, shuffle=True,
                        collate_fn=task.collator(tokenizer, seed=0))
    for batch in loader:                      # dict[str, Tensor], model inputs only
        out = model(**batch)                  # labels / start_positions inside -> out.loss
    # evaluation: same loader without shuffle, then
    preds = [p for batch in loader for p in task.batch_predictions(model(**batch), batch)]
    metrics = task.compute_metrics(preds, features, examples)          # dict[str, float]

Features are plain ``list[dict]`` of Python values, one dict per model input row, in a fixed
order. Keys in ``MODEL_INPUT_KEYS`` are what the collator turns into padded tensors; any
other key (``example_index``, ``offset_mapping``, ``word_ids``) is metadata that stays in the
list for post-processing (SQuAD spans, CoNLL word alignment). Why plain lists rather than a
``datasets.Dataset``: they need no cache directory, pickle cleanly into DataLoader workers,
and metadata with ``None`` values (offsets outside the context) needs no schema.

Predictions are per feature, in feature order (``batch_predictions`` turns one batch's model
output into a list of numpy arrays or tuples; the loop concatenates the lists), so
variable-length outputs never need re-padding across batches.

Split names: ``train``, ``dev``, ``test`` everywhere (plus MNLI's ``dev_matched`` ...);
``valid``/``validation`` are accepted as aliases of ``dev``, also before a suffix (the hub's
``validation_matched`` is ``dev_matched``). ``data_dir`` may be the
shared data root (``../shared/data``), the task's own folder, ``"builtin"`` for the
package's own samples where a task has one, or ``None`` for the Hugging Face hub where a
task supports it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from attnlab.core import Registry
from attnlab.io import not_utf8

HeadType = Literal[
    "sequence-classification", "token-classification", "question-answering", "masked-lm"
]
ProblemType = Literal["single_label_classification", "regression"]
Feature = dict[str, Any]

# Keys the collators turn into tensors; everything else in a feature is metadata.
MODEL_INPUT_KEYS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "labels", "start_positions",
     "end_positions"}
)
BUILTIN = "builtin"  # data_dir value selecting the package's own sample data
SPLIT_ALIASES = {"valid": "dev", "validation": "dev", "val": "dev"}


class MissingPackageError(ImportError):
    """An optional package a setting needs is not installed; the message names the extra."""


def require_package(module: str, extra: str, why: str) -> None:
    """Raise MissingPackageError naming ``pip install 'attnlab[extra]'`` if ``module`` is
    not importable."""
    if importlib.util.find_spec(module) is None:
        raise MissingPackageError(
            f"{why} needs the optional package {module!r}: pip install 'attnlab[{extra}]'")


class DataFormatError(ValueError):
    """Malformed input: names the file, the 1-based line (when known) and what is wrong."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


@runtime_checkable
class Task(Protocol):
    """What the training loop relies on. Concrete tasks are frozen dataclasses.

    name: registry key.  head: which AutoModelFor* head to build.  num_labels: classifier
    width (1 for regression; 0 for QA and masked-LM).  problem_type: for sequence
    classification (None otherwise).  label_names: index -> label string.
    main_metric / greater_is_better: for model selection and ``attnlab compare``.
    splits: the split names ``load`` accepts.  train_split / eval_splits: the defaults a
    runner uses (MNLI evaluates matched and mismatched; the runner prefixes each metric with
    its split name). All read-only (properties here), as fields of a frozen dataclass are.
    """

    @property
    def name(self) -> str: ...
    @property
    def head(self) -> HeadType: ...
    @property
    def num_labels(self) -> int: ...
    @property
    def problem_type(self) -> ProblemType | None: ...
    @property
    def label_names(self) -> tuple[str, ...]: ...
    @property
    def main_metric(self) -> str: ...
    @property
    def greater_is_better(self) -> bool: ...
    @property
    def splits(self) -> tuple[str, ...]: ...
    @property
    def train_split(self) -> str: ...
    @property
    def eval_splits(self) -> tuple[str, ...]: ...

    def load(self, split: str, data_dir: str | Path | None = None) -> list[Any]: ...

    def encode(self, examples: Sequence[Any], tokenizer: Any, max_length: int) -> list[Feature]:
        ...

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]: ...

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        ...

    def compute_metrics(
        self, predictions: Sequence[Any], features: Sequence[Feature], examples: Sequence[Any]
    ) -> dict[str, float]: ...


TASKS: Registry[Task] = Registry("task")


def register_task(task: Task) -> Task:
    """Register a task instance under ``task.name``."""
    return TASKS.register(task.name, task)


def get_task(name: str) -> Task:
    """The registered task ``name`` (``import attnlab.tasks`` registers the built-ins)."""
    return TASKS.get(name)


def list_tasks() -> list[str]:
    return TASKS.names()


def label_maps(task: Task) -> tuple[dict[int, str], dict[str, int]]:
    """``(id2label, label2id)`` for a model config; empty for tasks without labels."""
    id2label = dict(enumerate(task.label_names))
    return id2label, {v: k for k, v in id2label.items()}


# ----------------------------------------------------------------------------- helpers


def canonical_split(split: str, available: Sequence[str], task: str) -> str:
    """Map aliases (``validation`` -> ``dev``, ``validation_matched`` -> ``dev_matched``) and
    reject unknown splits with the known ones."""
    name = SPLIT_ALIASES.get(split, split)
    head, sep, tail = split.partition("_")
    if name not in available and sep and head in SPLIT_ALIASES:
        name = f"{SPLIT_ALIASES[head]}_{tail}"
    if name not in available:
        raise ValueError(
            f"task {task!r} has no split {split!r}; available splits: {', '.join(available)}"
        )
    return name


def find_dir(data_dir: str | Path, subdirs: Sequence[str], marker: str, what: str) -> Path:
    """First of ``data_dir/<sub>`` that holds ``marker``; a clear error listing the tries.

    Lets one ``data_dir`` serve every task: the shared root (``data/glue/CoLA``), the
    benchmark's folder (``glue/CoLA``) or the task folder itself.
    """
    root = Path(data_dir).expanduser()
    if root.is_file():
        raise FileNotFoundError(f"{what}: data_dir {root} is a file; pass the data root (e.g. "
                                "../shared/data) or the task's folder")
    tried = []
    for sub in subdirs:
        cand = root / sub if sub else root
        if (cand / marker).is_file():
            return cand
        tried.append(str(cand / marker))
    raise FileNotFoundError(
        f"{what}: no {marker!r} found; tried {', '.join(tried)}. Pass data_dir pointing at "
        "the data root (e.g. ../shared/data) or at the task's folder."
    )


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line)`` without the line ending; UTF-8, BOM dropped.

    Splits on ``\\n`` only (GLUE sentences may contain other Unicode line separators, which
    ``str.splitlines`` would wrongly split on) and copes with a missing final newline. Each
    line is decoded on its own, so a byte that is not UTF-8 raises DataFormatError naming
    its ``file:line`` (a text-mode reader decodes in blocks and names no line).
    """
    with open(path, "rb") as fh:
        for i, raw in enumerate(fh, start=1):
            if i == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(path, *not_utf8(raw, e, first_line=i)) from None
            if line.endswith("\n"):
                line = line[:-1]
            if line.endswith("\r"):
                line = line[:-1]
            yield i, line


def require_fast(tokenizer: Any, task: str) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"task {task!r} needs a fast tokenizer (offsets and word_ids); load it with "
            "AutoTokenizer.from_pretrained(path, use_fast=True)"
        )


@dataclass(frozen=True)
class KeepKeys:
    """Collator wrapper: drop metadata keys, then pad with the Hugging Face collator."""

    inner: Callable[[list[Feature]], Any]
    keys: frozenset[str]

    def __call__(self, features: list[Feature]) -> dict[str, Any]:
        return dict(self.inner([{k: v for k, v in f.items() if k in self.keys} for f in features]))


def padding_collator(tokenizer: Any) -> KeepKeys:
    """Model inputs only, padded by Hugging Face's ``DataCollatorWithPadding``."""
    from transformers import DataCollatorWithPadding  # heavy: the CLI imports tasks at start

    return KeepKeys(DataCollatorWithPadding(tokenizer), MODEL_INPUT_KEYS)


def logit_rows(outputs: Mapping[str, Any]) -> list:
    """One logits row ``[num_labels]`` per feature (sequence classification)."""
    return list(to_numpy(outputs["logits"]))


def to_numpy(t: Any) -> Any:
    """Detached numpy copy of a tensor; floating types become float32 (bf16 has no numpy)."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.is_floating_point():
            t = t.float()
        return t.numpy()
    return t


def unpad(values: Any, batch: Mapping[str, Any]) -> list[Any]:
    """Split ``values [b, n, ...]`` into per-row arrays holding only the real tokens.

    Uses the attention mask, so left or right padding both give the unpadded sequence.
    """
    arr = to_numpy(values)
    mask = to_numpy(batch["attention_mask"]).astype(bool)  # [b, n]
    return [arr[i][mask[i]] for i in range(arr.shape[0])]
