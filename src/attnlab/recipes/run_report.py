"""``attnlab report RUN_DIR``: one self-contained HTML page for a finished run.

The run's config, plan, summary and ``metrics.jsonl`` (training loss and dev metric
curves), and the head grids: from ``RUN_DIR/analysis/`` when ``attnlab analyze heads`` wrote
it, else computed now on a sample of the task's dev split (see :func:`run_report`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ..analysis import build_report, read_history, read_json
from ..tasks import get_task
from .analyze import (
    ANALYSIS_DIR,
    Progress,
    TextSource,
    analyze_model,
    is_run_dir,
    load_model,
    read_examples,
    source_for,
)
from .summary import read_summary


def _load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None


def run_report(
    run_dir: str | Path,
    *,
    out: str | Path | None = None,
    sample: int = 64,
    data_dir: str | None = None,
    batch_size: int = 32,
    progress: Progress | None = None,
) -> tuple[Path, str]:
    """Write ``RUN_DIR/report.html`` (or ``out``); returns (path, where the grids came from).

    The grids come from ``RUN_DIR/analysis/head_scores.json`` when present (with its
    ``examples.json`` and head maps); otherwise the run's model is rebuilt and analysed on the
    first ``sample`` examples of its task's dev split (nothing is written to ``analysis/``).
    """
    run = Path(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"run directory {run} does not exist")
    if not run.is_dir() or not is_run_dir(run):
        raise FileNotFoundError(f"{run} is not an attnlab run directory (no config.yaml)")
    config = _load_yaml(run / "config.yaml")
    plan_file = run / "plan.json"
    summary_file = run / "summary.json"
    summary = ({k: v for k, v in read_summary(run).to_dict().items() if v is not None}
               if summary_file.is_file() else {})
    # plan.json (or the summary's plan): a list, {"plan": [...]}, or older runs' JSON string
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else summary.get("plan")
    metrics = {k: v for k, v in summary.items() if k not in ("plan", "surgery")}
    history = read_history(run / "metrics.jsonl")
    analysis_dir = run / ANALYSIS_DIR
    figures: dict[str, Any] = {}
    if (analysis_dir / "head_scores.json").is_file():
        scores, classes = read_json(analysis_dir / "head_scores.json")
        meta = json.loads((analysis_dir / "head_scores.json").read_text())["meta"]
        ex_file = analysis_dir / "examples.json"
        examples = read_examples(ex_file) if ex_file.is_file() else []
        for png in sorted(analysis_dir.glob("head_L*_H*.png")):
            figures[f"average map, {png.stem}"] = png
        origin = (f"{analysis_dir} ({meta.get('examples', '?')} examples of "
                  f"{meta.get('text', '?')})")
    else:
        loaded = load_model(str(run))
        assert loaded.config is not None
        source = source_for(loaded, TextSource(data_dir=data_dir, limit=sample),
                            task_given=False)
        result = analyze_model(loaded, source, batch_size=batch_size, progress=progress)
        scores, classes = result.analysis.scores, result.analysis.classes
        examples = result.examples
        origin = (f"computed now on a sample: {result.analysis.n_examples} examples of "
                  f"{source.describe()} (run `attnlab analyze heads {run}` for the full set)")
    metrics["analysis"] = {"source": origin}
    title = f"attnlab run {summary.get('name', run.name)}"
    if summary:
        title += f": {summary.get('task', '')} ({summary.get('tuning', '')})"
    path = Path(out) if out is not None else run / "report.html"
    task_name = summary.get("task") or ((config or {}).get("task") or {}).get("name")
    build_report(path, title=title, config=config, plan=plan or None, metrics=metrics,
                 scores=scores, classes=classes, examples=examples, figures=figures,
                 surgery=summary.get("surgery"), history=history, task=task_name,
                 model=_model_label(config), loss_unit=_loss_unit(task_name))
    return path, origin


def _model_label(config: Any) -> str:
    """The model's name for axis labels: the embedded default by its real name."""
    name = str(((config or {}).get("model") or {}).get("name") or "model")
    return "all-MiniLM-L6-v2" if name == "default" else name


def _loss_unit(task_name: str | None) -> str:
    """What the logged training loss measures: squared error for regression tasks (STS-B),
    else cross-entropy in nats (classification, tagging, span starts/ends, masked tokens)."""
    try:
        regression = getattr(get_task(str(task_name)), "problem_type", None) == "regression"
    except (KeyError, ValueError):
        regression = False
    return "mean squared error" if regression else "cross-entropy, nats"
