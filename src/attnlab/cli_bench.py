"""The ``attnlab bench`` commands (wired into ``attnlab bench`` by ``attnlab.cli``).

``bench sparse`` (one sparse pattern vs dense SDPA), ``bench speed`` (every mechanism vs
SDPA: time, memory, fitted exponents), ``bench jat`` (the JAT layer vs its official n^3
form), ``bench lra`` and ``bench record``. Bad input (an output path a file stands in, an
unknown mechanism or counter, a number out of range, missing task data) is refused with one
line before anything is measured or written (``cli_errors``).

``bench lra`` is a Long Range Arena of our own (``attnlab.bench.lra``): one small
from-scratch encoder per mechanism, trained a fixed number of steps on ListOps, associative
recall and byte-level text at one length, with accuracy, training steps/s and peak memory
against softmax::

    attnlab bench lra --mechanisms softmax,band,linear_elu --task listops --steps 50
    attnlab bench lra --mechanisms "mega(chunk=128)" --task listops --length 4096 --steps 5
    attnlab bench lra --speed-only --length 4096     # every mechanism's cost columns at 4K
    attnlab bench lra --speed-only --length 4096 --baseline "softmax(fused=False)" \
        --mechanisms "softmax,mega(chunk=128),band"   # ratios against a vanilla Transformer

The bench, torch and transformers are imported inside the commands, so ``attnlab --help``
stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from .cli_errors import at_least, fail, file_option, folder_option, positive_ints, user_errors

console = Console()


def bench_sparse(
    ns: Annotated[str, typer.Option(help="Comma-separated lengths.")] = "1024,2048,4096,8192",
    window: int = 128,
    mechanism: Annotated[list[str] | None, typer.Option(
        help="Mechanism spec (repeatable); default band(window=WINDOW)."
    )] = None,
    repeats: int = 3,
    threads: Annotated[int | None, typer.Option(
        help="torch threads per measurement (docs/benchmarks.md records --threads 1)."
    )] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda (FlexAttention path).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    plot: Annotated[str | None, typer.Option(help="Also draw the scaling curves to this PNG.")
                    ] = None,
) -> None:
    """Band (or another sparse pattern) vs dense SDPA: time fwd / fwd+bwd, peak memory."""
    plot_path = _plot_option(plot)
    lengths = positive_ints(ns, "--ns")
    at_least("--repeats", repeats)
    if threads is not None:
        at_least("--threads", threads)
    _check_dtype(dtype)
    _check_device(device)
    from .bench.speed import bench_sparse as run_bench
    from .bench.speed import format_markdown

    with user_errors():  # an unknown mechanism or a bad value: refused before any run
        rows = run_bench(ns=lengths, window=window, mechanism=mechanism or "band",
                         repeats=repeats, threads=threads, device=device, dtype=dtype)
    console.print(format_markdown(rows), markup=False)
    _plot_bench(rows, plot_path)


def bench_speed(
    mechanisms: Annotated[str | None, typer.Option(
        help="Comma-separated names or specs (default: every registered mechanism; peers "
             "may be added: hf_longformer, hf_bigbird, hf_nystromformer, hf_reformer_lsh, "
             "flex_band, flex_longformer).")] = None,
    n: Annotated[str, typer.Option(help="Comma-separated lengths.")] = (
        "512,1024,2048,4096,8192,16384"),
    repeats: int = 3,
    threads: Annotated[int, typer.Option(help="torch threads per measurement.")] = 1,
    out: Annotated[str, typer.Option(help="Output folder (rows.jsonl makes it resumable).")
                   ] = "runs/bench/speed",
    dense_max_n: Annotated[int, typer.Option(
        help="Largest n for quadratic mechanisms (their n x n scores).")] = 4096,
    fit_from: Annotated[int, typer.Option(help="Fit exponents over n >= this.")] = 2048,
    device: Annotated[str, typer.Option(
        help="cpu, or cuda (one process, the allocator's peak; sparse patterns on "
             "FlexAttention).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
) -> None:
    """Every mechanism vs dense SDPA: time, peak memory, fitted exponents, chart (resumable)."""
    folder_option("--out", Path(out))
    _check_dtype(dtype)
    at_least("--repeats", repeats)
    at_least("--threads", threads)
    at_least("--dense-max-n", dense_max_n)
    at_least("--fit-from", fit_from)
    lengths = positive_ints(n, "--n")
    _check_device(device)
    from .bench.suite import format_table, run_suite

    names = _mechanism_names(mechanisms)
    with user_errors():
        results = run_suite(out, names, lengths, repeats=repeats,
                            threads=threads, dense_max_n=dense_max_n, fit_from=fit_from,
                            device=device, dtype=dtype)
    console.print(format_table(results), markup=False)
    console.print(f"saved {out}/results.json, {out}/table.md"
                  + (f", {out}/scaling.png" if Path(out, "scaling.png").is_file() else ""),
                  markup=False, soft_wrap=True)


def _mechanism_names(mechanisms: str | None) -> list[str] | None:
    """The names or specs of ``--mechanisms`` (None when the option is not given: every
    mechanism); ``fail`` when it is given and names none (``--mechanisms ,``)."""
    from .core.spec import split_top

    if mechanisms is None:
        return None
    names = [m.strip() for m in split_top(mechanisms, ",") if m.strip()]
    if not names:
        fail(f"--mechanisms {mechanisms!r} names no mechanism; give names or specs separated "
             "by commas, e.g. --mechanisms softmax,band(window=64), or leave it out for all")
    return names


def bench_jat(
    lengths: Annotated[str, typer.Option(help="Comma-separated lengths.")] = "128,256,512,1024",
    batch: int = 8,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    naive_limit_gb: Annotated[float, typer.Option(
        help="Skip the L^3 form where its estimated peak exceeds this.")] = 8.0,
    plot: Annotated[str | None, typer.Option(help="Also draw the scaling curves to this PNG.")
                    ] = None,
    counter: Annotated[str, typer.Option(
        help="Exact link counter: auto, pairs, enumerate, compare or direct.")] = "auto",
) -> None:
    """One layer of 6 JAT heads: efficient vs the official L^3 form, time and peak memory."""
    plot_path = _plot_option(plot)
    sizes = positive_ints(lengths, "--lengths")
    at_least("--batch", batch)
    from .bench.jat import COUNTERS, format_markdown
    from .bench.jat import bench_jat as run_bench

    if counter not in COUNTERS:
        fail(f"--counter {counter}: use {', '.join(COUNTERS[:-1])} or {COUNTERS[-1]}")
    _check_device(device)
    rows = run_bench(lengths=sizes, batch=batch, device=device,
                     naive_limit_gb=naive_limit_gb, counter=counter)
    console.print(format_markdown(rows), markup=False)
    _plot_bench(rows, plot_path)


def _plot_option(plot: str | None) -> Path | None:
    """``--plot``: a file path (``file_option``) in a format matplotlib writes, checked
    before any work."""
    if not plot:
        return None
    path = file_option("--plot", Path(plot))
    from matplotlib.backend_bases import FigureCanvasBase  # imported on use: CLI start-up

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        fail(f"--plot {plot}: give a file name ending in .png (or another image format: "
             f"{', '.join('.' + f for f in sorted(formats) if f != 'png')})")
    return path


def _plot_bench(rows: list[dict[str, Any]], plot: Path | None) -> None:
    if plot:
        from .bench.plots import env_title, scaling_plot
        from .bench.speed import environment

        console.print(f"saved {scaling_plot(rows, plot, title=env_title(environment()))}",
                      markup=False, soft_wrap=True)


def _check_dtype(dtype: str) -> None:
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype}: use float32 or bfloat16")


def _check_device(device: str) -> None:
    import torch

    if device not in ("cpu", "cuda"):
        fail(f"unknown device {device!r}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: this torch sees no CUDA GPU; use --device cpu")


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
    folder_option("--out", out)
    at_least("--seeds", seeds)

    names = _mechanism_names(mechanisms)
    tasks = [t.strip() for item in (task or ["listops"]) for t in item.split(",") if t.strip()]
    if not tasks:
        fail(f"--task {','.join(task or [])!r} names no task; give listops, recall or text")
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
    png = (f", {out}/lra.png" if (out / "lra.png").is_file() else
           " (no lra.png: no mechanism has both " + ("ratios" if speed_only else
                                                     "an average accuracy and a speed") + ")")
    console.print(f"saved {out}/lra.md, {out}/lra.json{png} ({out}/rows.jsonl: finished "
                  "cells, reused on the next run)", markup=False, soft_wrap=True)


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
    file_option("--output", output)
    sections = [o.strip() for o in only.split(",") if o.strip()] if only else None
    if sections is not None and not sections:
        fail(f"--only {only!r} names no section; give section ids separated by commas, e.g. "
             "--only map,jat, or leave it out for every section")
    from .bench.record import RecordError, record

    with user_errors(RecordError):
        result = record(manifest, output, only=sections, rerun=rerun, render_only=render_only,
                        cpu=cpu,
                        notify=lambda line: console.print(line, markup=False, soft_wrap=True))
    if result["failed"]:
        raise typer.Exit(code=1)
