"""GLUE: nine sentence(-pair) classification and regression tasks.

Sources, in order of precedence:
- ``data_dir`` holding the standard ``glue_data`` TSV layout written by
  ``download_glue_data.py`` (``<root>/CoLA/train.tsv`` ...; the shared data root
  ``../shared/data`` works too, via its ``glue/`` folder). Files are split on tabs with no
  quote handling (MRPC and SST-2 contain bare ``"``), columns are found by header name, and
  every row must have the header's column count.
- ``data_dir="builtin"`` (CoLA only): the package's generated CoLA-format sample
  (``attnlab/data/cola_sample``; see ``attnlab.tasks.sample``).
- ``data_dir=None``: the Hugging Face dataset ``nyu-mll/glue`` (needs the network).

Label ids follow the Hugging Face ``nyu-mll/glue`` order, so either source trains the same
head. Test splits carry no labels (``label=None``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .base import (
    BUILTIN,
    MODEL_INPUT_KEYS,
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
    require_package,
)
from .metrics import MetricSet, glue_metrics

COLA_COLUMNS = ("source", "label", "orig_judgment", "sentence")  # CoLA train/dev: no header


@dataclass(frozen=True)
class GlueExample:
    """One row. ``label`` is a class id, a float score (STS-B) or None (test splits)."""

    guid: str
    text_a: str
    text_b: str | None
    label: int | float | None


@dataclass(frozen=True, kw_only=True)
class GlueTask:
    """A GLUE task: where its files are, which columns hold text and label, which metric."""

    name: str
    folder: str  # glue_data folder name, e.g. "CoLA"
    hf_config: str  # nyu-mll/glue config name
    text_columns: tuple[str, ...]  # TSV header names of the one or two text columns
    hf_text_columns: tuple[str, ...]  # the same columns in the hub dataset
    label_column: str  # TSV header name of the label (absent in test files)
    label_values: tuple[str, ...]  # raw TSV label strings in id order; () = regression
    label_names: tuple[str, ...]
    metric_set: MetricSet
    main_metric: str
    splits: tuple[str, ...] = ("train", "dev", "test")
    eval_splits: tuple[str, ...] = ("dev",)
    train_split: str = "train"
    headerless: tuple[str, ...] = ()  # splits whose TSV has no header (CoLA train/dev)
    has_builtin: bool = False  # data_dir="builtin" reads attnlab/data/<name>_sample
    greater_is_better: bool = True
    head: HeadType = "sequence-classification"

    @property
    def num_labels(self) -> int:
        return len(self.label_values) or 1

    @property
    def problem_type(self) -> ProblemType:
        return "single_label_classification" if self.label_values else "regression"

    # ------------------------------------------------------------------ loading

    def load(self, split: str, data_dir: str | Path | None = None) -> list[GlueExample]:
        split = canonical_split(split, self.splits, self.name)
        if data_dir is None:
            return self._load_hub(split)
        if str(data_dir) == BUILTIN:
            if not self.has_builtin:
                raise ValueError(
                    f"task {self.name!r} has no built-in sample (only cola has); pass "
                    "data_dir with the GLUE TSVs, or None to use the Hugging Face hub"
                )
            folder = Path(str(resources.files("attnlab") / "data" / f"{self.name}_sample"))
            if not (folder / f"{split}.tsv").is_file():
                raise ValueError(f"the built-in {self.name} sample has no {split!r} split; "
                                 "it has train and dev")
        else:
            folder = find_dir(
                data_dir, ["", self.folder, f"glue/{self.folder}", f"glue_data/{self.folder}"],
                f"{split}.tsv", f"GLUE {self.name} {split}",
            )
        return self.read_tsv(folder / f"{split}.tsv", split)

    def read_tsv(self, path: Path, split: str) -> list[GlueExample]:
        """Parse one GLUE TSV; any malformed row raises DataFormatError(path, line)."""
        lines = read_lines(path)
        header: tuple[str, ...]
        if split in self.headerless:
            header = COLA_COLUMNS
        else:
            first = next(lines, None)
            if first is None:
                raise DataFormatError(path, 1, "empty file; expected a header row")
            header = tuple(first[1].split("\t"))
        cols = [self._column(path, header, c) for c in self.text_columns]
        has_label = self.label_column in header
        if not has_label and not split.startswith("test"):
            raise DataFormatError(
                path, 1, f"no {self.label_column!r} column in header {list(header)}"
            )
        label_col = header.index(self.label_column) if has_label else None
        out = []
        for lineno, line in lines:
            if not line:  # a blank line (e.g. a trailing one); rows of empty cells still count
                continue
            row = line.split("\t")
            if len(row) != len(header):
                raise DataFormatError(
                    path, lineno, f"expected {len(header)} tab-separated columns "
                    f"({', '.join(header)}), found {len(row)}"
                )
            label = None if label_col is None else self._parse_label(path, lineno, row[label_col])
            texts = [row[c] for c in cols]
            out.append(GlueExample(
                guid=f"{split}-{lineno}", text_a=texts[0],
                text_b=texts[1] if len(texts) > 1 else None, label=label,
            ))
        return out

    def _column(self, path: Path, header: Sequence[str], name: str) -> int:
        if name not in header:
            raise DataFormatError(path, 1, f"no {name!r} column in header {list(header)}")
        return list(header).index(name)

    def _parse_label(self, path: Path, lineno: int, raw: str) -> int | float:
        raw = raw.strip()
        if not self.label_values:
            try:
                score = float(raw)
            except ValueError:
                score = math.nan
            if not math.isfinite(score):
                raise DataFormatError(path, lineno, f"bad score {raw!r}; expected a number")
            return score
        if raw not in self.label_values:
            raise DataFormatError(
                path, lineno, f"bad label {raw!r}; expected one of {list(self.label_values)}"
            )
        return self.label_values.index(raw)

    def _load_hub(self, split: str) -> list[GlueExample]:
        require_package("datasets", "hub", f"GLUE {self.name} from the Hugging Face hub "
                        "(data_dir None)")
        from datasets import load_dataset  # optional: datasets (the hub extra); network

        hf_split = split.replace("dev", "validation")
        ds = load_dataset("nyu-mll/glue", self.hf_config, split=hf_split)
        out = []
        for i, row in enumerate(ds):
            texts = [row[c] for c in self.hf_text_columns]
            label = row["label"]
            if label is not None and (label == -1 or split.startswith("test")):
                label = None  # the hub marks unlabeled test rows with -1
            elif label is not None and self.label_values:
                label = int(label)
            out.append(GlueExample(
                guid=f"{split}-{i}", text_a=texts[0],
                text_b=texts[1] if len(texts) > 1 else None, label=label,
            ))
        return out

    # ------------------------------------------------------------------ features

    def encode(self, examples: Sequence[GlueExample], tokenizer: Any, max_length: int
               ) -> list[Feature]:
        """Tokenize (pairs truncated longest-first); ``labels`` is set when the split has one."""
        if not examples:
            return []
        texts_a = [e.text_a for e in examples]
        texts_b = [e.text_b or "" for e in examples] if len(self.text_columns) > 1 else None
        enc = tokenizer(texts_a, texts_b, truncation=True, max_length=max_length)
        keys = [k for k in enc.keys() if k in MODEL_INPUT_KEYS]
        feats = []
        for i, ex in enumerate(examples):
            f: Feature = {k: enc[k][i] for k in keys}
            if ex.label is not None:
                f["labels"] = ex.label
            f["example_index"] = i
            feats.append(f)
        return feats

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]:
        return padding_collator(tokenizer)

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        """One logits row ``[num_labels]`` per feature."""
        return logit_rows(outputs)

    def compute_metrics(self, predictions: Sequence[Any], features: Sequence[Feature],
                        examples: Sequence[Any] = ()) -> dict[str, float]:
        if len(predictions) != len(features):
            raise ValueError(f"{len(predictions)} predictions for {len(features)} features")
        if any("labels" not in f for f in features):
            raise ValueError(f"{self.name}: this split has no labels (a test split?)")
        logits = np.stack([np.asarray(p, dtype=np.float64).reshape(-1) for p in predictions])
        labels = [f["labels"] for f in features]
        preds = logits[:, 0] if not self.label_values else logits.argmax(-1)
        return glue_metrics(self.metric_set, list(preds), labels)


_BIN = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_S12 = ("sentence1", "sentence2")

GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in [
        GlueTask(name="cola", folder="CoLA", hf_config="cola", text_columns=("sentence",),
                 hf_text_columns=("sentence",), label_column="label", label_values=_BIN,
                 label_names=("unacceptable", "acceptable"), metric_set="mcc",
                 main_metric="mcc", headerless=("train", "dev"), has_builtin=True),
        GlueTask(name="sst2", folder="SST-2", hf_config="sst2", text_columns=("sentence",),
                 hf_text_columns=("sentence",), label_column="label", label_values=_BIN,
                 label_names=("negative", "positive"), metric_set="accuracy",
                 main_metric="accuracy"),
        GlueTask(name="mrpc", folder="MRPC", hf_config="mrpc",
                 text_columns=("#1 String", "#2 String"), hf_text_columns=_S12,
                 label_column="Quality", label_values=_BIN,
                 label_names=("not_equivalent", "equivalent"), metric_set="f1_accuracy",
                 main_metric="f1"),
        GlueTask(name="stsb", folder="STS-B", hf_config="stsb", text_columns=_S12,
                 hf_text_columns=_S12, label_column="score", label_values=(),
                 label_names=(), metric_set="pearson_spearman", main_metric="spearman"),
        GlueTask(name="qqp", folder="QQP", hf_config="qqp",
                 text_columns=("question1", "question2"),
                 hf_text_columns=("question1", "question2"), label_column="is_duplicate",
                 label_values=_BIN, label_names=("not_duplicate", "duplicate"),
                 metric_set="f1_accuracy", main_metric="f1"),
        GlueTask(name="mnli", folder="MNLI", hf_config="mnli", text_columns=_S12,
                 hf_text_columns=("premise", "hypothesis"), label_column="gold_label",
                 label_values=("entailment", "neutral", "contradiction"),
                 label_names=("entailment", "neutral", "contradiction"),
                 metric_set="accuracy", main_metric="accuracy",
                 splits=("train", "dev_matched", "dev_mismatched", "test_matched",
                         "test_mismatched"),
                 eval_splits=("dev_matched", "dev_mismatched")),
        GlueTask(name="qnli", folder="QNLI", hf_config="qnli",
                 text_columns=("question", "sentence"),
                 hf_text_columns=("question", "sentence"), label_column="label",
                 label_values=_NLI2, label_names=_NLI2, metric_set="accuracy",
                 main_metric="accuracy"),
        GlueTask(name="rte", folder="RTE", hf_config="rte", text_columns=_S12,
                 hf_text_columns=_S12, label_column="label", label_values=_NLI2,
                 label_names=_NLI2, metric_set="accuracy", main_metric="accuracy"),
        GlueTask(name="wnli", folder="WNLI", hf_config="wnli", text_columns=_S12,
                 hf_text_columns=_S12, label_column="label", label_values=_BIN,
                 label_names=("not_entailment", "entailment"), metric_set="accuracy",
                 main_metric="accuracy"),
    ]
}

for _task in GLUE_TASKS.values():
    register_task(_task)
