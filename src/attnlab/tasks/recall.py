"""Multi-query associative recall (MQAR): a seeded generator, the JSONL loader and the task.

MQAR (Arora, Eyuboglu et al., "Zoology: Measuring and Improving Recall in Efficient
Language Models", 2023) asks a model to recall, at each query, the value that went with a
key earlier in the sequence. ``multiquery_ar`` follows ``multiquery_ar`` of
github.com/HazyResearch/zoology ``zoology/data/multiquery_ar.py`` (formerly
``associative_recall.py``) draw for draw:

- the vocabulary 0..V-1 is split in two: keys are drawn from 1..V/2-1, values from
  V/2..V-1 (0 is the filler); each example draws ``num_kv_pairs`` distinct keys and
  distinct values without replacement, and starts with them as ``k1 v1 k2 v2 ...``;
- the rest of the sequence, ``space = (n - 2 * num_kv_pairs) / 2`` even slots, receives one
  query per key: the slot of key i is drawn without replacement with probability
  ``p(g) ~ power_a * g ** (power_a - 1)`` for g = 1..space (a power law: most queries come
  soon after the context, as repeated bigrams do in text); the query is the key itself;
- in zoology's causal language-model form the label of a query is the next-token target
  at the query's position (the input after it is filler, not the value); ``-100`` elsewhere;
- ``random_non_queries``: every remaining 0 becomes a uniform random token of 0..V-1.

Checks as zoology asserts them: n even, V > n, ``4 * num_kv_pairs <= n``. Defaults are
zoology's (``MQARConfig``, its experiment configs): V = 8,192, 8 pairs, ``power_a = 0.01``,
random filler on, one pass over the pairs.

Deviations, all for reproducibility: the draws come from ``numpy.random.RandomState(seed)``
instead of the global ``np.random.seed(seed)`` (same stream, so the same keys, values and
query slots as zoology's for one seed); the filler comes from ``torch.Generator`` seeded
with ``seed`` instead of torch's global generator. Split seeds follow zoology's
``prepare_data``: from ``RandomState(seed)``, the train seed in ``[0, 2**31)``, the dev and
test seeds in ``[2**31, 2**32)``, so train and evaluation never share a stream.

As an encoder task (bidirectional, so the value must not be in the input: it is not) this
is token classification at the query positions: the label of a query is its value (a class
id among V), every other position is ignored (``-100``); the metric is accuracy over query
positions. Inputs have no ``[CLS]``/``[SEP]``: the sequence is zoology's, one symbol per
position, mapped to ids by ``symbols.symbol_ids`` (the compact vocabulary, or a block of
ordinary ids of another tokenizer, e.g. the embedded BERT one of ``scratch:SIZE``).

File format (``attnlab data recall``): ``{train,dev,test}.jsonl``, one example per line::

    {"vocab_size": 8192, "input": [17, 5001, ...], "queries": [[40, 5001], ...]}

``queries`` holds ``[position, value]`` pairs. The loader checks each line against the
construction (ids in range, each query a key whose ``key value`` pair precedes it) and names
``file:line`` on the first fault.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..io import atomic_path, write_splits
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
    to_numpy,
    unpad,
)
from .symbols import number_names, symbol_ids

# zoology's defaults (MQARConfig and its experiment configs)
VOCAB_SIZE, NUM_KV_PAIRS, POWER_A, INPUT_SEQ_LEN = 8192, 8, 0.01, 64
NUM_TRAIN, NUM_DEV, NUM_TEST = 100_000, 3_000, 3_000
MAX_SEED = 2**32  # zoology's prepare_data: train seeds below MAX_SEED // 2, test seeds above
FILES = {"train": "train.jsonl", "dev": "dev.jsonl", "test": "test.jsonl"}
IGNORE = -100  # label of a position that is not a query
GENERATE_HINT = "generate them with `attnlab data recall --out DIR`, then task.data_dir=DIR"


# ----------------------------------------------------------------------------- generator


def check_settings(vocab_size: int, input_seq_len: int, num_kv_pairs: int) -> None:
    """zoology's assertions, as errors naming the fix."""
    if input_seq_len < 4 or input_seq_len % 2:
        raise ValueError(f"input_seq_len must be even and >= 4, got {input_seq_len}")
    if vocab_size <= input_seq_len:
        raise ValueError(f"vocab_size ({vocab_size}) must be larger than input_seq_len "
                         f"({input_seq_len}), as zoology requires")
    if num_kv_pairs < 1 or 4 * num_kv_pairs > input_seq_len:
        raise ValueError(f"num_kv_pairs={num_kv_pairs} needs 4 * num_kv_pairs <= "
                         f"input_seq_len={input_seq_len} (context plus one query slot each)")


def multiquery_ar(
    num_examples: int, *, vocab_size: int = VOCAB_SIZE, input_seq_len: int = INPUT_SEQ_LEN,
    seed: int = 0, power_a: float = POWER_A, num_kv_pairs: int = NUM_KV_PAIRS,
    random_non_queries: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs [N, n], labels [N, n])`` int64, zoology's construction (module docstring);
    ``labels`` holds the value at each query position and ``IGNORE`` elsewhere."""
    check_settings(vocab_size, input_seq_len, num_kv_pairs)
    rs = np.random.RandomState(seed)
    n, k = input_seq_len, num_kv_pairs
    context_size = 2 * k
    key_choices = np.arange(1, vocab_size // 2)
    value_choices = np.arange(vocab_size // 2, vocab_size)
    # zoology: np.apply_along_axis(np.random.choice, 1, tiled, replace=False, size=k), i.e.
    # one choice per example, in example order: the same draws as this loop
    keys = np.array([rs.choice(key_choices, replace=False, size=k)
                     for _ in range(num_examples)], dtype=np.int64).reshape(num_examples, k)
    values = np.array([rs.choice(value_choices, replace=False, size=k)
                       for _ in range(num_examples)], dtype=np.int64).reshape(num_examples, k)
    kvs = np.zeros((num_examples, context_size), dtype=np.int64)  # [N, 2k]: k1 v1 k2 v2 ...
    kvs[:, 0::2], kvs[:, 1::2] = keys, values
    space = (n - context_size) // 2
    p = power_a * np.arange(1, space + 1) ** (power_a - 1)
    p = p / p.sum()
    slots = np.arange(space)
    gaps = np.array([rs.choice(slots, replace=False, p=p, size=k) for _ in range(num_examples)],
                    dtype=np.int64).reshape(num_examples, k)
    queries = np.zeros((num_examples, n - context_size + 1), dtype=np.int64)
    np.put_along_axis(queries, gaps * 2, keys, axis=1)
    examples = np.concatenate([kvs, queries], axis=1)  # [N, n + 1]
    labels = np.full((num_examples, n + 1), IGNORE, dtype=np.int64)
    np.put_along_axis(labels, gaps * 2 + context_size + 1, values, axis=1)
    inputs, labels = examples[:, :-1].copy(), labels[:, 1:].copy()  # next-token alignment
    if random_non_queries:
        g = torch.Generator().manual_seed(seed)
        fill = torch.randint(vocab_size, size=inputs.shape, generator=g).numpy()
        inputs[inputs == 0] = fill[inputs == 0]
    return inputs, labels


@dataclass(frozen=True)
class RecallExample:
    """One sequence. ``tokens``: symbol ids 0..vocab_size-1; ``queries``: ``(position,
    value)`` pairs, the value the model must output at that position."""

    guid: str
    tokens: tuple[int, ...]
    queries: tuple[tuple[int, int], ...]
    vocab_size: int


def split_seeds(seed: int) -> dict[str, int]:
    """Per-split seeds drawn as zoology's ``prepare_data`` draws them."""
    rs = np.random.RandomState(seed)
    train = int(rs.randint(0, MAX_SEED // 2))
    dev, test = (int(s) for s in rs.randint(MAX_SEED // 2, MAX_SEED, size=2))
    return {"train": train, "dev": dev, "test": test}


def generate_recall(
    num_train: int = NUM_TRAIN, num_dev: int = NUM_DEV, num_test: int = NUM_TEST, *,
    vocab_size: int = VOCAB_SIZE, input_seq_len: int = INPUT_SEQ_LEN,
    num_kv_pairs: int = NUM_KV_PAIRS, power_a: float = POWER_A,
    random_non_queries: bool = True, seed: int = 0,
) -> dict[str, list[RecallExample]]:
    """``{"train": [...], "dev": [...], "test": [...]}`` examples, seeded (``split_seeds``)."""
    counts = {"train": num_train, "dev": num_dev, "test": num_test}
    if min(counts.values()) < 0:
        raise ValueError("sample counts must be >= 0")
    check_settings(vocab_size, input_seq_len, num_kv_pairs)
    out = {}
    for split, s in split_seeds(seed).items():
        inputs, labels = multiquery_ar(
            counts[split], vocab_size=vocab_size, input_seq_len=input_seq_len, seed=s,
            power_a=power_a, num_kv_pairs=num_kv_pairs, random_non_queries=random_non_queries)
        out[split] = [_example(f"{split}-{i}", row, lab, vocab_size)
                      for i, (row, lab) in enumerate(zip(inputs, labels, strict=True))]
    return out


def _example(guid: str, row: np.ndarray, lab: np.ndarray, vocab_size: int) -> RecallExample:
    pos = np.flatnonzero(lab != IGNORE)
    return RecallExample(guid, tuple(int(t) for t in row),
                         tuple((int(p), int(lab[p])) for p in pos), vocab_size)


def write_jsonl(examples: Iterable[RecallExample], path: str | Path) -> Path:
    """One compact JSON object per line (module docstring); atomic (``io``)."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for ex in examples:
            fh.write(json.dumps({"vocab_size": ex.vocab_size, "input": list(ex.tokens),
                                 "queries": [list(q) for q in ex.queries]},
                                separators=(",", ":")) + "\n")
    return path


def write_recall(out_dir: str | Path, **kwargs: Any) -> dict[str, Path]:
    """Generate (``generate_recall`` arguments) and write ``{train,dev,test}.jsonl``
    (``io.write_splits``: nothing is made when an argument is refused or a write fails)."""
    return write_splits(Path(out_dir).expanduser(), generate_recall(**kwargs), FILES,
                        write_jsonl)


# ----------------------------------------------------------------------------- loader


def check_example(record: Any) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], int]:
    """``(tokens, queries, vocab_size)`` of one parsed JSON line; ValueError naming the
    fault if it does not follow the construction."""
    if not isinstance(record, dict) or set(record) != {"vocab_size", "input", "queries"}:
        raise ValueError("expected an object with the keys vocab_size, input, queries")
    v, toks, queries = record["vocab_size"], record["input"], record["queries"]
    if not isinstance(v, int) or isinstance(v, bool) or v < 4:
        raise ValueError(f"vocab_size must be an int >= 4, got {v!r}")
    if (not isinstance(toks, list) or not toks
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks)):
        raise ValueError("input must be a non-empty list of ints")
    arr = np.asarray(toks, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= v:
        raise ValueError(f"input ids must lie in 0..{v - 1}")
    if not isinstance(queries, list) or not queries:
        raise ValueError("queries must be a non-empty list of [position, value] pairs")
    seen: set[int] = set()
    pairs = []
    for q in queries:
        if (not isinstance(q, list) or len(q) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in q)):
            raise ValueError(f"query {q!r} is not a [position, value] pair of ints")
        pos, value = q
        if not 0 <= pos < len(toks) or pos in seen:
            raise ValueError(f"query position {pos} is out of range or repeated")
        if not v // 2 <= value < v:
            raise ValueError(f"query value {value} is not a value id ({v // 2}..{v - 1})")
        key = toks[pos]
        if not 1 <= key < v // 2:
            raise ValueError(f"position {pos} holds {key}, not a key id (1..{v // 2 - 1})")
        before = arr[:pos]
        if not np.any((before[:-1] == key) & (before[1:] == value)):
            raise ValueError(f"query at position {pos} asks key {key}, but no '{key} {value}' "
                             "pair precedes it")
        seen.add(pos)
        pairs.append((pos, value))
    return tuple(toks), tuple(pairs), v


def read_jsonl(path: Path, split: str) -> list[RecallExample]:
    """Parse one file; a malformed line raises DataFormatError naming ``file:line``."""
    out = []
    for lineno, line in read_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(path, lineno, f"not valid JSON ({e.msg})") from None
        try:
            toks, queries, v = check_example(record)
        except ValueError as e:
            raise DataFormatError(path, lineno, str(e)) from None
        out.append(RecallExample(f"{split}-{lineno}", toks, queries, v))
    return out


# ----------------------------------------------------------------------------- task


@dataclass(frozen=True, kw_only=True)
class RecallTask:
    """MQAR as token classification at the query positions (see the module docstring).

    ``num_labels`` is the largest vocabulary the task takes (a class per symbol id); data of
    a larger vocabulary is refused at load.
    """

    name: str = "recall"
    head: HeadType = "token-classification"
    num_labels: int = VOCAB_SIZE
    problem_type: ProblemType | None = "single_label_classification"
    main_metric: str = "accuracy"
    greater_is_better: bool = True
    splits: tuple[str, ...] = ("train", "dev", "test")
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("dev",)

    @property
    def label_names(self) -> tuple[str, ...]:
        """Class i is symbol id i."""
        return number_names(self.num_labels)

    def load(self, split: str, data_dir: str | Path | None = None) -> list[RecallExample]:
        """``data_dir``: the data root (``recall/`` below it) or the folder of the files."""
        split = canonical_split(split, self.splits, self.name)
        if data_dir is None or str(data_dir) == BUILTIN:
            raise FileNotFoundError(f"recall has no hub or built-in copy; {GENERATE_HINT}")
        try:
            folder = find_dir(data_dir, ["", "recall"], FILES[split], f"recall {split}")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} {GENERATE_HINT}.") from None
        path = folder / FILES[split]
        examples = read_jsonl(path, split)
        big = max((ex.vocab_size for ex in examples), default=0)
        if big > self.num_labels:
            raise DataFormatError(path, None, f"vocab_size {big} exceeds the task's "
                                  f"{self.num_labels} classes; generate with --vocab-size "
                                  f"<= {self.num_labels}")
        return examples

    def encode(self, examples: Sequence[RecallExample], tokenizer: Any, max_length: int
               ) -> list[Feature]:
        """One id per symbol (``symbols.symbol_ids``), truncated to ``max_length`` (queries
        cut off are dropped); labels: the value at query positions, -100 elsewhere."""
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        vocab = max((ex.vocab_size for ex in examples), default=0)
        ids = symbol_ids(tokenizer, number_names(vocab))
        feats = []
        for i, ex in enumerate(examples):
            n = min(len(ex.tokens), max_length)
            labels = [IGNORE] * n
            for pos, value in ex.queries:
                if pos < n:
                    labels[pos] = value
            feats.append({"input_ids": [ids[t] for t in ex.tokens[:n]],
                          "attention_mask": [1] * n, "labels": labels, "example_index": i})
        return feats

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]:
        # heavy: transformers; the CLI imports tasks at start
        from transformers import DataCollatorForTokenClassification

        return KeepKeys(DataCollatorForTokenClassification(tokenizer), MODEL_INPUT_KEYS)

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        """Predicted symbol id per real position of each feature (``[n_i]`` int arrays)."""
        return unpad(to_numpy(outputs["logits"]).argmax(-1), batch)

    def compute_metrics(self, predictions: Sequence[Any], features: Sequence[Feature],
                        examples: Sequence[Any] = ()) -> dict[str, float]:
        """Accuracy over query positions (every query of every feature counts once)."""
        if len(predictions) != len(features):
            raise ValueError(f"{len(predictions)} predictions for {len(features)} features")
        right = total = 0
        for pred, f in zip(predictions, features, strict=True):
            labels = np.asarray(f["labels"])
            mask = labels != IGNORE
            right += int((np.asarray(pred)[: len(labels)][mask] == labels[mask]).sum())
            total += int(mask.sum())
        return {"accuracy": right / total if total else 0.0}


RECALL = register_task(RecallTask())
