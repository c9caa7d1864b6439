"""ListOps from the Long Range Arena: a seeded generator, the TSV loader and the task.

ListOps (Nangia & Bowman, "ListOps: A Diagnostic Dataset for Latent Tree Learning", 2018)
asks for the value of a nested prefix expression over the digits 0-9; the Long Range Arena
(Tay et al., "Long Range Arena: A Benchmark for Efficient Transformers", ICLR 2021) made it
a long-sequence benchmark (500-2000 tokens, 10-way classification). LRA ships no generator
output that can be redistributed here, so ``write_listops`` regenerates the data with the
algorithm of google-research/long-range-arena ``lra_benchmarks/data/listops.py``:

- operators ``[MIN`` ``[MAX`` ``[MED`` (median, ``int(np.median(..))``: truncated) and
  ``[SM`` (sum mod 10), each closed by ``]``; values are the digits 0-9;
- ``generate_tree``: below ``max_depth`` draw ``r = rng.random()``; ``r > 0.25`` gives a
  digit leaf, else an operator with ``rng.randint(2, max_args)`` children; at ``max_depth``
  a leaf is forced. Length: 1 per leaf, 2 per operator (operator token and ``]``); trees
  are kept when ``min_length < length < max_length`` and deduplicated;
- the random draws are made in the official order, but from ``random.Random(seed)``, and
  distinct trees are kept in first-seen order (the official iterates a ``set``, whose order
  changes from run to run): the same arguments give byte-identical files;
- split positionally: the first ``num_train`` trees are train, then val, then test.

File format (as LRA's ``basic_{train,val,test}.tsv``, written with ``csv.writer`` and a tab
delimiter, so rows end in ``\\r\\n``)::

    Source\\tTarget
    ( ( ( [MAX 2 ) 9 ) ] )\\t9        # the tree as the official nested binary tuples

Glossary: ``Tree = int | (operator, (child, ...))``, e.g. ``("[MAX", (2, 9))``; flat tokens:
the Source without parentheses, ``[MAX 2 9 ]``; a tree's length = its number of flat tokens.

Tokenization: parentheses are dropped, as in LRA's models; the closing bracket ``]`` is kept
as a token. LRA's input pipeline (``lra_benchmarks/listops/input_pipeline.py``: tfds'
``Tokenizer()``, alphanumeric tokens only) drops ``]`` as well, so its models see operators
and digits alone and must infer where each argument list ends; here ``]`` marks it, which
makes the task easier and the sequences longer (one token per operator), so accuracies are
not directly comparable with LRA's tables. Each flat token becomes ONE id of the
Hugging Face BERT tokenizer's vocabulary, so the task runs with the embedded MiniLM tokenizer
and with ``scratch:SIZE`` models (same uncased vocabulary of 30,522):

    digit ``0``..``9`` -> id of ``"0"``..``"9"``;  ``]`` -> id of ``"]"``
    ``[MIN`` -> ``"min"``  ``[MAX`` -> ``"max"``  ``[MED`` -> ``"median"``  ``[SM`` -> ``"sum"``

wrapped as ``[CLS] tokens [SEP]`` and truncated to ``max_length`` (``[SEP]`` kept). A
tokenizer lacking one of these single tokens is an error. Labels: the answer digit (10
classes); metric: accuracy.
"""

from __future__ import annotations

import csv
import random
import re
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

MIN, MAX, MED, SUM_MOD, END = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS = (MIN, MAX, MED, SUM_MOD)  # the official order (rng.choice picks from it)
VALUES = tuple(range(10))
VALUE_P = 0.25  # a node below max_depth is a leaf when rng.random() > VALUE_P
DIGITS = tuple(str(v) for v in VALUES)
# LRA defaults (the official absl flags)
NUM_TRAIN, NUM_VALID, NUM_TEST = 96_000, 2_000, 2_000
MAX_DEPTH, MAX_ARGS, MIN_LENGTH, MAX_LENGTH = 10, 10, 500, 2000
FILES = {"train": "basic_train.tsv", "dev": "basic_val.tsv", "test": "basic_test.tsv"}
GENERATE_HINT = "generate them with `attnlab data listops --out DIR`, then task.data_dir=DIR"
# flat token -> BERT vocabulary token (one WordPiece each)
VOCAB_WORDS = {**{d: d for d in DIGITS}, END: "]", MIN: "min", MAX: "max", MED: "median",
               SUM_MOD: "sum"}

Tree = int | tuple[str, tuple["Tree", ...]]  # a leaf digit, or (operator, children)

_KNOWN = frozenset(VOCAB_WORDS) | {"(", ")"}
_PARENS = np.zeros(256, np.int8)
_PARENS[ord("(")], _PARENS[ord(")")] = 1, -1
_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[ord("[")], _BRACKETS[ord("]")] = 1, -1
_EMPTY_OP = re.compile(r"\[[A-Z]+ \]")


# ----------------------------------------------------------------------------- trees


def apply_op(op: str, values: Sequence[int]) -> int:
    """One operator on its argument values (MED truncates like ``int(np.median(values))``)."""
    if op == MIN:
        return min(values)
    if op == MAX:
        return max(values)
    if op == MED:
        s, n = sorted(values), len(values)
        return s[n // 2] if n % 2 else int((s[n // 2 - 1] + s[n // 2]) / 2)
    if op == SUM_MOD:
        return sum(values) % 10
    raise ValueError(f"unknown operator {op!r}; expected one of {', '.join(OPERATORS)}")


def evaluate_tree(tree: Tree) -> int:
    """The answer of a tree (official ``to_value``): a leaf is its digit."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    return apply_op(op, [evaluate_tree(c) for c in children])


def generate_tree(depth: int, rng: random.Random, max_depth: int = MAX_DEPTH,
                  max_args: int = MAX_ARGS) -> tuple[Tree, int]:
    """``(tree, length)``, drawing from ``rng`` in the official order (root: ``depth=1``)."""
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        return rng.choice(VALUES), 1
    length, children = 2, []
    for _ in range(rng.randint(2, max_args)):
        child, n = generate_tree(depth + 1, rng, max_depth, max_args)
        children.append(child)
        length += n
    return (rng.choice(OPERATORS), tuple(children)), length


def tree_tokens(tree: Tree) -> list[str]:
    """Flat tokens, e.g. ``["[MAX", "2", "9", "]"]``."""
    if isinstance(tree, int):
        return [str(tree)]
    op, children = tree
    return [op, *(t for c in children for t in tree_tokens(c)), END]


def to_string(tree: Tree) -> str:
    """The official Source string. An operator with k children is the binary tuple
    ``((..((op, c1), c2).., ck), ])``, printed as ``( a b )`` per tuple:
    ``"( " * (k + 1) + op`` then ``" " + child + " )"`` per child, then ``" ] )"``."""
    if isinstance(tree, int):
        return str(tree)
    op, children = tree
    return ("( " * (len(children) + 1) + op
            + "".join(f" {to_string(c)} )" for c in children) + f" {END} )")


def flat_text(source: str) -> str:
    """Check a Source (with or without parentheses); return its flat tokens, space-joined.

    Raises ValueError naming the fault: unknown token, unbalanced parentheses or operator
    brackets, an operator with no argument, more than one top-level expression. Vectorised
    (numpy, C-level string methods) so that a 600 MB LRA train file loads in reasonable time.
    """
    toks = source.split()
    if not toks:
        raise ValueError("empty Source")
    if not _KNOWN.issuperset(toks):
        bad = next(t for t in toks if t not in _KNOWN)
        raise ValueError(f"unknown token {bad[:20]!r}; expected [MIN [MAX [MED [SM ] 0-9 ( )")
    depth = np.cumsum(_PARENS[np.frombuffer(source.encode("ascii", "replace"), np.uint8)])
    if depth.min() < 0 or depth[-1] != 0:
        raise ValueError("unbalanced parentheses")
    flat = " ".join(source.replace("(", " ").replace(")", " ").split())
    depth = np.cumsum(_BRACKETS[np.frombuffer(flat.encode("ascii"), np.uint8)])
    if depth.min() < 0 or depth[-1] != 0:
        raise ValueError(f"unbalanced brackets: {int(depth[-1])} operator(s) without ']'"
                         if depth.min() >= 0 else "unbalanced brackets: ']' without operator")
    if _EMPTY_OP.search(flat):
        raise ValueError("an operator with no argument")
    if " " in flat and (flat[0] != "[" or depth[:-1].min() <= 0):
        raise ValueError("more than one top-level expression")
    return flat


def parse_tokens(tokens: Iterable[str]) -> Tree:
    """Build the tree from checked flat tokens (see ``flat_text``); iterative."""
    stack: list[tuple[str, list[Tree]]] = [("", [])]
    for tok in tokens:
        if tok == END:
            op, args = stack.pop()
            stack[-1][1].append((op, tuple(args)))
        elif tok.startswith("["):
            stack.append((tok, []))
        else:
            stack[-1][1].append(int(tok))
    return stack[0][1][0]


def parse_source(source: str) -> Tree:
    """Source string (official parenthesised form, or flat) -> tree; ValueError if malformed."""
    return parse_tokens(flat_text(source).split())


# ----------------------------------------------------------------------------- generator


def _can_exceed(min_length: int, max_depth: int, max_args: int) -> bool:
    length = 1  # the longest tree: max_args children at every level
    for _ in range(max_depth - 1):
        if length > min_length:
            break
        length = 2 + max_args * length
    return length > min_length


def generate_listops(
    num_train: int = NUM_TRAIN, num_valid: int = NUM_VALID, num_test: int = NUM_TEST, *,
    max_depth: int = MAX_DEPTH, max_args: int = MAX_ARGS, min_length: int = MIN_LENGTH,
    max_length: int = MAX_LENGTH, seed: int = 0, progress: bool = False,
    max_stall: int = 1_000_000,
) -> dict[str, list[tuple[str, int]]]:
    """``{"train": [(source, target), ...], "dev": [...], "test": [...]}``, seeded.

    ``progress`` shows a rich progress bar. ``max_stall``: give up (RuntimeError) after this
    many draws in a row without a new tree, e.g. when fewer distinct trees exist than asked.
    """
    # start-up: rich.progress only when generating (the CLI imports tasks at start)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    counts = (num_train, num_valid, num_test)
    for name, value, least in (("num_train", num_train, 0), ("num_valid", num_valid, 0),
                               ("num_test", num_test, 0), ("max_depth", max_depth, 1),
                               ("max_args", max_args, 2)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if not min_length + 1 < max_length:
        raise ValueError(f"no length lies strictly between min_length={min_length} and "
                         f"max_length={max_length}")
    if not _can_exceed(min_length, max_depth, max_args):
        raise ValueError(f"trees of max_depth={max_depth}, max_args={max_args} never exceed "
                         f"min_length={min_length} tokens")
    rng, total, stall = random.Random(seed), sum(counts), 0
    found: dict[Tree, None] = {}  # an ordered set: first-seen order, unlike the official set
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), disable=not progress) as bar:
        job = bar.add_task("ListOps trees", total=total)
        while len(found) < total:
            tree, length = generate_tree(1, rng, max_depth, max_args)
            if min_length < length < max_length and tree not in found:
                found[tree], stall = None, 0
                bar.advance(job)
            else:
                stall += 1
                if stall >= max_stall:
                    raise RuntimeError(
                        f"no new tree in {max_stall} draws ({len(found)} of {total} found); "
                        "ask for fewer samples or a wider length range")
    rows = [(to_string(t), evaluate_tree(t)) for t in found]
    return {"train": rows[:num_train], "dev": rows[num_train:num_train + num_valid],
            "test": rows[num_train + num_valid:]}


def write_tsv(rows: Iterable[tuple[str, int]], path: str | Path) -> Path:
    """Write ``Source\\tTarget`` rows like the official ``csv.writer``; atomic (``io``)."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, delimiter="\t")
        writer.writerow(["Source", "Target"])
        writer.writerows(rows)
    return path


def write_listops(out_dir: str | Path, **kwargs: Any) -> dict[str, Path]:
    """Generate (``generate_listops`` arguments) and write ``basic_{train,val,test}.tsv``
    (``io.write_splits``: nothing is made when an argument is refused or a write fails)."""
    return write_splits(Path(out_dir).expanduser(), generate_listops(**kwargs), FILES,
                        write_tsv)


# ----------------------------------------------------------------------------- task


@dataclass(frozen=True)
class ListOpsExample:
    """One row: ``text`` is the Source's flat tokens, space-joined (no parentheses)."""

    guid: str
    text: str
    label: int


def examples_from_rows(rows: Iterable[tuple[str, int]], split: str = "train"
                       ) -> list[ListOpsExample]:
    """In-memory examples (e.g. from ``generate_listops``); ValueError on a bad row."""
    out = []
    for i, (source, target) in enumerate(rows):
        if int(target) not in VALUES:
            raise ValueError(f"row {i}: target {target!r} is not a digit 0-9")
        out.append(ListOpsExample(f"{split}-{i}", flat_text(source), int(target)))
    return out


def token_ids(tokenizer: Any) -> dict[str, int]:
    """Flat token -> the tokenizer's id of its single vocabulary word (see module docs)."""
    ids = dict(zip(VOCAB_WORDS, tokenizer.convert_tokens_to_ids(list(VOCAB_WORDS.values())),
                   strict=True))
    unk = getattr(tokenizer, "unk_token_id", None)
    bad = [VOCAB_WORDS[t] for t, i in ids.items() if i is None or i == unk]
    if bad or len(set(ids.values())) != len(ids):
        raise ValueError(f"task 'listops' maps its symbols to the single vocabulary tokens "
                         f"{list(VOCAB_WORDS.values())}; this tokenizer lacks {bad} (use a "
                         "BERT uncased WordPiece tokenizer, e.g. the embedded MiniLM's)")
    return ids


@dataclass(frozen=True, kw_only=True)
class ListOpsTask:
    """LRA ListOps as 10-way sequence classification (see the module docstring)."""

    name: str = "listops"
    head: HeadType = "sequence-classification"
    num_labels: int = 10
    problem_type: ProblemType | None = "single_label_classification"
    label_names: tuple[str, ...] = DIGITS
    main_metric: str = "accuracy"
    greater_is_better: bool = True
    splits: tuple[str, ...] = ("train", "dev", "test")
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("dev",)

    def load(self, split: str, data_dir: str | Path | None = None) -> list[ListOpsExample]:
        """``data_dir``: the data root (``listops/`` or ``lra_release/listops-1000/`` below
        it) or the folder of ``basic_*.tsv``. No hub or built-in copy exists."""
        split = canonical_split(split, self.splits, self.name)
        if data_dir is None or str(data_dir) == BUILTIN:
            raise FileNotFoundError(f"ListOps has no hub or built-in copy; {GENERATE_HINT}")
        try:
            folder = find_dir(data_dir, ["", "listops", "lra_release/listops-1000"],
                              FILES[split], f"ListOps {split}")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} The ListOps files are not shipped: "
                                    f"{GENERATE_HINT}.") from None
        return self.read_tsv(folder / FILES[split], split)

    def read_tsv(self, path: Path, split: str) -> list[ListOpsExample]:
        """Parse one ``Source\\tTarget`` file; any malformed row raises DataFormatError."""
        lines = read_lines(path)
        first = next(lines, None)
        if first is None or first[1].split("\t") != ["Source", "Target"]:
            raise DataFormatError(path, 1, "expected the header 'Source<TAB>Target'")
        out = []
        for lineno, line in lines:
            if not line:
                continue
            row = line.split("\t")
            if len(row) != 2:
                raise DataFormatError(path, lineno, "expected 2 tab-separated columns "
                                      f"(Source, Target), found {len(row)}")
            target = row[1].strip()
            if target not in DIGITS:
                raise DataFormatError(path, lineno,
                                      f"bad Target {target[:20]!r}; expected a digit 0-9")
            try:
                text = flat_text(row[0])
            except ValueError as e:
                raise DataFormatError(path, lineno, f"bad Source: {e}") from None
            out.append(ListOpsExample(f"{split}-{lineno}", text, int(target)))
        return out

    def encode(self, examples: Sequence[ListOpsExample], tokenizer: Any, max_length: int
               ) -> list[Feature]:
        """``[CLS] ids [SEP]``, one id per flat token, truncated to ``max_length``."""
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 ([CLS] and [SEP]), got {max_length}")
        ids = token_ids(tokenizer)
        cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
        with_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        feats = []
        for i, ex in enumerate(examples):
            body = [ids[t] for t in ex.text.split()[: max_length - 2]]
            f: Feature = {"input_ids": [cls, *body, sep], "attention_mask": [1] * (len(body) + 2)}
            if with_types:
                f["token_type_ids"] = [0] * (len(body) + 2)
            f["labels"] = ex.label
            f["example_index"] = i
            feats.append(f)
        return feats

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]:
        return padding_collator(tokenizer)

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        """One logits row ``[10]`` per feature."""
        return logit_rows(outputs)

    def compute_metrics(self, predictions: Sequence[Any], features: Sequence[Feature],
                        examples: Sequence[Any] = ()) -> dict[str, float]:
        return argmax_accuracy(predictions, features)


LISTOPS = register_task(ListOpsTask())
