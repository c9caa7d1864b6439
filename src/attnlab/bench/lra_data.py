"""The data of ``attnlab bench lra``: each task at one sequence length, in the compact
vocabulary, made the same way for every mechanism and seed.

Every task is built at the bench's length ``L`` from seed ``DATA_SEED`` (the data is fixed,
as in LRA; ``--seeds`` vary the model's initialisation, data order and dropout), with
``train_size`` training and ``eval_size`` evaluation examples, and encoded with the compact
vocabulary of ``tasks.symbols`` (the from-scratch encoder gets ``vocab_size =
len(tokenizer)``):

- ``listops``: LRA's generator (``tasks.listops``), trees of LRA's lengths (more than 500 and
  fewer than 2,000 tokens) cut to what fits ``[CLS] tokens [SEP]`` in L: fewer than
  ``min(2000, L - 1)`` tokens and more than ``min(500, that // 4)``; 15 symbols;
- ``recall``: MQAR with Zoology's defaults (``tasks.recall``: 8 key-value pairs, power law
  ``a = 0.01``, random filler) at sequence length L (L - 1 when L is odd) and vocabulary
  8,192, or the next power of two above L when L reaches it (Zoology needs V > L). The
  pairs do not grow with L (Zoology's sweeps grow them), and the power law keeps most
  queries near them: the median query position is 50 at L = 512
  (``scripts/lra_task_shapes.py``);
- ``text``: documents from SST-2 (``tasks.bytetext``) of at most ``L - 2`` bytes, so the
  whole document, marked segment included, fits ``[CLS] bytes [SEP]``, each aiming at a
  length drawn from ``L // 2 - 1`` to ``L - 2`` (a document ends at the first sentence that
  does not fit, so at small L most are shorter: at L = 128, 95% of the dev documents are
  the marked sentence alone; ``tasks.bytetext``, ``scripts/lra_task_shapes.py``); read
  from ``data_dir`` (the shared data root holding ``glue/SST-2``).

Evaluation uses each task's dev split (ListOps: LRA's validation split).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..tasks import bytetext as bt
from ..tasks import listops as lo
from ..tasks import recall as rc
from ..tasks.base import Feature, Task
from ..tasks.symbols import BYTE_NAMES, number_names, symbol_tokenizer

BENCH_TASKS = ("listops", "recall", "text")
TASK_TITLES = {"listops": "ListOps", "recall": "Recall", "text": "Text"}
DATA_SEED = 0  # the data is the same for every mechanism and seed


@dataclass(frozen=True)
class BenchData:
    """One task's data at one length, encoded.

    task: the task object (encode / collator / predictions / metrics).  tokenizer: the
    compact vocabulary.  train, eval: features.  eval_examples: for ``compute_metrics``.
    about: how the data was made (one line for the report).
    """

    task: Task
    tokenizer: Any
    train: list[Feature]
    eval: list[Feature]
    eval_examples: list
    about: str


def check_task(name: str) -> None:
    if name not in BENCH_TASKS:
        raise ValueError(f"unknown bench task {name!r}; choose from {', '.join(BENCH_TASKS)}")


def listops_bounds(length: int) -> tuple[int, int]:
    """(min, max) tree lengths (exclusive, flat tokens) for the bench at ``length``."""
    high = min(lo.MAX_LENGTH, length - 1)
    return min(lo.MIN_LENGTH, high // 4), high


def recall_vocab(length: int) -> int:
    """Zoology's 8,192 symbols, or the next power of two above ``length``."""
    v = rc.VOCAB_SIZE
    while v <= length:
        v *= 2
    return v


def bench_data(name: str, length: int, train_size: int, eval_size: int,
               data_dir: str | Path) -> BenchData:
    """The data of task ``name`` at ``length`` (see the module docstring)."""
    check_task(name)
    if length < 16:
        raise ValueError(f"--length {length} is too short for the bench tasks; use >= 16")
    if name == "listops":
        low, high = listops_bounds(length)
        rows = lo.generate_listops(train_size, eval_size, 0, min_length=low, max_length=high,
                                   seed=DATA_SEED)
        task: Any = lo.ListOpsTask()
        tok = symbol_tokenizer(list(lo.VOCAB_WORDS.values()))
        train: list[Any] = lo.examples_from_rows(rows["train"], "train")
        dev: list[Any] = lo.examples_from_rows(rows["dev"], "dev")
        about = f"ListOps trees of {low + 1}-{high - 1} tokens (LRA's generator, seed {DATA_SEED})"
    elif name == "recall":
        if length < 4 * rc.NUM_KV_PAIRS:  # each pair and its query take 4 positions
            raise ValueError(f"--length {length} is too short for the recall task ("
                             f"{rc.NUM_KV_PAIRS} key-value pairs and their queries need "
                             f"{4 * rc.NUM_KV_PAIRS} tokens); give --length "
                             f"{4 * rc.NUM_KV_PAIRS} or more")
        n, v = length - length % 2, recall_vocab(length)
        splits = rc.generate_recall(train_size, eval_size, 0, vocab_size=v, input_seq_len=n,
                                    seed=DATA_SEED)
        task = replace(rc.RecallTask(), num_labels=v)
        tok = symbol_tokenizer(number_names(v))
        train, dev = splits["train"], splits["dev"]
        about = (f"MQAR of {n} tokens, {rc.NUM_KV_PAIRS} pairs, vocabulary {v} (Zoology's "
                 f"construction, seed {DATA_SEED})")
    else:
        low, high = length // 2 - 1, length - 2
        docs = bt.generate_text(data_dir, train_size, eval_size, min_bytes=low,
                                max_bytes=high, seed=DATA_SEED)
        task = bt.ByteTextTask()
        tok = symbol_tokenizer(BYTE_NAMES)
        train, dev = docs["train"], docs["dev"]
        about = (f"SST-2 documents of at most {high} bytes (target {low}-{high}) labelled by "
                 f"one marked sentence (seed {DATA_SEED})")
    return BenchData(task=task, tokenizer=tok, train=task.encode(train, tok, length),
                     eval=task.encode(dev, tok, length), eval_examples=list(dev), about=about)
