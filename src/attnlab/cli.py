"""The ``attnlab`` command. Thin: parses arguments, calls a recipe, prints with rich."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="attnlab: attention mechanisms in any head of any Hugging Face encoder.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Speed and memory benchmarks (CPU; GPU when present).")
app.add_typer(bench_app, name="bench")
console = Console()

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded model never needs the network


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code=2)


@app.command("ls")
def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the docs catalogue.")] = False,
) -> None:
    """List every registered attention mechanism."""
    from .catalogue import catalogue_markdown, catalogue_rows

    if markdown:
        typer.echo(catalogue_markdown(), nl=False)
        return
    rows = catalogue_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"attnlab mechanisms ({len(rows)})")
    for col in ("name", "family", "scope", "complexity", "exact", "causal", "paper"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"], r["family"], r["scope"], r["complexity"],
            "yes" if r["exact"] else "no", "yes" if r["causal_ok"] else "no", r["paper"],
        )
    console.print(table)


@app.command()
def demo(
    plan: Annotated[
        list[str] | None,
        typer.Option(
            "--plan", "-p",
            help="Plan rule LAYERS:HEADS:SPEC, repeatable; e.g. '0-2:all:band(window=8)'.",
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Timed repeats per model.")] = 5,
) -> None:
    """Apply a plan to the embedded MiniLM and compare it with the untouched model."""
    from .core import RegistryError
    from .recipes.demo import DEFAULT_PLAN, run_demo

    try:
        rows, report = run_demo(plan or DEFAULT_PLAN, repeats=repeats)
    except (RegistryError, ValueError) as e:
        _fail(str(e))
        return
    console.print(report)
    table = Table(title="embedded all-MiniLM-L6-v2: sentence embeddings vs the untouched model")
    for col in ("model", "cos mean", "cos min", "ms / batch", "peak MB"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for r in rows:
        table.add_row(r.model, f"{r.cos_mean:.4f}", f"{r.cos_min:.4f}",
                      f"{r.ms_per_batch:.1f}", f"{r.peak_mb:.1f}")
    console.print(table)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
