"""``attnlab data``: prepare datasets that cannot be shipped (wired in by ``attnlab.cli``).

``attnlab data listops --out data/listops`` regenerates the Long Range Arena ListOps files
(Tay et al., 2021; ListOps: Nangia & Bowman, 2018) with the official algorithm, seeded:
``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv`` (see ``attnlab.tasks.listops``).
``attnlab data recall`` writes multi-query associative recall (Zoology's MQAR construction,
``attnlab.tasks.recall``) and ``attnlab data text`` byte-level documents built from GLUE
SST-2 (``attnlab.tasks.bytetext``), both seeded: same arguments, byte-identical files.

Each generator checks its options and builds every split in memory before anything goes to
disk; the files are then written atomically, the ``--out`` folder is made on the first
write, and after an error (or Ctrl-C) while writing, the files and folders the command made
are removed again (``attnlab.io.write_splits``, through the tasks' ``write_*``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .cli_errors import at_least, fail, folder_option, user_errors
from .tasks import bytetext as bt
from .tasks import listops as lo
from .tasks import recall as rc

app = typer.Typer(help="Prepare datasets that cannot be shipped.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
console = Console()


@contextmanager
def _as_options(**options: str) -> Iterator[None]:
    """A generator's ValueError in the words of the command line: its argument names
    (``input_seq_len``) replaced by the options that set them (``--length``)."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        for arg, option in options.items():
            text = re.sub(rf"\b{arg}\b", option, text)
        raise ValueError(text) from None


@app.command("listops")
def listops(
    out: Annotated[Path, typer.Option("--out", help="Folder for basic_{train,val,test}.tsv.")],
    seed: Annotated[int, typer.Option(help="Seed of random.Random: same seed, same files.")] = 0,
    num_train: Annotated[int, typer.Option(help="Training samples.")] = lo.NUM_TRAIN,
    num_valid: Annotated[int, typer.Option(help="Validation samples.")] = lo.NUM_VALID,
    num_test: Annotated[int, typer.Option(help="Test samples.")] = lo.NUM_TEST,
    max_depth: Annotated[int, typer.Option(help="Maximum tree depth.")] = lo.MAX_DEPTH,
    max_args: Annotated[int, typer.Option(help="Maximum arguments per operator.")] = lo.MAX_ARGS,
    min_length: Annotated[int, typer.Option(
        help="Keep trees longer than this (tokens, parentheses not counted).")] = lo.MIN_LENGTH,
    max_length: Annotated[int, typer.Option(
        help="Keep trees shorter than this (tokens, parentheses not counted).")] = lo.MAX_LENGTH,
) -> None:
    """Generate the LRA ListOps TSVs (defaults: LRA's; full size: ~2-3 min, 0.7 GB)."""
    out = folder_option("--out", out.expanduser())
    with user_errors(ValueError, RuntimeError, OSError), _as_options(
            num_train="--num-train", num_valid="--num-valid", num_test="--num-test",
            max_depth="--max-depth", max_args="--max-args", min_length="--min-length",
            max_length="--max-length"):
        paths = lo.write_listops(
            out, num_train=num_train, num_valid=num_valid, num_test=num_test,
            max_depth=max_depth, max_args=max_args, min_length=min_length,
            max_length=max_length, seed=seed, progress=True,
        )
    console.print(f"ListOps, seed {seed}, lengths {min_length} < n < {max_length}:")
    rows = {"train": num_train, "dev": num_valid, "test": num_test}
    for split, path in paths.items():
        console.print(f"  {split:<5} {rows[split]:>7} rows -> {path}", markup=False,
                      soft_wrap=True)
    console.print(f"use it with: attnlab run configs/listops.yaml task.data_dir={out}",
                  markup=False, soft_wrap=True)


def _written(title: str, paths: dict[str, Path], rows: dict[str, int], task: str,
             out: Path) -> None:
    console.print(title, markup=False)
    for split, path in paths.items():
        console.print(f"  {split:<5} {rows[split]:>7} rows -> {path}", markup=False,
                      soft_wrap=True)
    console.print(f"use it with: attnlab run ... task.name={task} task.data_dir={out}",
                  markup=False, soft_wrap=True)


@app.command("recall")
def recall(
    out: Annotated[Path, typer.Option("--out", help="Folder for {train,dev,test}.jsonl.")],
    seed: Annotated[int, typer.Option(help="Seed: same seed, same files.")] = 0,
    num_train: Annotated[int, typer.Option(help="Training sequences.")] = rc.NUM_TRAIN,
    num_dev: Annotated[int, typer.Option(help="Dev sequences.")] = rc.NUM_DEV,
    num_test: Annotated[int, typer.Option(help="Test sequences.")] = rc.NUM_TEST,
    length: Annotated[int, typer.Option(
        help="Sequence length (even; vocab-size must exceed it).")] = rc.INPUT_SEQ_LEN,
    vocab_size: Annotated[int, typer.Option(
        help="Symbols: keys 1..V/2-1, values V/2..V-1.")] = rc.VOCAB_SIZE,
    num_kv_pairs: Annotated[int, typer.Option(help="Key-value pairs (and queries) per "
                                                  "sequence.")] = rc.NUM_KV_PAIRS,
    power_a: Annotated[float, typer.Option(
        help="Power law of the query slots (1: uniform).")] = rc.POWER_A,
    random_non_queries: Annotated[bool, typer.Option(
        help="Fill the non-query slots with random symbols.")] = True,
) -> None:
    """Generate multi-query associative recall (Zoology's MQAR; defaults: Zoology's)."""
    if not 0 <= seed < 2**32:  # numpy's RandomState
        fail(f"--seed {seed}: give a whole number in 0 .. 2**32 - 1")
    if not (math.isfinite(power_a) and power_a != 0):  # 0, nan, inf: no probabilities
        fail(f"--power-a {power_a}: give a finite number other than 0, e.g. 0.01 (1: uniform)")
    out = folder_option("--out", out.expanduser())
    with user_errors(ValueError, OSError), _as_options(
            num_train="--num-train", num_dev="--num-dev", num_test="--num-test",
            vocab_size="--vocab-size", input_seq_len="--length", num_kv_pairs="--num-kv-pairs",
            power_a="--power-a"):
        paths = rc.write_recall(
            out, num_train=num_train, num_dev=num_dev, num_test=num_test,
            vocab_size=vocab_size, input_seq_len=length, num_kv_pairs=num_kv_pairs,
            power_a=power_a, random_non_queries=random_non_queries, seed=seed)
    _written(f"MQAR, seed {seed}, length {length}, {num_kv_pairs} pairs, vocabulary "
             f"{vocab_size}:", paths, {"train": num_train, "dev": num_dev, "test": num_test},
             "recall", out)


@app.command("text")
def text(
    out: Annotated[Path, typer.Option("--out", help="Folder for {train,dev}.jsonl.")],
    data_dir: Annotated[Path, typer.Option(
        help="Data root holding glue/SST-2 (the source sentences).")] = Path("../shared/data"),
    seed: Annotated[int, typer.Option(help="Seed: same seed, same files.")] = 0,
    num_train: Annotated[int, typer.Option(help="Training documents.")] = bt.NUM_TRAIN,
    num_dev: Annotated[int, typer.Option(help="Dev documents.")] = bt.NUM_DEV,
    min_bytes: Annotated[int, typer.Option(help="Shortest target length (bytes).")] = (
        bt.MIN_BYTES),
    max_bytes: Annotated[int, typer.Option(
        help="Longest document (bytes); keep it <= the model's max_length - 2.")] = (
        bt.MAX_BYTES),
) -> None:
    """Generate byte-level documents from SST-2, labelled by their one marked sentence."""
    out = folder_option("--out", out.expanduser())
    with user_errors(ValueError, OSError), _as_options(
            num_train="--num-train", num_dev="--num-dev", min_bytes="--min-bytes",
            max_bytes="--max-bytes"):
        paths = bt.write_text(out, data_dir, num_train=num_train, num_dev=num_dev,
                              min_bytes=min_bytes, max_bytes=max_bytes, seed=seed)
    _written(f"byte-level text from SST-2, seed {seed}, {min_bytes}-{max_bytes} bytes:", paths,
             {"train": num_train, "dev": num_dev}, "text", out)


@app.command("squad-windows")
def squad_windows(
    data_dir: Annotated[Path, typer.Option(help="Data root holding squad/dev-v1.1.json.")
                        ] = Path("../shared/data"),
    splits: Annotated[str, typer.Option(
        help="Comma-separated SPLIT:LIMIT (the first LIMIT questions of the split, as "
             "task.train_limit / eval_limit take them).")] = "dev_train:4000,dev_eval:1000",
    max_length: Annotated[int, typer.Option(help="Tokens per window.")] = 256,
    stride: Annotated[int | None, typer.Option(
        help="Window overlap in tokens (default: max_length // 3, the task's).")] = None,
) -> None:
    """Count what SQuAD's sliding windows hold with the installed tokenizers.

    Windows, cut contexts and answers in no window (huggingface/tokenizers#2091 cuts
    contexts)."""
    import tokenizers
    import transformers

    from .models import default_model_path
    from .tasks.squad import SquadTask

    # every option is checked, and every count made, before the first line is printed
    try:
        wanted = [(s.split(":")[0].strip(), int(s.split(":")[1])) for s in splits.split(",")]
    except (IndexError, ValueError):
        wanted = []
    if not wanted or min(limit for _, limit in wanted) < 1:
        fail(f"--splits {splits!r}: write SPLIT:LIMIT pairs with LIMIT >= 1, e.g. "
             "dev_train:4000,dev_eval:1000")
    at_least("--max-length", max_length)
    if stride is not None and not 0 <= stride < max_length:
        fail(f"--stride {stride} must be >= 0 and below --max-length {max_length}; leave it "
             f"out for the task's max_length // 3 ({max_length // 3})")
    task = SquadTask(stride=stride)
    with user_errors(ValueError, OSError, ImportError):
        tok = transformers.AutoTokenizer.from_pretrained(default_model_path(),
                                                         local_files_only=True)
        loaded = [(split, limit, task.load(split, data_dir)[:limit]) for split, limit in wanted]
        counts = [(split, limit, task.window_coverage(examples, tok, max_length))
                  for split, limit, examples in loaded]
    console.print(f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}"
                  f", the embedded MiniLM tokenizer, {max_length} tokens, stride "
                  f"{task.stride if task.stride is not None else max_length // 3}\n",
                  markup=False)
    console.print("| split | questions | windows | cut contexts | answers in no window |\n"
                  "|---|---:|---:|---:|---:|", markup=False)
    for split, limit, c in counts:
        share = c["answers_in_no_window"] / max(c["questions"], 1)
        console.print(f"| {split} (first {limit}) | {c['questions']:,} | {c['windows']:,} | "
                      f"{c['cut_contexts']} | {c['answers_in_no_window']} ({share:.1%}) |",
                      markup=False)
