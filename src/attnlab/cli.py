"""The ``attnlab`` command. Thin: parses arguments, calls a recipe, prints with rich.

Each command imports what it runs inside its own function (start-up time: ``attnlab --help``
and ``attnlab ls`` load no transformers, peft, accelerate or matplotlib;
tests/test_architecture.py checks it), so the imports inside functions here are all that.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .cli_analyze import analyze_app, report
from .cli_bench import bench_jat, bench_lra, bench_record, bench_sparse, bench_speed
from .cli_data import app as data_app
from .cli_errors import at_least, fail, folder_option, on_interrupt, set_debug, user_errors
from .cli_tlm import tlm_app

app = typer.Typer(
    help="attnlab: attention mechanisms in any head of any Hugging Face encoder.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Speed and memory benchmarks (CPU; GPU when present).")
app.add_typer(bench_app, name="bench")
console = Console()

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded model never needs the network


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show the full traceback of an error instead of one line.")] = False,
) -> None:
    set_debug(debug)
    from .mechanisms import chunk_elems_error  # ATTNLAB_CHUNK_ELEMS, read at import

    if (problem := chunk_elems_error()) is not None:
        fail(problem)


@app.command("ls")
def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the docs catalogue.")] = False,
    plans: Annotated[bool, typer.Option(
        "--plans", help="List the named plans (plan=NAME) instead.")] = False,
) -> None:
    """List every registered attention mechanism (or, with --plans, every named plan)."""
    from .catalogue import catalogue_markdown, catalogue_rows

    if as_json and markdown:
        fail("--json and --markdown: give one output format")
    if plans and markdown:
        fail("--plans has no Markdown form; use --plans or --plans --json")
    if plans:
        from .presets import NAMED_PLANS

        if as_json:
            typer.echo(json.dumps(NAMED_PLANS, indent=2))
            return
        table = Table(title=f"named plans ({len(NAMED_PLANS)}): plan=NAME, or NAME(key=value)")
        table.add_column("name", no_wrap=True)
        table.add_column("rules (LAYERS:HEADS:SPEC)", overflow="fold")
        for name, rules in NAMED_PLANS.items():
            table.add_row(name, "; ".join(rules) or "(none: every head softmax)")
        console.print(table)
        return
    if markdown:
        typer.echo(catalogue_markdown(), nl=False)
        return
    rows = catalogue_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    console.print(_mechanism_table(rows))


def _mechanism_table(rows: list[dict], width: int | None = None) -> Table:
    """The ``attnlab ls`` table, laid out to fit the terminal (80 columns and up): the short
    fields (name, family, scope, and exact / causal from 100 columns on) never wrap; the
    descriptions (complexity, paper) wrap at word boundaries and share the width left, so a
    wider terminal gives them one line. ``--json`` and ``--markdown`` always have every field."""
    from rich import box

    flags = (width or console.width) >= 100
    table = Table(title=f"attnlab mechanisms ({len(rows)})", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, padding=(0, 0))
    table.add_column("name", no_wrap=True)
    table.add_column("family", no_wrap=True, min_width=8)
    table.add_column("scope", no_wrap=True)
    if flags:
        table.add_column("exact", no_wrap=True)
        table.add_column("causal", no_wrap=True)
    table.add_column("complexity", overflow="fold", min_width=16)
    table.add_column("paper", overflow="fold", min_width=15)
    for r in rows:
        marks = ("yes" if r["exact"] else "no", "yes" if r["causal_ok"] else "no") if flags else ()
        table.add_row(r["name"], r["family"], r["scope"], *marks, r["complexity"], r["paper"])
    return table


@app.command()
def demo(
    plan: Annotated[
        list[str] | None,
        typer.Option(
            "--plan", "-p",
            help="Plan rule LAYERS:HEADS:SPEC, repeatable; e.g. '0-2:all:band(window=8)', "
                 "or heads by class or score: 'all:class:vertical:band(window=8)', "
                 "'all:entropy<1.5:band(window=8)' (needs --analysis).",
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Timed repeats per model.")] = 5,
    analysis: Annotated[str | None, typer.Option(
        help="Head analysis for class:/score rules: a head_scores.json of `attnlab analyze "
             "heads` (or its folder), or task:NAME to analyse the model on NAME's dev split."
    )] = None,
) -> None:
    """Apply a plan to the embedded MiniLM and compare it with the untouched model."""
    from .recipes.demo import DEFAULT_PLAN, run_demo

    at_least("--repeats", repeats)
    with user_errors(ValueError):
        rows, report = run_demo(plan or DEFAULT_PLAN, repeats=repeats, analysis=analysis,
                                echo=lambda text: console.print(text, markup=False))
    console.print(report)
    table = Table(title="embedded all-MiniLM-L6-v2: sentence embeddings vs untouched")
    for col in ("model", "cos mean", "cos min", "ms / batch", "peak MB"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for r in rows:
        table.add_row(r.model, f"{r.cos_mean:.4f}", f"{r.cos_min:.4f}",
                      f"{r.ms_per_batch:.1f}", f"{r.peak_mb:.1f}")
    console.print(table)


Overrides = Annotated[
    list[str] | None, typer.Argument(help="Config overrides key.sub=value (YAML values); "
                                     "plan=NAME takes a named plan, e.g. plan=jat(rho=4.5).")
]


def _load(config: str | None, overrides: list[str] | None):
    from pathlib import Path

    from .config import load_config

    if config is not None and "=" in config and not Path(config).exists():
        overrides = [config, *(overrides or [])]  # no file: all overrides
        config = None
    if config is None and not overrides:
        fail("give a config, e.g. configs/glue/cola.yaml (see configs/), or key=value "
             "settings such as task.name=cola task.data_dir=../shared/data")
    with user_errors():
        return load_config(config, overrides or [])


@app.command()
def validate(config: str, overrides: Overrides = None) -> None:
    """Check a config without running it and print it resolved.

    It checks whatever `run` would refuse: keys, types, plan, tuner, that the model takes
    the plan from its config alone, data and output folder."""
    from .config import resolved_yaml, with_optim_defaults
    from .recipes.preflight import preflight

    cfg = _load(config, overrides)
    with user_errors():
        notes = preflight(cfg, load_data=True)
    console.print(resolved_yaml(with_optim_defaults(cfg)), markup=False)
    for note in notes:
        console.print(Text.assemble(("warning:", "bold yellow"), f" {note}"), soft_wrap=True)
    console.print("[green]config is valid[/]")


Overwrite = Annotated[bool, typer.Option(
    help="Empty an existing run folder of the same name first (default: write <name>-2, ...).")]
KeepCheckpoints = Annotated[bool, typer.Option(
    help="Keep the checkpoints of a finished run (default: deleted; the result stays).")]


@app.command()
def run(
    config: Annotated[str | None, typer.Argument(help="YAML config (see configs/).")] = None,
    overrides: Overrides = None,
    resume: Annotated[bool, typer.Option(help="Continue from the last checkpoint.")] = False,
    overwrite: Overwrite = False,
    keep_checkpoints: KeepCheckpoints = False,
) -> None:
    """Train and evaluate one config; writes runs/<name>/ (summary.json, metrics.jsonl, ...)."""
    _run_and_report(_load(config, overrides), resume, overwrite, keep_checkpoints)


def _run_and_report(cfg, resume: bool, overwrite: bool, keep_checkpoints: bool) -> None:
    from dataclasses import replace

    from .recipes.finetune import run_experiment
    from .recipes.preflight import preflight
    from .recipes.rundir import fresh_run

    if keep_checkpoints:
        cfg = replace(cfg, train=replace(cfg.train, keep_checkpoints=True))
    with user_errors():
        preflight(cfg)
        cfg, note = fresh_run(cfg, resume=resume, overwrite=overwrite)
        if note:
            console.print(note, markup=False)
        with on_interrupt(lambda: _resume_note(cfg.run_dir)):
            summary = run_experiment(cfg, resume=resume)
    if not summary["is_main_process"]:
        return
    table = Table(title=f"{cfg.name}: {summary['task']} ({summary['tuning']})")
    for col in ("metric", "best", "at step", "steps", "s/step", "trained params"):
        table.add_column(col)
    p = summary["params"]
    table.add_row(summary["main_metric"], f"{summary['best_metric']:.4f}",
                  str(summary["best_step"]), str(summary["steps"]),
                  f"{summary['seconds_per_step']:.3f}",
                  f"{p['trainable_without_head']:,} ({p['percent_of_backbone']:.3f}%)")
    console.print(table)
    console.print(f"best dev metrics: {json.dumps(summary['best_eval'])}")
    console.print(f"run directory: {cfg.run_dir}")


def _resume_note(run_dir: Path) -> str:
    """What an interrupted run left, and the command that continues it."""
    if not (run_dir / "config.yaml").is_file():
        return f"stopped before {run_dir} was written; nothing to resume"
    return (f"{run_dir} keeps its last checkpoint; continue it with: attnlab run "
            f"{run_dir}/config.yaml --resume")


@app.command()
def quickstart(
    overrides: Overrides = None,
    data_dir: Annotated[str | None, typer.Option(
        help="CoLA data: a GLUE folder, or 'builtin'. Default: ../shared/data if present."
    )] = None,
    overwrite: Overwrite = False,
    keep_checkpoints: KeepCheckpoints = False,
) -> None:
    """The main job: fine-tune the embedded MiniLM on CoLA and print the result table."""
    from .recipes.quickstart import quickstart_config

    with user_errors():
        cfg = quickstart_config(data_dir, overrides)
    length = (f"{cfg.train.max_steps} step(s)" if cfg.train.max_steps is not None
              else f"{cfg.train.epochs:g} epoch(s)")
    console.print(f"[bold]quickstart[/]: CoLA from {cfg.task.data_dir}, {length}, "
                  f"batch {cfg.train.batch_size}")
    _run_and_report(cfg, False, overwrite, keep_checkpoints)


@app.command("eval")
def eval_run(
    run_dir: str,
    data_dir: Annotated[str | None, typer.Option(help="Override the task data dir.")] = None,
) -> None:
    """Re-evaluate a finished run from its config, plan and tuned weights."""
    from .recipes.finetune import evaluate_run

    with user_errors():
        metrics = evaluate_run(run_dir, data_dir)
    typer.echo(json.dumps(metrics, indent=2))


@app.command()
def compare(
    config: Annotated[str | None, typer.Argument(help="Base YAML config.")] = None,
    overrides: Overrides = None,
    vary: Annotated[list[str] | None, typer.Option(
        help="key=v1,v2 (repeatable); plan values are named plans or LAYERS:HEADS:SPEC "
             "rules; separate values with '|' when one holds a comma: "
             "plan=baseline|0,2:all:band(window=8)."
    )] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per variant (0..N-1).")] = 3,
    resume: Annotated[bool, typer.Option(
        help="Skip variants x seeds already finished; continue interrupted ones.")] = False,
    parallel: Annotated[int, typer.Option(
        help="Runs at a time, each in its own process (GPUs shared out; logs beside runs)."
    )] = 1,
    best_seeds: Annotated[int | None, typer.Option(
        help="A search: after the grid, run the best variant (mean dev metric) up to this "
             "many seeds, e.g. --seeds 1 --best-seeds 3."
    )] = None,
    versus: Annotated[str | None, typer.Option(
        help="A variant label (e.g. baseline): add each row's gap to it and Welch's p.")] = None,
    overwrite: Overwrite = False,
) -> None:
    """Run variants over seeds; print and save a table (Markdown, CSV) and a bar plot."""
    from .recipes.compare import parse_vary, run_compare, to_markdown
    from .recipes.finetune import run_experiment
    from .recipes.rundir import fresh_run

    at_least("--seeds", seeds)
    at_least("--parallel", parallel)
    if best_seeds is not None and best_seeds <= seeds:
        fail(f"--best-seeds {best_seeds} must be more than --seeds {seeds} (the grid's seeds "
             "are reused)")
    cfg = _load(config, overrides)
    with user_errors():
        cfg, note = fresh_run(cfg, resume=resume, overwrite=overwrite)
        if note:
            console.print(note, markup=False)
    with user_errors(), on_interrupt(lambda: (
            f"{cfg.run_dir} keeps the finished runs and the last checkpoints of the others; "
            f"continue it: the same command with name={cfg.name} --resume")):
        rows, out = run_compare(cfg, parse_vary(vary or []), seeds, run_experiment,
                                resume=resume, parallel=parallel, best_seeds=best_seeds,
                                versus=versus)
    console.print(to_markdown(rows), markup=False, soft_wrap=True)  # Markdown rows whole
    console.print(f"saved {out}/comparison.md, comparison.csv, comparison.json, comparison.png",
                  markup=False, soft_wrap=True)


@app.command()
def collect(
    runs: Annotated[list[str], typer.Argument(help="[LABEL=]PATH: variant or compare folders.")],
    out: Annotated[Path, typer.Option(help="Folder for comparison.{md,csv,json,png}.")],
    show: Annotated[list[str] | None, typer.Option(
        help="Config key to add as a column, e.g. optim.lr (repeatable).")] = None,
    matrix: Annotated[bool, typer.Option(
        help="Labels are ROW@TASK (pasta@cola=PATH): also a rows x tasks table, matrix.md, "
             "and one plot panel per task, matrix.png.")] = False,
    versus: Annotated[str | None, typer.Option(
        help="A row label (e.g. full): add each row's gap to it and Welch's p.")] = None,
) -> None:
    """One table from runs of several `attnlab compare` calls (e.g. each tuner at its own lr)."""
    from .config import ConfigError
    from .recipes.collect import collect as collect_rows
    from .recipes.collect import write_collected

    folder_option("--out", out)
    with user_errors():
        rows = collect_rows(runs, show, matrix=matrix)
        if versus is not None:
            if matrix:
                raise ConfigError("--versus compares rows of one task; it does not apply to "
                                  "--matrix (collect each task's rows without --matrix)")
            from .recipes.versus import add_versus

            rows = add_versus(rows, versus)
        write_collected(rows, out, show, matrix=matrix)
    main = "matrix" if matrix else "comparison"
    console.print((out / f"{main}.md").read_text(), markup=False, soft_wrap=True)
    extra = "matrix.md, matrix.png" if matrix else "comparison.png"
    console.print(f"saved {out}/comparison.md, comparison.csv, comparison.json, {extra}")


@app.command("env")
def env() -> None:
    """Versions of Python, attnlab and its fast-moving dependencies, git commit and device."""
    from .recipes.rundir import provenance

    typer.echo(json.dumps(provenance(), indent=2))


@app.command()
def params(
    model_config: Annotated[str, typer.Option(help="bert-base, bert-large, roberta-base, "
                                                   "roberta-large, minilm")] = "bert-large",
    tuning: Annotated[str, typer.Option(help="Tuner spec, e.g. pasta, lora(r=8).")] = "pasta",
    task_type: Annotated[str, typer.Option(help="single, pair or ner")] = "single",
) -> None:
    """Trainable-parameter accounting of a tuner on a published architecture (no download)."""
    from .tuning.accounting import ModelConfigName, TaskType, format_params, params_report

    # params_report refuses unknown names (ValueError naming the choices)
    with user_errors(ValueError, KeyError):
        report = params_report(cast(ModelConfigName, model_config), tuning,
                               cast(TaskType, task_type))
    typer.echo(format_params(report))


app.add_typer(analyze_app, name="analyze")
app.add_typer(data_app, name="data")
app.add_typer(tlm_app, name="tlm")
app.command("report")(report)
bench_app.command("sparse")(bench_sparse)
bench_app.command("speed")(bench_speed)
bench_app.command("jat")(bench_jat)
bench_app.command("lra")(bench_lra)
bench_app.command("record")(bench_record)


def _tidy_help(typer_app: typer.Typer) -> None:
    """Each command's docstring as its help, shown as written: typer's rich mode keeps the
    docstring's line breaks (a paragraph would break mid-sentence) and reads brackets as
    markup (``C[i, j]`` would vanish), so each paragraph becomes one line, brackets escaped."""
    from rich.markup import escape

    for info in typer_app.registered_commands:
        text = info.help or (info.callback.__doc__ if info.callback else None)
        if text:
            info.help = "\n\n".join(escape(" ".join(p.splitlines()))
                                     for p in inspect.cleandoc(text).split("\n\n"))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _tidy_help(group.typer_instance)


_tidy_help(app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
