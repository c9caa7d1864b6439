"""``attnlab collect``: one table from runs made by several ``attnlab compare`` calls.

Variants that need different settings (each tuner at its own learning rate, a grid point
picked after a search) come from separate ``compare`` calls; ``collect`` puts them side by
side::

    attnlab collect full=runs/exp/cola-jat/baseline runs/exp/cola-bitfit \\
        pasta=runs/exp/cola-pasta/1e-3 --show optim.lr --out runs/exp/cola-tuners

Each argument is ``[LABEL=]PATH``. PATH is a variant folder (``seed-*/summary.json`` inside)
giving one row, or a ``compare`` output folder giving one row per variant folder in it.
Rows are recomputed from the run summaries (mean ± std over the seeds found); ``--show KEY``
adds a column with a config value (from the first seed's ``config.yaml``). Writes
``comparison.{md,csv,json,png}`` under ``--out`` like ``compare`` does.

``--matrix`` makes the tables of the papers, methods x tasks: each label is ``ROW@TASK`` and
names one variant folder; each task keeps its own metric; ``matrix.md`` has mean ± std per
cell and each row's trained share of the backbone, ``matrix.png`` one panel per task::

    attnlab collect --matrix pasta@cola=runs/cola-pasta/1e-2 pasta@mrpc=runs/mrpc-pasta/1e-2 \\
        lora@cola=runs/cola-lora/2e-3 lora@mrpc=runs/mrpc-lora/2e-3 --out runs/tuners
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError
from ..io import atomic_path, atomic_write, write_json
from .compare import bar_plot, mean_std_text, summarise, to_csv, to_markdown
from .summary import read_summary


def _seeds(folder: Path) -> list[Path]:
    """Finished seeds' summaries in seed order (seed-2 before seed-10)."""
    def number(p: Path) -> tuple[int, str]:
        tail = p.parent.name.removeprefix("seed-")
        return (int(tail), "") if tail.isdigit() else (1 << 30, tail)

    return sorted(folder.glob("seed-*/summary.json"), key=number)


def _config_value(folder: Path, key: str) -> Any:
    cfg_path = next(iter(sorted(folder.glob("seed-*/config.yaml"))), None)
    if cfg_path is None:
        return None
    value: Any = yaml.safe_load(cfg_path.read_text())
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"--show {key!r}: {cfg_path} has no {part!r}")
        value = value[part]
    return value


def _row(label: str, folder: Path, show: list[str]) -> dict[str, Any]:
    paths = _seeds(folder)
    summaries = [read_summary(p.parent) for p in paths]
    finished = [s for s in summaries if s.is_finished]
    if not finished:
        raise ConfigError(f"{folder}: no finished run (seed-*/summary.json)")
    done = {p.parent.name for p, s in zip(paths, summaries, strict=True)
            if s.is_finished}
    left = sorted(d.name for d in folder.glob("seed-*") if d.is_dir() and d.name not in done)
    if left:
        warnings.warn(f"{folder}: {', '.join(left)} left out of the table (no summary.json, "
                      "interrupted or failed): still running, or resume it with --resume",
                      stacklevel=2)
    row = summarise(label, finished)
    for key in show:
        row[key] = _config_value(folder, key)
    return row


def _split_item(item: str) -> tuple[str, Path]:
    """``[LABEL=]PATH`` -> (label, path). compare's variant folders contain '=' themselves
    (``method=pasta_lr=1e-3``), so a whole existing path wins, then the first split whose
    right side exists, then the first '='."""
    if Path(item).is_dir() or "=" not in item:
        return "", Path(item)
    cuts = [i for i, ch in enumerate(item) if ch == "="]
    for i in cuts:
        if Path(item[i + 1:]).is_dir():
            return item[:i], Path(item[i + 1:])
    return item[:cuts[0]], Path(item[cuts[0] + 1:])


def cell_of(label: str) -> tuple[str, str]:
    """``ROW@COLUMN`` (e.g. ``pasta@cola``) -> (row, column) of ``--matrix``."""
    row, sep, col = label.rpartition("@")
    if not (sep and row and col):
        raise ConfigError(f"--matrix: label {label!r} must be ROW@COLUMN=PATH, e.g. "
                          "pasta@cola=runs/cola-pasta/1e-3 (one variant folder per cell)")
    return row, col


def collect(items: list[str], show: list[str] | None = None, matrix: bool = False
            ) -> list[dict[str, Any]]:
    """Rows for ``[LABEL=]PATH`` items, in the order given. ``matrix``: every item is
    ``ROW@COLUMN=PATH`` of one variant folder, and each column (task) has its own metric."""
    show = show or []
    rows = []
    for item in items:
        label, path = _split_item(item)
        if not path.is_dir():
            what = "is a file, not a folder" if path.exists() else "no such folder"
            raise ConfigError(f"{path}: {what} (give a compare output or variant folder)")
        if matrix:
            cell_of(label)
            if not _seeds(path):
                raise ConfigError(f"--matrix: {path} is not a variant folder (seed-*/summary"
                                  ".json inside); give one per ROW@COLUMN cell")
        if _seeds(path):
            rows.append(_row(label or f"{path.parent.name}/{path.name}", path, show))
            continue
        variants = sorted(p for p in path.iterdir() if p.is_dir() and _seeds(p))
        if not variants:
            raise ConfigError(f"{path}: neither a variant folder (seed-*/summary.json) nor a "
                              "compare output folder with variant folders")
        for v in variants:
            rows.append(_row(f"{label or path.name}/{v.name}", v, show))
    if len({r["variant"] for r in rows}) < len(rows):  # one row per label: a table, no echo
        twice = sorted({r["variant"] for r in rows if [x["variant"] for x in rows].count(
            r["variant"]) > 1})
        raise ConfigError(f"{', '.join(twice)} given more than once" + (
            " (one folder per ROW@COLUMN cell)" if matrix else
            "; give each folder once, or label them apart (LABEL=PATH)"))
    by_column: dict[str, set[str]] = {}
    for r in rows:
        by_column.setdefault(cell_of(r["variant"])[1] if matrix else "", set()).add(r["metric"])
    for col, metrics in by_column.items():
        if len(metrics) > 1:
            where = f"column {col!r}" if matrix else "the runs"
            raise ConfigError(f"{where} report different metrics {sorted(metrics)}: collect "
                              "runs of one task" + ("" if matrix else
                                                    " (or use --matrix ROW@TASK=PATH)"))
    return rows


def to_matrix_markdown(rows: list[dict[str, Any]]) -> str:
    """Rows x columns of ``ROW@COLUMN`` labels: mean ± std per cell (``(n=k)`` where a cell
    has another seed count than most), and each row's trained share of the backbone."""
    cells = {cell_of(r["variant"]): r for r in rows}
    names = list(dict.fromkeys(k[0] for k in cells))
    cols = list(dict.fromkeys(k[1] for k in cells))
    usual = Counter(r["seeds"] for r in rows).most_common(1)[0][0]
    metric = {c: next(r["metric"] for (_, cc), r in cells.items() if cc == c) for c in cols}
    lines = ["| | " + " | ".join(f"{c} ({metric[c]})" for c in cols)
             + " | trained params (% backbone) |", "|---" * (len(cols) + 2) + "|"]
    for name in names:
        texts, shares, kept, pruned = [], [], [], False
        for c in cols:
            r = cells.get((name, c))
            if r is None:
                texts.append("-")
                continue
            n = "" if r["seeds"] == usual else f" (n={r['seeds']})"
            texts.append(mean_std_text(r) + n)
            shares.append(r["percent_of_backbone"])
            kept.append(r.get("percent_effective", r["percent_of_backbone"]))
            pruned |= r.get("effective_without_head", r["trainable_without_head"]) != \
                r["trainable_without_head"]
        share = _span(shares)
        if pruned:  # Diff-Prune: trains every entry, keeps a few
            share += f", kept {_span(kept)}"
        lines.append(f"| {name} | " + " | ".join(texts) + f" | {share} |")
    return "\n".join(lines) + "\n"


def _span(values: list[float]) -> str:
    """``0.020%``, or ``0.020-0.022%`` where the share differs between tasks (pairs)."""
    lo, hi = min(values), max(values)
    return f"{lo:.3f}%" if hi - lo < 5e-4 else f"{lo:.3f}-{hi:.3f}%"


def matrix_plot(rows: list[dict[str, Any]], model: str | None = None):
    """One panel per column (task), three to a line: each row's mean ± std and its seeds as
    points on the task's own metric axis (``figures.matrix_plot``); a cell no run filled is
    a hatched "n/a" band, not a zero."""
    from .figures import matrix_plot as draw  # heavy: matplotlib, imported on use

    cells = {cell_of(r["variant"]): r for r in rows}
    names = list(dict.fromkeys(k[0] for k in cells))
    cols = list(dict.fromkeys(k[1] for k in cells))
    metric = {c: next(r["metric"] for (_, cc), r in cells.items() if cc == c) for c in cols}
    return draw(cells, rows=names, tasks=[(c, c, metric[c]) for c in cols], model=model)


def write_collected(rows: list[dict[str, Any]], out: Path, show: list[str] | None = None,
                    matrix: bool = False) -> Path:
    """comparison.{md,csv,json,png} under ``out`` (atomic writes); with ``matrix`` also
    matrix.md and matrix.png (rows x columns)."""

    out.mkdir(parents=True, exist_ok=True)
    md = to_markdown(rows)
    if show:  # extra columns at the end of the Markdown table
        lines = md.splitlines()
        lines[0] += "".join(f" {k} |" for k in show)
        lines[1] += "---|" * len(show)
        for i, r in enumerate(rows, start=2):
            lines[i] += "".join(f" {r[k]} |" for k in show)
        md = "\n".join(lines) + "\n"
    texts = [("comparison.md", md), ("comparison.csv", to_csv(rows))]
    if matrix:  # one bar chart over several metrics would mislead: one panel per task
        texts.append(("matrix.md", to_matrix_markdown(rows)))
        figs = [("matrix.png", matrix_plot(rows))]
    else:
        figs = [("comparison.png", bar_plot(rows))]
    for name, text in texts:
        atomic_write(out / name, text)
    write_json(out / "comparison.json", rows)
    import matplotlib.pyplot as plt  # after the figures chose the Agg backend

    for name, fig in figs:
        with atomic_path(out / name) as tmp_png:
            fig.savefig(tmp_png, dpi=120)
        plt.close(fig)
    return out
