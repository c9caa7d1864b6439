"""``attnlab analyze heads|importance|connections|overlap|links`` and ``attnlab report``:
thin wrappers over recipes (analyze, importance, connections, run_report),
analysis.overlap and analysis.jump_links.

Registered in ``cli.py`` with ``app.add_typer(analyze_app, name="analyze")`` and
``app.command("report")(report)``. The recipes, attnlab.hf (transformers) and the plots
(matplotlib) are imported inside the commands, so ``attnlab --help`` stays fast.
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import typer
from rich.console import Console
from rich.table import Table

from .cli_errors import at_least, fail, file_option, folder_option, user_errors

T = TypeVar("T")
analyze_app = typer.Typer(
    help="Head analysis: vertical / diagonal / block / heterogeneous heads, tables and plots.",
    no_args_is_help=True,
)
console = Console()
err_console = Console(stderr=True)


def _progress(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    """A rich progress bar over batches (on stderr, so tables on stdout stay clean)."""
    from rich.progress import track  # start-up: only commands that show a bar need it

    return track(items, total=total, description=description, console=err_console,
                 transient=True)


def _print_table(table: Table) -> None:
    """Print ``table`` at least as wide as its widest header and cell: rich would otherwise
    cut them to fit the console (80 columns when piped), e.g. 217463 to "2174…"."""
    from rich.measure import Measurement  # start-up: only commands that print tables

    need = Measurement.get(console, console.options.update_width(10_000), table).maximum
    wide = console if need <= console.width else Console(width=need, file=console.file)
    wide.print(table)


def _print_summary(result: Any, out: Path) -> None:
    # start-up: the plots load matplotlib, the recipe transformers
    from .analysis.plots import CLASS_ABBREV
    from .recipes.analyze import SUMMARY_SCORES, layer_summary

    rows = layer_summary(result.analysis)
    counts = [k for k in rows[0] if k.startswith("n_")]
    means = [f"mean_{s}" for s in SUMMARY_SCORES if f"mean_{s}" in rows[0]]
    meta = result.meta
    table = Table(title=f"{meta['model_name']}: {meta['examples']} examples of {meta['text']}"
                        f" ({meta['seconds']:.1f} s); heads per class, mean score per layer")
    table.add_column("layer", justify="right")
    for k in counts:
        table.add_column(CLASS_ABBREV.get(k[2:], k[2:]), justify="right")
    for k in means:
        table.add_column(k[5:], justify="right")
    for r in rows:
        table.add_row(str(r["layer"]), *(str(r[k]) for k in counts),
                      *(f"{r[k]:.3f}" for k in means))
    _print_table(table)
    console.print("classes: " + ", ".join(f"{CLASS_ABBREV.get(k[2:], '?')} = {k[2:]}"
                                          for k in counts))
    console.print(f"wrote {out}/ (head_scores.csv/json, layer_summary.md, figures)")


@analyze_app.command("heads")
def heads(
    model: Annotated[str | None, typer.Argument(
        help="'default' (the embedded MiniLM, the default), a run directory, or a saved "
             "model folder.", show_default=False,
    )] = None,
    task: Annotated[str | None, typer.Option(
        help="Task whose split is analysed. Default: the run's task, else cola.")] = None,
    split: Annotated[str | None, typer.Option(help="Split. Default: the task's dev.")] = None,
    data_dir: Annotated[str | None, typer.Option(
        help="Data folder or 'builtin'. Default: the run's, else ../shared/data if present, "
             "else builtin.")] = None,
    text_file: Annotated[Path | None, typer.Option(
        help="Analyse this file instead (one sentence per line).")] = None,
    limit: Annotated[int | None, typer.Option(help="First N examples only.")] = None,
    batch_size: Annotated[int, typer.Option(help="Examples per forward pass.")] = 32,
    max_length: Annotated[int | None, typer.Option(
        help="Tokens per example. Default: the run's, else 128.")] = None,
    heads: Annotated[str | None, typer.Option(
        "--heads", help="LAYER:HEAD list (0-based) for average maps, e.g. 0:3,2:7.")] = None,
    compare: Annotated[tuple[str, str] | None, typer.Option(
        help="Analyse two models (runs, folders or 'default') and compare their classes.",
        metavar="A B")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Output folder. Default: <run>/analysis, else runs/analysis-<model>.")] = None,
    examples: Annotated[int, typer.Option(help="Examples kept for the report explorer.")] = 4,
) -> None:
    """Score every head (vertical, diagonal, block, entropy, ...), classify, and plot."""
    from .recipes import analyze as rec  # start-up: the recipe loads transformers

    if compare is not None and model is not None:
        fail("give either MODEL or --compare A B, not both")
    at_least("--examples", examples, 0)
    if out is not None:
        folder_option("--out", out)
    with user_errors(ValueError, KeyError):
        head_list = rec.parse_heads(heads)
        specs = list(compare) if compare is not None else [model or "default"]
        results, outs = [], []
        source = rec.TextSource(task=task or "cola", split=split, data_dir=data_dir,
                                text_file=str(text_file) if text_file else None,
                                limit=limit, max_length=max_length)
        for k, spec in enumerate(specs):
            loaded = rec.load_model(spec)
            if k == 0:  # with --compare, B reads exactly what A reads (A's run defaults too)
                source = rec.source_for(loaded, source, task_given=task is not None)
            result = rec.analyze_model(loaded, source, batch_size=batch_size, heads=head_list,
                                       n_examples=examples, progress=_progress)
            if Path(sys.argv[0]).name == "attnlab":  # not when called from Python/tests
                result.meta["command"] = shlex.join(["attnlab", *sys.argv[1:]])
            if compare is None:
                folder = out or rec.default_out(loaded)
            else:  # each model's analysis in a/ and b/ under the comparison folder
                root = out or rec.compare_out(*compare)
                folder = root / f"{'ab'[k]}-{rec.safe_name(loaded.name)}"
            rec.write_analysis(result, folder)
            results.append(result)
            outs.append(folder)
        if compare is not None:
            doc, _ = rec.compare_analyses(results[0], results[1], outs[0].parent)
    for result, folder in zip(results, outs, strict=True):
        _print_summary(result, folder)
    if compare is not None and "changed" in doc:
        console.print(f"{len(doc['changed'])} heads changed class; wrote "
                      f"{outs[0].parent}/compare_classes.png/svg and compare.json")
    elif compare is not None:  # different shapes: shares by depth
        shares = "; ".join(f"{k}: " + ", ".join(f"{c} {v:.0%}" for c, v in s.items() if v)
                           for k, s in doc["class_shares"].items())
        console.print(f"class shares ({shares}); wrote "
                      f"{outs[0].parent}/compare_class_shares.png/svg and compare.json")


@analyze_app.command("importance")
def importance(
    model: Annotated[str, typer.Argument(
        help="A finished run directory, or a saved model folder with its task head.",
        show_default=False)],
    task: Annotated[str | None, typer.Option(
        help="Task whose labelled split is used. Default: the run's task, else cola.")] = None,
    split: Annotated[str | None, typer.Option(help="Split. Default: the task's dev.")] = None,
    data_dir: Annotated[str | None, typer.Option(
        help="Data folder or 'builtin'. Default: the run's, else ../shared/data if present, "
             "else builtin.")] = None,
    limit: Annotated[int | None, typer.Option(help="First N examples only.")] = None,
    batch_size: Annotated[int, typer.Option(help="Examples per forward pass.")] = 32,
    max_length: Annotated[int | None, typer.Option(
        help="Tokens per example. Default: the run's, else 128.")] = None,
    analysis: Annotated[str | None, typer.Option(
        help="Head classes from this head_scores.json (or its folder). Default: analyse the "
             "model now on the same examples.")] = None,
    normalize: Annotated[bool, typer.Option(
        "--normalize/--no-normalize",
        help="Divide each layer's importances by their l2 norm (Michel et al.'s code).")
    ] = True,
    ablation: Annotated[bool, typer.Option(
        "--ablation/--no-ablation",
        help="Also evaluate the task metric with each head, and each head class, masked "
             "(1 + layers x heads + classes evaluations).")] = True,
    metric: Annotated[str | None, typer.Option(
        help="Metric of the ablation (one the task computes, e.g. accuracy). Default: the "
             "task's main metric.")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Output folder. Default: <run>/analysis, else runs/analysis-<model>.")] = None,
) -> None:
    """Head importance (Michel et al. 2019: E|dL/dxi_h| with a head mask xi) and ablation."""
    from .recipes import analyze as rec  # start-up: the recipes load transformers
    from .recipes.importance import run_importance, write_importance

    if metric is not None and not ablation:  # the metric is the ablation's, and nothing else's
        fail(f"--metric {metric}: only the ablation uses a metric, and --no-ablation skips it; "
             "drop --metric, or drop --no-ablation to ablate on it")
    if out is not None:
        folder_option("--out", out)
    with user_errors(ValueError, KeyError):
        loaded = rec.load_model(model)
        source = rec.source_for(loaded, rec.TextSource(
            task=task or "cola", split=split, data_dir=data_dir, limit=limit,
            max_length=max_length), task_given=task is not None)
        seed = loaded.config.seed if loaded.config is not None else 0
        result = run_importance(loaded, source, batch_size=batch_size, normalize=normalize,
                                ablation=ablation, analysis=analysis, metric=metric,
                                seed=seed, progress=_progress)
        if Path(sys.argv[0]).name == "attnlab":  # not when called from Python/tests
            result.meta["command"] = shlex.join(["attnlab", *sys.argv[1:]])
        folder = out or rec.default_out(loaded)
        write_importance(result, folder)
    _print_importance(result, folder)


def _print_importance(result: Any, out: Path) -> None:
    imp, abl, meta = result.importance, result.ablation, result.meta
    norm = "per-layer l2-normalised" if imp.normalized else "raw"
    table = Table(title=f"{meta['model_name']}: head importance ({norm}) by class, "
                        f"{meta['examples']} examples of {meta['text']} "
                        f"({meta['seconds']:.1f} s)")
    for col in ("class", "heads", "mean importance", "mean delta (one head)",
                "delta (class masked)"):
        table.add_column(col, justify="left" if col == "class" else "right",
                         no_wrap=col == "class")

    def num(x: float, signed: bool = False) -> str:
        return "n/a" if math.isnan(x) else (f"{x:+.4f}" if signed else f"{x:.4f}")

    for r in result.by_class:
        table.add_row(r["class"], str(r["heads"]), num(r["mean_importance"]),
                      num(r["mean_head_delta"], True), num(r["class_delta"], True))
    console.print(table)
    if abl is not None:
        console.print(f"{abl.metric} with every head: {abl.baseline:.4f}; delta = masked minus "
                      "that")
    flat = imp.importance.flatten()
    top = flat.argsort(descending=True)[:5].tolist()
    heads = imp.importance.shape[1]
    console.print("most important heads (layer:head): " + ", ".join(
        f"{k // heads}:{k % heads} ({float(flat[k]):.3f})" for k in top))
    figures = "importance" + (", ablation" if abl is not None else "")
    console.print(f"wrote {out}/ (importance.json/csv/md, {figures}.png/svg)")


@analyze_app.command("overlap")
def overlap(
    models: Annotated[list[str], typer.Argument(
        help="'default' (the embedded MiniLM), finished run directories or saved model "
             "folders.", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        help="Also write {model: per-layer overlap} to this JSON file.")] = None,
) -> None:
    """W_O subspace overlap between the heads of each layer (attnlab.analysis.overlap)."""
    from .analysis.overlap import model_overlap
    from .io import write_json
    from .recipes import analyze as rec  # start-up: the recipes load transformers

    if out is not None:
        file_option("--out", out)
    results: dict[str, Any] = {}
    with user_errors(ValueError, KeyError):
        for spec in models:
            results[spec] = model_overlap(rec.load_model(spec).model)
    first = next(iter(results.values()))
    table = Table(title="W_O subspace overlap between heads (mean cos^2 of the principal "
                        f"angles over pairs of heads; chance {first['chance']:.3f})")
    table.add_column("model", overflow="fold")
    for i in range(len(first["per_layer"])):
        table.add_column(f"L{i}", justify="right", no_wrap=True, min_width=6)
    table.add_column("mean", justify="right", no_wrap=True, min_width=6)
    for spec, rec_ in results.items():
        table.add_row(spec, *(f"{v:.4f}" for v in rec_["per_layer"]), f"{rec_['mean']:.4f}")
    console.print(table)
    if out is not None:
        write_json(out, results)
        console.print(f"wrote {out}")


def _percent(share: float) -> str:
    """0.0914 -> "9.14%"; a share that is not zero never prints as 0.00%."""
    return "<0.01%" if 0 < share < 1e-4 else f"{100 * share:.2f}%"


@analyze_app.command("links")
def links(
    model: Annotated[str, typer.Argument(
        help="'default' (the embedded MiniLM), a run directory, or a saved model folder.")
    ] = "default",
    task: Annotated[str, typer.Option(help="Task whose split is read.")] = "cola",
    split: Annotated[str | None, typer.Option(help="Split. Default: the task's dev.")] = None,
    data_dir: Annotated[str | None, typer.Option(
        help="Data folder or 'builtin'. Default: ../shared/data if present, else builtin.")
    ] = None,
    sentences: Annotated[int, typer.Option(help="The first N examples of the split.")] = 16,
    rho: Annotated[str, typer.Option(
        help="Thresholds rho, comma-separated (JAT links i and j through key k when "
             r"S\[i,k] S\[j,k] / (d max(|K_k|, 1)) >= rho).")] = "5,10",  # \[: not markup
    heads: Annotated[str, typer.Option(
        help="Heads of every layer: all, even (JAT's in the paper's recipe), odd, or 0-based "
             "indices such as 0,2.")] = "all",
    padding: Annotated[str, typer.Option(
        help="exclude: padding is no key and no pair (JAT mask_pads=True; independent of "
             "batching); include: padding keys take part and every entry of the padded batch "
             "counts (JAT's default mask_pads=False; depends on the batching).")
    ] = "exclude",
    max_length: Annotated[int, typer.Option(help="Tokens per example (truncated).")] = 64,
    batch_size: Annotated[int, typer.Option(help="Examples per forward pass.")] = 32,
    out: Annotated[Path | None, typer.Option(help="Also write the shares to this JSON file.")
                   ] = None,
) -> None:
    """Jump-link density: per layer, the share of (i, j) pairs that JAT's jump graph links.

    Counts C[i, j] = sum_k 1[S[i,k] S[j,k] / (d max(|K_k|, 1)) >= rho] on each head's raw
    scores S = q k^T, exactly as the jat mechanism does; the share is the fraction of
    (example, head, i, j) entries with C > 0, pooled over the examples and the chosen heads
    (attnlab.analysis.jump_links).
    """
    from .analysis.jump_links import PadMode, head_set, jump_link_shares, parse_rhos
    from .hf.arch import inspect_model
    from .io import write_json
    from .recipes import analyze as rec  # start-up: the recipes load transformers

    if sentences < 1:
        fail(f"--sentences must be at least 1, got {sentences}")
    at_least("--batch-size", batch_size)
    if out is not None:
        file_option("--out", out)
    with user_errors(ValueError, KeyError):
        rhos = parse_rhos(rho)
        loaded = rec.load_model(model)
        head_list = head_set(heads, inspect_model(loaded.model).num_heads)
        source = rec.TextSource(task=task, split=split, data_dir=data_dir, limit=sentences,
                                max_length=max_length)
        feats = rec.load_features(source, loaded.tokenizer)
        result = jump_link_shares(loaded.model, loaded.tokenizer, feats, rhos,
                                  heads=head_list, padding=cast(PadMode, padding),
                                  batch_size=batch_size)
    chosen = heads if heads in ("all", "even", "odd") else ",".join(map(str, head_list))
    console.print(f"{loaded.name}: {result.examples} examples of {source.describe()} (max "
                  f"length {max_length}); heads {chosen} of every layer; padding {padding}",
                  highlight=False)
    table = Table(title="share of (i, j) pairs with at least one jump link")
    table.add_column("layer", justify="right")
    for r in result.rhos:
        table.add_column(f"rho={r:g}", justify="right")
    shares = result.shares  # [r, L]
    for layer in range(shares.shape[1]):
        table.add_row(str(layer), *(_percent(float(s)) for s in shares[:, layer]))
    _print_table(table)
    if out is not None:
        meta = {"model": loaded.name, "text": source.describe(), "max_length": max_length,
                "batch_size": batch_size}
        if Path(sys.argv[0]).name == "attnlab":  # not when called from Python/tests
            meta["command"] = shlex.join(["attnlab", *sys.argv[1:]])
        write_json(out, {**result.to_dict(), "meta": meta})
        console.print(f"wrote {out}")


def report(
    run_dir: Annotated[str, typer.Argument(help="A finished run directory (runs/<name>).")],
    out: Annotated[Path | None, typer.Option(
        help="Output file. Default: RUN_DIR/report.html.")] = None,
    sample: Annotated[int, typer.Option(
        help="Examples analysed when the run has no analysis/ folder.")] = 64,
    data_dir: Annotated[str | None, typer.Option(
        help="Data folder for that sample. Default: the run's.")] = None,
    batch_size: Annotated[int, typer.Option(help="Examples per forward pass.")] = 32,
) -> None:
    """One self-contained HTML report of a run: config, plan, metrics, head grids, explorer."""
    from .recipes.run_report import run_report  # start-up: loads transformers, matplotlib

    at_least("--sample", sample)  # run_report's own check would name analyze's --limit
    at_least("--batch-size", batch_size)
    if out is not None:
        file_option("--out", out)
    with user_errors(ValueError, KeyError):
        path, origin = run_report(run_dir, out=out, sample=sample, data_dir=data_dir,
                                  batch_size=batch_size, progress=_progress)
    console.print(f"head grids: {origin}")
    console.print(f"wrote {path}")


@analyze_app.command("connections")
def connections(
    run_dir: Annotated[str | None, typer.Argument(
        help="A finished token-classification run on conll2003 (runs/<name>), 'default' (the "
             "embedded MiniLM) or a saved model folder.", show_default=False,
    )] = None,
    compare: Annotated[tuple[str, str] | None, typer.Option(
        help="Count two models (e.g. the baseline and BERT-JAT runs) and plot them side by "
             "side.", metavar="RUN_A RUN_B")] = None,
    split: Annotated[str, typer.Option(help="CoNLL split: dev (valid.txt), train or test.")
                     ] = "dev",
    data_dir: Annotated[str | None, typer.Option(
        help="Folder with the CoNLL-2003 files. Default: the run's, else ../shared/data.")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="First N sentences only.")] = None,
    batch_size: Annotated[int, typer.Option(help="Sentences per forward pass.")] = 32,
    max_length: Annotated[int | None, typer.Option(
        help="Tokens per sentence. Default: the run's, else 128.")] = None,
    entities_only: Annotated[bool, typer.Option(
        "--entities-only", help="Drop O tokens: count only pairs of entity and special "
                                "tokens.")] = False,
    diagonal: Annotated[bool, typer.Option(
        "--diagonal", help="Also count a token attending to itself (left out by "
                           "default).")] = False,
    out: Annotated[Path | None, typer.Option(
        help="Output folder. Default: <run>/analysis, else runs/connections-<model>.")] = None,
) -> None:
    """JAT case study: count major connections (p > mean + std) per layer and entity class.

    A connection's class: PER/ORG/LOC/MISC/O when both tokens share it, SEP when either is
    [CLS]/[SEP], CROSS otherwise. Every sub-word token carries its word's class; the
    threshold uses the population std of each head's map cropped to the real tokens.
    Writes connections.csv/json and bar plots (PNG + SVG).
    """
    from .recipes import connections as rec  # start-up: loads transformers, matplotlib

    if compare is not None and run_dir is not None:
        fail("give either RUN_DIR or --compare RUN_A RUN_B, not both")
    if out is not None:
        folder_option("--out", out)
    with user_errors(ValueError, KeyError):
        specs = list(compare) if compare is not None else [run_dir or "default"]
        source = rec.ConllSource(split=split, data_dir=data_dir, limit=limit,
                                 max_length=max_length)
        loaded = [rec.load_ner_model(s) for s in specs]  # refuse a bad run before any work
        results: list[rec.ConnectionsResult] = []
        outs = []
        for k, model in enumerate(loaded):
            if k == 1:  # B reads exactly what A read (A's run defaults included)
                source = rec.ConllSource(split=split, data_dir=results[0].meta["data_dir"],
                                         limit=limit, max_length=results[0].meta["max_length"])
            result = rec.count_model(model, source, batch_size=batch_size,
                                     entities_only=entities_only, include_diagonal=diagonal,
                                     progress=_progress)
            if compare is None:
                folder = out or rec.default_connections_out(model)
            else:
                root = out or rec.compare_connections_out(*compare)
                folder = root / f"{'ab'[k]}-{rec.safe_name(model.name)}"
            rec.write_connections(result, folder)
            results.append(result)
            outs.append(folder)
        if compare is not None:
            rec.compare_connections(results[0], results[1], outs[0].parent)
    for result, folder in zip(results, outs, strict=True):
        rows = result.counts.rows()
        table = Table(title=f"major connections per layer: {rec.describe(result)} "
                            f"({result.meta['seconds']:.1f} s)")
        for key in rows[0]:
            table.add_column(key, justify="right")
        for r in rows:
            table.add_row(*(str(v) for v in r.values()))
        table.add_row("all", *(str(sum(r[k] for r in rows)) for k in list(rows[0])[1:]))
        _print_table(table)
        console.print(f"wrote {folder}/ (connections.csv/json, connections_per_layer"
                      f"{{,_nosep}}.png/svg)")
    if compare is not None:
        console.print(f"wrote {outs[0].parent}/connections_compare.csv/json and "
                      "connections_compare{,_nosep}.png/svg")
