"""``summary.json``: what a run says about itself, as one typed record.

:class:`RunSummary` is written by :func:`write_summary` and read back by :func:`read_summary`
(the one pair; report, compare, collect and eval read runs through it). The file is the
record's fields as JSON plus ``schema_version``. Files written before the schema existed
(version 1: no status, no provenance, the plan as a JSON string) read with those fields
unset (``None``), the plan decoded, and ``status`` derived from ``interrupted``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io import write_json

SCHEMA_VERSION = 2
FILE = "summary.json"


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """One run's result, cost and provenance (``summary.json``)."""

    name: str
    task: str
    seed: int
    status: str  # "finished", "interrupted" or "failed"
    error: str | None = None  # for a failed run: the exception, one line
    plan: list[Any] = field(default_factory=list)  # rules as Plan.to_list()
    tuning: str | None = None  # tuner spec
    main_metric: str | None = None
    greater_is_better: bool | None = None
    best_metric: float | None = None
    best_step: int | None = None
    best_eval: dict[str, float] = field(default_factory=dict)  # the reported model's
    before_finalize: dict[str, Any] | None = None  # Diff-Prune: the dense model's best
    pruned_eval: dict[str, float] | None = None  # Diff-Prune: right after pruning
    masked_steps: int | None = None  # Diff-Prune: steps of the fixed-mask stage
    final_eval: dict[str, float] = field(default_factory=dict)  # the last evaluation
    steps: int | None = None
    train_examples: int | None = None
    train_seconds: float | None = None
    seconds_per_step: float | None = None
    peak_rss_mb: float | None = None  # this run's own peak resident memory
    params: dict[str, Any] | None = None  # tuning.accounting.count_parameters
    surgery: dict[str, Any] | None = None  # SurgeryReport.to_dict()
    # wo_sparse: heads' W_O subspace overlap {"before"|"after": analysis.overlap.model_overlap}
    head_overlap: dict[str, Any] | None = None
    interrupted: bool = False
    num_processes: int = 1
    degenerate: str | None = None  # the one-class warning, if it fired
    attnlab_version: str | None = None
    git_commit: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    device: str | None = None
    started: str | None = None
    finished: str | None = None
    wall_seconds: float | None = None

    @property
    def is_finished(self) -> bool:
        """Ran to its end (not interrupted, not failed): what tables count."""
        return self.status == "finished" and not self.interrupted

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if isinstance(values.get("plan"), str):  # schema 1 stored the plan as JSON text
            plan = json.loads(values["plan"])
            values["plan"] = plan.get("plan", []) if isinstance(plan, dict) else plan
        values.setdefault("status", "interrupted" if data.get("interrupted") else "finished")
        values.setdefault("name", "")
        values.setdefault("task", "")
        values.setdefault("seed", 0)
        return cls(**values)


def write_summary(run_dir: str | Path, summary: RunSummary) -> Path:
    return write_json(Path(run_dir) / FILE, summary.to_dict())


def read_summary(run_dir: str | Path) -> RunSummary:
    """The summary of a run folder (FileNotFoundError naming the folder if it has none)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} an attnlab run folder?")
    return RunSummary.from_dict(json.loads(path.read_text()))
