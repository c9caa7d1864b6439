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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError
from .compare import bar_plot, summarise, to_csv, to_markdown


def _seeds(folder: Path) -> list[Path]:
    return sorted(folder.glob("seed-*/summary.json"))


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
    summaries = [json.loads(p.read_text()) for p in _seeds(folder)]
    finished = [s for s in summaries if not s.get("interrupted")]
    if not finished:
        raise ConfigError(f"{folder}: no finished run (seed-*/summary.json)")
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


def collect(items: list[str], show: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows for ``[LABEL=]PATH`` items, in the order given."""
    show = show or []
    rows = []
    for item in items:
        label, path = _split_item(item)
        if not path.is_dir():
            raise ConfigError(f"{path}: no such folder (give a compare output or variant folder)")
        if _seeds(path):
            rows.append(_row(label or f"{path.parent.name}/{path.name}", path, show))
            continue
        variants = sorted(p for p in path.iterdir() if p.is_dir() and _seeds(p))
        if not variants:
            raise ConfigError(f"{path}: neither a variant folder (seed-*/summary.json) nor a "
                              "compare output folder with variant folders")
        for v in variants:
            rows.append(_row(f"{label or path.name}/{v.name}", v, show))
    metrics = {r["metric"] for r in rows}
    if len(metrics) > 1:
        raise ConfigError(f"the runs report different metrics {sorted(metrics)}: collect runs "
                          "of one task")
    return rows


def write_collected(rows: list[dict[str, Any]], out: Path, show: list[str] | None = None
                    ) -> Path:
    """comparison.{md,csv,json,png} under ``out`` (atomic writes)."""
    from ..train.checkpoint import write_json_atomic

    out.mkdir(parents=True, exist_ok=True)
    md = to_markdown(rows)
    if show:  # extra columns at the end of the Markdown table
        lines = md.splitlines()
        lines[0] += "".join(f" {k} |" for k in show)
        lines[1] += "---|" * len(show)
        for i, r in enumerate(rows, start=2):
            lines[i] += "".join(f" {r[k]} |" for k in show)
        md = "\n".join(lines) + "\n"
    for name, text in (("comparison.md", md), ("comparison.csv", to_csv(rows))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    write_json_atomic(out / "comparison.json", rows)
    fig = bar_plot(rows)
    tmp_png = out / ".comparison.png.tmp.png"
    fig.savefig(tmp_png, dpi=120)
    tmp_png.replace(out / "comparison.png")
    return out
