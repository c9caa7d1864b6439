"""``attnlab compare``: run variants of one config over seeds, then one table and one plot.

``--vary plan=baseline,band64 --vary tuning.method=full,pasta --seeds 3`` runs the
cartesian product of the values, each over seeds 0..2, into
``<output_dir>/<name>/<variant>/seed-<s>/``, and writes ``comparison.{md,csv,png}`` beside
them: main metric mean ± std over seeds, parameters trained (with the % of the
backbone), train time per step and peak memory.

Values of ``plan`` are named plans (``presets.NAMED_PLANS``; ``baseline`` = no change), a named plan
with mechanism arguments changed (``jat(rho=4.5)``: every rule of ``jat`` gets rho=4.5, the
way to run a grid), or compact rules ``LAYERS:HEADS:SPEC`` joined by ';'. Values of other
keys are YAML scalars. Values are separated by commas outside brackets, or by '|' when any
value has a top-level comma (``--vary 'plan=baseline|0,1,4,5:0,2,4,6,8,10:jat(rho=4.5)'``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

import torch
import yaml
from rich.progress import Progress

from ..config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    from_dict,
    resolved_yaml,
    to_dict,
    validate,
    with_optim_defaults,
)
from ..io import atomic_write, write_json
from ..presets import plan_value
from .preflight import preflight
from .rundir import finished_summary
from .summary import RunSummary, read_summary
from .versus import add_versus, check_reference, versus_cells


def parse_vary(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["plan=a,b", "optim.lr=1e-4,3e-4"]`` -> [("plan", ["a", "b"]), ...]."""
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--vary {item!r} must look like key=value1,value2")
        key, vals = item.split("=", 1)
        pieces = vals.split("|") if "|" in vals else _split_commas(vals)
        values = [v.strip() for v in pieces if v.strip()]
        if not values:
            raise ConfigError(f"--vary {item!r} lists no values")
        if key.strip() == "plan" and "|" not in vals:
            for v in values:
                if _cut_rule(v):
                    raise ConfigError(
                        f"--vary {item!r}: {v!r} is no plan: a comma in a rule's layers or "
                        "heads split it; separate the values with '|' instead, e.g. "
                        "'plan=baseline|0,2:all:band(window=8)'")
        out.append((key.strip(), values))
    return out


def _cut_rule(piece: str) -> bool:
    """Whether a comma-split ``plan`` value is a piece of a rule, not a plan: a bare index
    or range (``0``, ``2-3``) or a rule missing its first field (``2:band(window=8)``)."""
    top = re.sub(r"\([^()]*\)|\[[^\[\]]*\]", "", piece)  # the spec's arguments aside
    return bool(re.fullmatch(r"\d+(-\d+)?", top.strip())) or top.count(":") == 1


def _split_commas(text: str) -> list[str]:
    """Split on commas outside brackets (rules contain 'band(window=8, ...)')."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


@dataclass
class Variant:
    label: str
    cfg: ExperimentConfig


def variant_folder(label: str) -> str:
    """A variant's folder name: ``jat(rho=4.5)`` -> ``jat_rho=4.5``; labels over 80 characters
    keep 71 and a hash of the whole label, so two long labels never share a folder."""
    slug = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label).strip("_") or "_"
    if len(slug) > 80:
        slug = f"{slug[:71]}-{hashlib.sha1(label.encode()).hexdigest()[:8]}"
    return slug


def expand(base: ExperimentConfig, vary: list[tuple[str, list[str]]], seeds: int
           ) -> list[tuple[str, list[ExperimentConfig]]]:
    """One (label, [config per seed]) per combination of varied values. Each variant is
    checked as ``attnlab run`` checks a config (``preflight``: plan, model, tuner, data
    folder; not the data itself), so a bad variant stops the grid before any run."""
    combos = list(itertools.product(*[vals for _, vals in vary])) if vary else [()]
    out: list[tuple[str, list[ExperimentConfig]]] = []
    seen: dict[str, str] = {}
    for combo in combos:
        data = to_dict(base)
        label_parts = []
        for (key, _), value in zip(vary, combo, strict=True):
            if key == "plan":
                data["plan"] = plan_value(value)
            else:
                data = apply_overrides(data, [f"{key}={value}"])
            label_parts.append(value if len(vary) == 1 else f"{key.split('.')[-1]}={value}")
        label = ",".join(label_parts) or "base"
        slug = variant_folder(label)
        if slug in seen:
            raise ConfigError(f"variants {seen[slug]!r} and {label!r} would share the folder "
                             f"{slug!r}: make the --vary values differ in letters or digits")
        seen[slug] = label
        cfg = with_optim_defaults(from_dict(ExperimentConfig, data))  # per variant's tuner
        validate(cfg)
        root = Path(base.output_dir) / base.name / slug
        runs = [replace(cfg, seed=s, name=f"seed-{s}", output_dir=str(root)) for s in range(seeds)]
        if runs:  # what `attnlab run` would refuse, now, not after the variants before it
            preflight(runs[0])
        out.append((label, runs))
    return out


def has_value(v: float | None) -> TypeGuard[float]:
    """A seed's metric counts when it exists and is not NaN (e.g. the Spearman of a
    constant prediction)."""
    return v is not None and not math.isnan(v)


def mean_std(values: list[float | None]) -> tuple[float, float]:
    """Mean and sample std (ddof 1) over the seeds that have a metric."""
    vals = [v for v in values if has_value(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def _run_configs(cfgs: list[ExperimentConfig], run: Callable[..., dict[str, Any]],
                 resume: bool, parallel: int) -> list[RunSummary]:
    """Each config's summary: finished ones read back when ``resume``; the rest run here
    (``run``) or in ``parallel`` subprocesses. With ``resume`` an interrupted run continues
    from its last checkpoint (``attnlab run --resume``) instead of starting over."""
    known = {id(cfg): s for cfg in cfgs if resume and (s := finished_summary(cfg)) is not None}
    todo = [cfg for cfg in cfgs if id(cfg) not in known]
    if parallel > 1 and todo:
        run_parallel(todo, parallel, resume=resume)
        known.update((id(cfg), read_summary(cfg.run_dir)) for cfg in todo)
    return [known[id(cfg)] if id(cfg) in known
            else RunSummary.from_dict(run(cfg, resume=resume)) for cfg in cfgs]


def run_parallel(cfgs: list[ExperimentConfig], workers: int, resume: bool = False
                 ) -> None:
    """Run each config as ``python -m attnlab.cli run`` in its own process, ``workers`` at a
    time; log to ``<run_dir>.log``. On a machine with several GPUs the runs are spread over
    them (CUDA_VISIBLE_DEVICES); CPU threads are shared out (OMP_NUM_THREADS, unless set).
    Raises ConfigError naming the logs of the runs that failed.
    """



    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    threads = str(max(1, (os.cpu_count() or 1) // workers))

    def one(item: tuple[int, ExperimentConfig]) -> tuple[Path, int]:
        i, cfg = item
        cfg.run_dir.parent.mkdir(parents=True, exist_ok=True)
        cfg_file = cfg.run_dir.parent / f".{cfg.name}.yaml"
        cfg_file.write_text(resolved_yaml(cfg))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", threads)
        if gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        log = cfg.run_dir.parent / f"{cfg.name}.log"
        with open(log, "a" if resume else "w") as f:  # a resumed run keeps its log
            cmd = [sys.executable, "-m", "attnlab.cli", "run", str(cfg_file)]
            flag = "--resume" if resume else "--overwrite"  # the comparison owns its folders
            rc = subprocess.call(cmd + [flag], stdout=f,
                                 stderr=subprocess.STDOUT, env=env)
        cfg_file.unlink(missing_ok=True)
        return log, rc

    results = []
    with ThreadPoolExecutor(max_workers=workers) as pool, Progress(transient=True) as bar:
        task = bar.add_task(f"{len(cfgs)} runs, {workers} at a time", total=len(cfgs))
        for fut in as_completed([pool.submit(one, item) for item in enumerate(cfgs)]):
            results.append(fut.result())
            bar.update(task, advance=1)
    failed = sorted(str(log) for log, rc in results if rc != 0)
    if failed:
        raise ConfigError(f"{len(failed)} of {len(cfgs)} runs failed; see {', '.join(failed)}")


def summarise(label: str, summaries: list[RunSummary]) -> dict[str, Any]:
    """One table row from the seeds of one variant."""
    metric = summaries[0].main_metric
    m, s = mean_std([x.best_metric for x in summaries])
    p = summaries[0].params or {}
    kept = p.get("effective_without_head", p["trainable_without_head"])
    return {
        "variant": label,
        "metric": metric,
        "task": summaries[0].task or None,
        "mean": m,
        "std": s,
        "seeds": sum(has_value(x.best_metric) for x in summaries),  # in the mean
        "seeds_run": len(summaries),
        "values": [x.best_metric for x in summaries],
        "trainable_params": p["trainable_total"],
        "trainable_without_head": p["trainable_without_head"],
        "percent_of_backbone": p["percent_of_backbone"],
        # Diff-Prune trains every entry but keeps 0.5%: what differs from the pretrained
        # model at the end (= trainable_without_head for every other tuner)
        "effective_without_head": kept,
        "percent_effective": p["percent_of_backbone"] if kept == p["trainable_without_head"]
        else p["percent_of_backbone"] * kept / max(p["trainable_without_head"], 1),
        "sec_per_step": statistics.fmean(x.seconds_per_step or 0.0 for x in summaries),
        "peak_rss_mb": max(x.peak_rss_mb or 0.0 for x in summaries),
        "selected": False,  # True for the variant a --best-seeds search picked
        "tied_with": [],  # the selected variant's equals on the grid (it came first)
    }


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """The table: one row per variant; with ``--versus`` (rows carry ``delta``/``p_welch``,
    ``versus.add_versus``) two more columns, the gap to the reference and Welch's p."""

    vs = rows[0].get("versus") if rows else None
    extra = f" Δ vs {vs} | p (Welch) |" if vs else ""
    lines = ["| variant | metric | mean ± std | per seed | seeds | trained params (% backbone) "
             "| s/step | peak RSS MB |" + extra, "|---|---|---|---|---|---|---|---|"
             + ("---|---|" if vs else "")]
    for r in rows:
        per_seed = ", ".join(f"{v:.4f}" if has_value(v) else "-" for v in r.get("values") or [])
        seeds = r["seeds"] if r.get("seeds_run", r["seeds"]) == r["seeds"] else (
            f"{r['seeds']} of {r['seeds_run']}")  # seeds without a metric are not in the mean
        lines.append(
            f"| {r['variant']}{_selected_note(r)} | {r['metric']} | "
            f"{mean_std_text(r)} | {per_seed} | "
            f"{seeds} | {params_text(r)} | "
            f"{r['sec_per_step']:.3f} | {r['peak_rss_mb']:.0f} |"
            + (versus_cells(r) if vs else "")
        )
    return "\n".join(lines) + "\n"


def params_text(row: dict[str, Any]) -> str:
    """``73,728 (0.325%)``; Diff-Prune adds what it kept: ``22,713,216 (100.000%); kept
    113,567 (0.500%)``."""
    text = f"{row['trainable_without_head']:,} ({row['percent_of_backbone']:.3f}%)"
    kept = row.get("effective_without_head", row["trainable_without_head"])
    if kept != row["trainable_without_head"]:
        text += f"; kept {kept:,} ({row['percent_effective']:.3f}%)"
    return text


def _selected_note(row: dict[str, Any]) -> str:
    if not row.get("selected"):
        return ""
    tied = row.get("tied_with") or []
    return f" (selected; tied with {', '.join(tied)}: first in grid order)" if tied else \
        " (selected)"


def mean_std_text(row: dict[str, Any]) -> str:
    """``0.3171 ± 0.0422``; one seed has no spread, so just its value."""
    if row["seeds"] > 1:
        return f"{row['mean']:.4f} ± {row['std']:.4f}"
    return f"{row['mean']:.4f}"


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    keys = [k for k in rows[0] if k not in ("values", "tied_with")] + ["tied_with", "values"]
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    for r in rows:
        w.writerow({**r, "values": yaml.safe_dump(r["values"], default_flow_style=True).strip(),
                    "tied_with": ";".join(r.get("tied_with", []))})
    return buf.getvalue()


def bar_plot(rows: list[dict[str, Any]], model: str | None = None):
    """Mean ± std of the main metric per variant, with each seed's value as a dot and the
    seed count beside the label (a single seed gets no error bar): a matplotlib figure.

    Drawn by ``figures.seed_plot`` as points, not bars, so the metric axis follows the data
    instead of starting at zero; it names the task (the rows' ``task``), the ``model``
    and the metric's unit."""
    from .figures import seed_plot  # heavy: matplotlib, imported on use

    return seed_plot(rows, model=model)


def best_variant(rows: list[dict[str, Any]], greater_is_better: bool
                 ) -> tuple[int, list[str]]:
    """The index of the row with the best mean (NaN never wins) and the variants that tie
    with it; a tie goes to the first in grid order, and the table says so."""
    sign = 1.0 if greater_is_better else -1.0
    score = [float("-inf") if math.isnan(r["mean"]) else sign * r["mean"] for r in rows]
    pick = max(range(len(rows)), key=score.__getitem__)
    tied = [r["variant"] for i, r in enumerate(rows) if i != pick and score[i] == score[pick]]
    return pick, tied


def run_compare(base: ExperimentConfig, vary: list[tuple[str, list[str]]], seeds: int,
                run: Callable[[ExperimentConfig], dict[str, Any]], resume: bool = False,
                parallel: int = 1, best_seeds: int | None = None, versus: str | None = None
                ) -> tuple[list[dict[str, Any]], Path]:
    """Run every variant x seed (skipping finished runs when ``resume``); write the table.

    ``parallel > 1`` runs that many ``attnlab run`` subprocesses at a time instead of calling
    ``run`` (see ``run_parallel``); the runs and the table are the same.
    ``best_seeds = N`` (> ``seeds``): a search. After the grid, the variant with the best mean
    dev metric (the task's direction) gets seeds ``seeds..N-1`` too; its row is marked
    ``selected``. E.g. a rho or lr grid on seed 0, then 3 seeds at the chosen point.
    ``versus = LABEL``: every row also gets its gap to that variant and Welch's p
    (``versus.add_versus``); the label is checked before anything runs.
    """

    variants = expand(base, vary, seeds)
    if versus is not None:  # fail now, not after hours of training
        check_reference([label for label, _ in variants], versus)
    done = iter(_run_configs([c for _, cfgs in variants for c in cfgs], run, resume, parallel))
    per_variant = [[next(done) for _ in cfgs] for _, cfgs in variants]
    rows = [summarise(label, sums) for (label, _), sums in zip(variants, per_variant,
                                                               strict=True)]
    if best_seeds is not None and best_seeds > seeds:
        gib = per_variant[0][0].greater_is_better
        pick, tied = best_variant(rows, True if gib is None else gib)
        label, cfgs = variants[pick]
        extra = [replace(cfgs[0], seed=s, name=f"seed-{s}") for s in range(seeds, best_seeds)]
        sums = per_variant[pick] + _run_configs(extra, run, resume, parallel)
        rows[pick] = {**summarise(label, sums), "selected": True, "tied_with": tied}
    if versus is not None:
        rows = add_versus(rows, versus)
    out = Path(base.output_dir) / base.name
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("comparison.md", to_markdown(rows)), ("comparison.csv", to_csv(rows))):
        atomic_write(out / name, text)
    write_json(out / "comparison.json", rows)
    varied = {key for key, _ in vary}
    fig = bar_plot(rows, model=None if "model.name" in varied else base.model.name)
    fig.savefig(out / "comparison.png", dpi=120)
    return rows, out
