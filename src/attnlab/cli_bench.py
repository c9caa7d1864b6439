"""``attnlab bench lra`` (wired into ``attnlab bench`` by ``attnlab.cli``).

A Long Range Arena of our own (``attnlab.bench.lra``): one small from-scratch encoder per
mechanism, trained a fixed number of steps on ListOps, associative recall and byte-level
text at one length, with accuracy, training steps/s and peak memory against softmax::

    attnlab bench lra --mechanisms softmax,band,linear_elu --task listops --steps 50
    attnlab bench lra --mechanisms "mega(chunk=128)" --task listops --length 4096 --steps 5
    attnlab bench lra --speed-only --length 4096     # every mechanism's cost columns at 4K
    attnlab bench lra --speed-only --length 4096 --baseline "softmax(fused=False)" \
        --mechanisms "softmax,mega(chunk=128),band"   # ratios against a vanilla Transformer

The bench, torch and transformers are imported inside the command, so ``attnlab --help``
stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .cli_errors import user_errors

console = Console()


def bench_lra(
    mechanisms: Annotated[str | None, typer.Option(
        help="Comma-separated names or specs, e.g. 'softmax,band,mega(chunk=128)' (a bare "
             "name takes bench speed's long-input setting, else its defaults). Default: every "
             "registered mechanism surgery accepts at --length. The baseline always runs "
             "first.")] = None,
    baseline: Annotated[str, typer.Option(
        help="The mechanism the speed and memory ratios are against, e.g. "
             "'softmax(fused=False)': the vanilla Transformer's attention, which stores its "
             "n x n probabilities, as in LRA's and MEGA's cost tables.")] = "softmax",
    task: Annotated[list[str] | None, typer.Option(
        "--task", help="listops, recall or text; repeatable or comma-separated.")] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per (mechanism, task): 0..N-1.")] = 1,
    length: Annotated[int, typer.Option(help="Sequence length (the encoder's positions).")
                      ] = 2048,
    steps: Annotated[int, typer.Option(help="Training steps per cell.")] = 50,
    batch_size: Annotated[int, typer.Option(help="Examples per step (training and speed).")
                          ] = 4,
    eval_size: Annotated[int, typer.Option(help="Evaluation examples per task.")] = 128,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate.")] = 1e-3,
    repeats: Annotated[int, typer.Option(help="Timed steps per speed measurement.")] = 3,
    device: Annotated[str | None, typer.Option(
        help="cpu or cuda (default: cuda when torch sees a GPU).")] = None,
    threads: Annotated[int | None, typer.Option(
        help="torch threads of the speed measurement (default: torch's).")] = None,
    data_dir: Annotated[Path, typer.Option(
        help="Data root holding glue/SST-2 (task text).")] = Path("../shared/data"),
    out: Annotated[Path, typer.Option(
        help="Output folder (rows.jsonl makes it resumable).")] = Path("runs/bench-lra"),
    speed_only: Annotated[bool, typer.Option(
        help="Measure steps/s and peak memory only (no training; --task, --seeds, --steps, "
             "--eval-size and --lr are not used), e.g. every mechanism at --length 4096.")
                          ] = False,
) -> None:
    """A Long Range Arena of our own: accuracy, speed and memory vs softmax (resumable)."""
    from .core.spec import split_top

    names = [m.strip() for m in split_top(mechanisms, ",") if m.strip()] if mechanisms else None
    tasks = [t.strip() for item in (task or ["listops"]) for t in item.split(",") if t.strip()]
    with user_errors(ValueError):
        import torch

        from .bench.lra import LraSettings, format_table, run_lra

        settings = LraSettings(
            length=length, steps=steps, batch_size=batch_size, eval_size=eval_size, lr=lr,
            repeats=repeats, device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
            threads=threads, data_dir=str(data_dir))
        if settings.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch sees no CUDA GPU; use --device cpu")
        results = run_lra(out, names, tasks, list(range(seeds)), settings,
                          notify=lambda line: console.print(line, markup=False),
                          speed_only=speed_only, baseline=baseline)
    console.print(format_table(results), markup=False, soft_wrap=True)
    console.print(f"saved {out}/lra.md, {out}/lra.json, {out}/lra.png ({out}/rows.jsonl: "
                  "finished cells, reused on the next run)", markup=False, soft_wrap=True)


def bench_record(
    only: Annotated[str | None, typer.Option(
        help="Comma-separated section ids (default: every section of the manifest).")] = None,
    rerun: Annotated[bool, typer.Option(
        help="Measure the chosen sections again even where a result is recorded.")] = False,
    render_only: Annotated[bool, typer.Option(
        help="Run nothing: rewrite the Markdown from the recorded folders.")] = False,
    cpu: Annotated[int | None, typer.Option(
        help="Pin every command to this CPU (as taskset -c N), e.g. 1 on a 2-core machine.")
                   ] = None,
    manifest: Annotated[Path, typer.Option(help="The sections to measure and render.")
                        ] = Path("docs/bench/record.yaml"),
    output: Annotated[Path, typer.Option(help="The Markdown written.")
                      ] = Path("docs/benchmarks.md"),
) -> None:
    """docs/benchmarks.md regenerated by one command: run what is missing, then render."""
    from .bench.record import RecordError, record

    with user_errors(RecordError):
        result = record(manifest, output, only=[o.strip() for o in only.split(",")]
                        if only else None, rerun=rerun, render_only=render_only, cpu=cpu,
                        notify=lambda line: console.print(line, markup=False, soft_wrap=True))
    if result["failed"]:
        raise typer.Exit(code=1)
