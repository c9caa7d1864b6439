"""``attnlab data``: prepare datasets that cannot be shipped (wired in by ``attnlab.cli``).

``attnlab data listops --out data/listops`` regenerates the Long Range Arena ListOps files
(Tay et al., 2021; ListOps: Nangia & Bowman, 2018) with the official algorithm, seeded:
``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv`` (see ``attnlab.tasks.listops``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .tasks import listops as lo

app = typer.Typer(help="Prepare datasets that cannot be shipped.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
console = Console()


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
    try:
        paths = lo.write_listops(
            out, num_train=num_train, num_valid=num_valid, num_test=num_test,
            max_depth=max_depth, max_args=max_args, min_length=min_length,
            max_length=max_length, seed=seed, progress=True,
        )
    except (ValueError, RuntimeError, OSError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(code=2) from None
    console.print(f"ListOps, seed {seed}, lengths {min_length} < n < {max_length}:")
    rows = {"train": num_train, "dev": num_valid, "test": num_test}
    for split, path in paths.items():
        console.print(f"  {split:<5} {rows[split]:>7} rows -> {path}", markup=False,
                      soft_wrap=True)
    console.print(f"use it with: attnlab run configs/listops.yaml task.data_dir={out}",
                  markup=False, soft_wrap=True)
