"""``attnlab bench lra``: a Long Range Arena of our own, resumable.

Modelled on LRA (Tay et al., "Long Range Arena: A Benchmark for Efficient Transformers",
ICLR 2021): one small encoder, the same for every mechanism, trained from scratch on
long-sequence tasks, with accuracy per task (LRA's Table 1) next to training speed and peak
memory relative to the vanilla Transformer at the same length (LRA's Table 2, Figure 3).

For each mechanism the bench runs two kinds of cell:

- a *speed* cell: one training step of the encoder on a ``batch_size x length`` batch, timed
  and its peak memory measured in fresh subprocesses (``lra_cell.measure_isolated_step``);
- a *train* cell per (task, seed): ``steps`` optimizer steps on the task's data at the
  length (``lra_data``), then accuracy on its evaluation split (``lra_cell``).

``softmax`` (attnlab's softmax mechanism through surgery: ``F.scaled_dot_product_attention``)
always runs first: it is the baseline of the ratios. ``baseline`` names another (e.g.
``softmax(fused=False)``, the vanilla Transformer's attention that stores its [n, n]
probabilities, the baseline of LRA's and MEGA's cost columns); it runs first instead.
Mechanisms: names or full specs. A bare name takes the long-input setting of ``bench
speed`` (``bench.suite.bench_spec``, e.g. ``band`` -> ``band(window=128)``), else the
mechanism's defaults; a spec is used as given (``band(window=256)``, ``mega(chunk=128)``).
With no list, every registered mechanism that surgery accepts in a from-scratch encoder of
that length; the others are skipped with the reason.

Every finished cell is appended to ``rows.jsonl`` at once and never run again: a cell is
identified by its kind, mechanism, task, seed and length plus the settings that change its
result (steps, batch size, evaluation size, learning rate, device; for speed cells the
repeats and threads); rows of other settings stay in the file but are not reused. Each
row names the commit it was measured on; ``lra.md`` says so when its cells come from more
than one. A cell that fails is recorded with its error and does not stop the others
(delete its line to retry it). The data of every task still to train is made before any
cell runs, so a data error (no SST-2 under ``data_dir``) stops the run with nothing
written. At the end:
``lra.json`` (settings, environment, the summary and every row), ``lra.md`` (the table) and
``lra.png`` (accuracy against speed, memory as marker size; none when no mechanism has the
two).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core import list_mechanisms, resolve_config
from ..io import append_jsonl, atomic_write, read_jsonl, write_json
from .lra_cell import ENCODER, build_model, measure_isolated_step, train_and_evaluate
from .lra_data import DATA_SEED, TASK_TITLES, BenchData, bench_data, check_task
from .speed import code_commit, commits_note, environment
from .suite import bench_spec

BASELINE = "softmax"
DEFAULT_OUT = "runs/bench-lra"


@dataclass(frozen=True, kw_only=True)
class LraSettings:
    """The settings every cell of one bench run shares."""

    length: int = 2048  # sequence length L: the encoder's positions, the measured batch
    steps: int = 50  # optimizer steps per train cell
    batch_size: int = 4  # examples per step (training and the speed measurement)
    eval_size: int = 128  # evaluation examples per task
    lr: float = 1e-3  # AdamW peak learning rate (warmup 10%, linear decay)
    repeats: int = 3  # timed steps per speed cell (median)
    device: str = "cpu"  # "cpu" or "cuda"
    threads: int | None = None  # torch threads of the speed subprocesses (None: torch's)
    data_dir: str = "../shared/data"  # data root holding glue/SST-2 (task text)

    def check(self) -> None:
        """ValueError naming the first setting out of range."""
        for flag, value in (("--steps", self.steps), ("--batch-size", self.batch_size),
                            ("--eval-size", self.eval_size), ("--repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"{flag} {value}: give 1 or more")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads {self.threads}: give 1 or more")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr {self.lr:g}: give a learning rate above 0, e.g. --lr 1e-3")
        if self.length < 16:
            raise ValueError(f"--length {self.length} is too short; give 16 or more")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: use cpu or cuda")


# ----------------------------------------------------------------------------- mechanisms


def requested(name: str) -> str:
    """The spec the bench runs for a name or spec, as written: a bare name takes
    ``bench_spec`` (``band`` -> ``band(window=128)``), a spec stays as given."""
    name = name.strip()
    return name if "(" in name else bench_spec(name)


def canonical(name: str) -> str:
    """``requested(name)`` in ``core``'s full spelling (every field), so that equal settings
    resume each other. Unknown names raise RegistryError naming close matches."""
    return resolve_config(requested(name)).spec()


def refusal(spec: str, length: int) -> str | None:
    """Why surgery refuses ``spec`` in the bench encoder at ``length`` (None: accepted)."""
    try:
        build_model(spec, "sequence-classification", 2, 8, length, seed=0)
    except (ValueError, TypeError, RuntimeError) as e:  # PlanError is a ValueError
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def resolve_mechanisms(names: Sequence[str] | None, length: int, baseline: str = BASELINE
                       ) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(canonical spec -> label, the baseline first; skipped ``{"mechanism", "reason"}``).
    Given names that surgery refuses are an error; of the default list they are skipped."""
    skipped: list[dict[str, str]] = []
    chosen: dict[str, str] = {}
    for name in names or list_mechanisms():
        spec = canonical(name)
        if spec in chosen:
            continue
        why = refusal(spec, length)
        if why is not None and names:
            raise ValueError(f"mechanism {requested(name)!r} cannot run in the bench encoder "
                             f"at length {length}: {why}")
        if why is None:
            chosen[spec] = requested(name)
        else:
            skipped.append({"mechanism": requested(name), "reason": why})
    base = canonical(baseline)
    why = None if base in chosen else refusal(base, length)
    if why is not None:
        raise ValueError(f"baseline {requested(baseline)!r} cannot run in the bench encoder "
                         f"at length {length}: {why}")
    return {base: requested(baseline), **{k: v for k, v in chosen.items() if k != base}}, skipped


# ----------------------------------------------------------------------------- cells


# What identifies a cell: its kind and these fields (settings that change its result).
CELL_FIELDS = {
    "speed": ("mechanism", "length", "batch_size", "repeats", "device", "threads"),
    "train": ("mechanism", "task", "seed", "length", "steps", "batch_size", "eval_size", "lr",
              "device"),
}


def _row_key(row: dict[str, Any]) -> tuple:
    return (row["kind"], *(row.get(f) for f in CELL_FIELDS[row["kind"]]))


def _identity(job: tuple, s: LraSettings) -> dict[str, Any]:
    """The identifying fields of a job's row."""
    kind, spec, task, seed = job
    if kind == "speed":
        return {"kind": kind, "mechanism": spec, "length": s.length, "batch_size": s.batch_size,
                "repeats": s.repeats, "device": s.device, "threads": s.threads}
    return {"kind": kind, "mechanism": spec, "task": task, "seed": seed, "length": s.length,
            "steps": s.steps, "batch_size": s.batch_size, "eval_size": s.eval_size,
            "lr": s.lr, "device": s.device}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``rows.jsonl`` (a line cut by an interruption is skipped: run again)."""
    return [r for r in read_jsonl(path) if r.get("kind") in ("speed", "train")]


def _error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def run_lra(
    out: str | Path,
    mechanisms: Sequence[str] | None = None,
    tasks: Sequence[str] = ("listops",),
    seeds: Sequence[int] = (0,),
    settings: LraSettings = LraSettings(),
    *,
    progress: bool = True,
    notify: Callable[[str], None] | None = None,
    measure: Callable[..., dict[str, Any]] = measure_isolated_step,
    speed_only: bool = False,
    baseline: str = BASELINE,
) -> dict[str, Any]:
    """Run the missing cells, write ``rows.jsonl``, ``lra.json``, ``lra.md``, ``lra.png``
    into ``out``; return the results (``lra.json``'s content). ``notify`` gets one line per
    skipped mechanism; ``measure`` is the speed measurement (tests pass a stand-in).
    ``speed_only``: the speed cells alone (LRA Table 2's steps/s and peak memory, at lengths
    where training every mechanism is out of reach); ``tasks`` and ``seeds`` are not used,
    and ``lra.png`` plots memory against speed. ``baseline``: the mechanism of the ratios
    (run first)."""
    settings.check()
    tasks = [] if speed_only else list(dict.fromkeys(tasks))
    for t in tasks:
        check_task(t)
    if not speed_only and (not tasks or not seeds):
        raise ValueError("give at least one task and one seed")
    labels, skipped = resolve_mechanisms(mechanisms, settings.length, baseline)
    base_spec = next(iter(labels))
    for s in skipped:
        (notify or (lambda line: None))(f"skipped {s['mechanism']}: {s['reason']}")
    out = Path(out)
    log = out / "rows.jsonl"
    done = {_row_key(r): r for r in read_rows(log)}
    jobs: list[tuple] = []
    for spec in labels:
        jobs.append(("speed", spec, None, None))
        jobs += [("train", spec, task, seed) for task in tasks for seed in seeds]
    key = {j: _row_key(_identity(j, settings)) for j in jobs}
    todo = [j for j in jobs if key[j] not in done]
    # the data of every task still to train, before anything is measured or written: data
    # errors (e.g. no SST-2 under data_dir) are the user's, and leave nothing on disk
    data: dict[str, BenchData] = {
        task: bench_data(task, settings.length, settings.steps * settings.batch_size,
                         settings.eval_size, settings.data_dir)
        for task in dict.fromkeys(j[2] for j in todo if j[0] == "train")}
    out.mkdir(parents=True, exist_ok=True)

    def run_cell(job: tuple, step: Callable[[], None]) -> dict[str, Any]:
        kind, spec, task, seed = job
        s, base = settings, _identity(job, settings)
        if kind == "speed":
            try:
                return {**base, **measure(spec, s.length, s.batch_size, repeats=s.repeats,
                                          device=s.device, threads=s.threads)}
            except RuntimeError as e:  # a failing mechanism does not stop the table
                return {**base, "error": _error(e)}
        d = data[task]
        try:
            model = build_model(spec, d.task.head, d.task.num_labels, len(d.tokenizer),
                                s.length, seed, s.device)
            res = train_and_evaluate(model, d, steps=s.steps, batch_size=s.batch_size,
                                     lr=s.lr, seed=seed, device=s.device, on_step=step)
        except (RuntimeError, ValueError) as e:
            return {**base, "error": _error(e)}
        return {**base, **res, "data": d.about}

    commit = code_commit() if todo else None  # in each row: a resumed run may mix commits

    def run_all(cell_done: Callable[[str], None], step: Callable[[], None],
                start: Callable[[tuple], None]) -> None:
        for job in todo:
            start(job)
            row = {**run_cell(job, step), "commit": commit}
            append_jsonl(log, row)
            done[key[job]] = row
            cell_done(_describe(job, labels))

    if progress and todo:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=True) as bar:
            cells = bar.add_task("bench lra: cells", total=len(todo))
            steps = bar.add_task("", total=settings.steps, visible=False)

            def start(job: tuple) -> None:
                bar.reset(steps, total=settings.steps, description=_describe(job, labels),
                          visible=job[0] == "train")

            run_all(lambda label: bar.advance(cells), lambda: bar.advance(steps), start)
    else:
        run_all(lambda label: None, lambda: None, lambda job: None)

    rows = [done[key[j]] for j in jobs]
    results = {
        "settings": asdict(settings), "speed_only": speed_only, "tasks": tasks,
        "seeds": [] if speed_only else list(seeds),
        "mechanisms": labels, "skipped": skipped, "baseline": base_spec,
        "encoder": ENCODER, "data_seed": DATA_SEED,
        "data": {r["task"]: r["data"] for r in rows if "data" in r},
        "environment": environment(settings.threads),
        "table": summarise(rows, labels, tasks, base_spec), "rows": rows,
    }
    write_json(out / "lra.json", results)
    atomic_write(out / "lra.md", format_table(results))
    if (cost_plot if speed_only else scatter_plot)(results, out / "lra.png") is None:
        # nothing to plot (e.g. every cell failed): no lra.png of an earlier run stays
        # beside this run's lra.json and lra.md as if it were this run's
        (out / "lra.png").unlink(missing_ok=True)
    return results


def _describe(job: tuple, labels: Mapping[str, str]) -> str:
    kind, spec, task, seed = job
    name = labels.get(spec, spec)
    return f"speed {name}" if kind == "speed" else f"{task} seed {seed} {name}"


# ----------------------------------------------------------------------------- summary


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def summarise(rows: list[dict[str, Any]], labels: Mapping[str, str], tasks: Sequence[str],
              baseline: str) -> list[dict[str, Any]]:
    """One entry per mechanism: accuracy per task (mean, std over seeds, n), the average
    over tasks (when every task has one), the speed cell and its ratios to the baseline
    (``baseline``: its canonical spec)."""
    speed = {r["mechanism"]: r for r in rows if r["kind"] == "speed"}
    base = speed.get(baseline, {})
    table = []
    for spec, label in labels.items():
        entry: dict[str, Any] = {"mechanism": spec, "label": label, "accuracy": {}}
        for task in tasks:
            mine = [r for r in rows if r["kind"] == "train" and r["mechanism"] == spec
                    and r["task"] == task]
            ok = [r["accuracy"] for r in mine if "error" not in r]
            cell: dict[str, Any] = {"n": len(ok), "errors": [r["error"] for r in mine
                                                            if "error" in r]}
            if ok:
                cell["mean"], cell["std"] = _mean_std(ok)
            entry["accuracy"][task] = cell
        means = [c["mean"] for c in entry["accuracy"].values() if "mean" in c]
        entry["average"] = sum(means) / len(means) if means and len(means) == len(tasks) else None
        sp = speed.get(spec, {})
        if "error" in sp:
            entry["speed_error"] = sp["error"]
        for field in ("steps_per_s", "step_ms", "peak_mem_mb", "kernels"):
            if field in sp:
                entry[field] = sp[field]
        if "steps_per_s" in sp and "steps_per_s" in base:
            entry["speed_ratio"] = sp["steps_per_s"] / base["steps_per_s"]
        if "peak_mem_mb" in sp and "peak_mem_mb" in base:
            entry["memory_ratio"] = sp["peak_mem_mb"] / max(base["peak_mem_mb"], 1e-9)
        table.append(entry)
    return table


def _acc(cell: dict[str, Any]) -> str:
    if "mean" not in cell:
        return "error" if cell["errors"] else "-"
    text = f"{100 * cell['mean']:.2f}"
    return text + (f" ± {100 * cell['std']:.2f}" if cell["n"] > 1 else "")


def baseline_label(results: dict[str, Any]) -> str:
    """The baseline as the run named it (``softmax``, ``softmax(fused=False)``)."""
    return results["mechanisms"].get(results["baseline"], results["baseline"])


def format_table(results: dict[str, Any]) -> str:
    """``lra.md``: LRA's Table 1 layout (accuracy % per task, average) with the speed and
    memory columns of its Table 2, then how it was run."""
    s, tasks = results["settings"], results["tasks"]
    speed_only = results.get("speed_only", False)
    name = baseline_label(results)
    acc_cols = [TASK_TITLES[t] for t in tasks] + ([] if speed_only else ["Avg"])
    what = ("speed and memory only" if speed_only else
            f"{s['steps']} steps, batch {s['batch_size']}, {len(results['seeds'])} seed(s)")
    lines = [
        f"# bench lra: length {s['length']}, {what}, {s['device']}\n\n",
        "| mechanism | " + "".join(f"{c} | " for c in acc_cols) + f"steps/s | speed vs {name} "
        f"| peak MB | memory vs {name} |\n",
        "|---|" + "---:|" * (len(acc_cols) + 4) + "\n",
    ]
    for e in results["table"]:
        avg = "-" if e["average"] is None else f"{100 * e['average']:.2f}"
        sps = f"{e['steps_per_s']:.3g}" if "steps_per_s" in e else (
            "error" if "speed_error" in e else "-")
        mem = f"{e['peak_mem_mb']:.0f}" if "peak_mem_mb" in e else sps if sps == "error" else "-"
        ratio = f"{e['speed_ratio']:.2f}x" if "speed_ratio" in e else "-"
        mratio = f"{e['memory_ratio']:.2f}x" if "memory_ratio" in e else "-"
        accs = [_acc(e["accuracy"][t]) for t in tasks] + ([] if speed_only else [avg])
        lines.append(f"| `{e['label']}` | " + "".join(f"{a} | " for a in accs)
                     + f"{sps} | {ratio} | {mem} | {mratio} |\n")
    base: dict[str, Any] = next(
        (e for e in results["table"] if e["mechanism"] == results["baseline"]), {})
    kernels = ", ".join(base.get("kernels", [])) or "none seen by the profiler"
    enc = results["encoder"]
    lr_note = "" if speed_only else f" lr {s['lr']:g}."
    accuracy = "" if speed_only else (
        f"Accuracy (%) on {s['eval_size']} evaluation examples per task after {s['steps']} "
        f"training steps of batch {s['batch_size']} (mean ± std over seeds "
        f"{', '.join(map(str, results['seeds']))}); Avg: over the tasks. ")
    lines.append(
        f"\n{accuracy}steps/s and peak MB: "
        f"one training step (forward, backward, AdamW) on {s['batch_size']} x {s['length']} "
        f"tokens in a fresh subprocess (median of {s['repeats']}); ratios against "
        f"`{name}` (fused attention kernels it ran: {kernels}).\n\n"
        f"Encoder: from-scratch BERT, {enc['num_hidden_layers']} layers, hidden "
        f"{enc['hidden_size']}, {enc['num_attention_heads']} heads, feed-forward "
        f"{enc['intermediate_size']}, {s['length']} positions, attention dropout 0, the "
        f"mechanism in every head.{lr_note} Environment: "
        f"{_env_line(results['environment'])}.\n")
    if results["data"]:
        lines.append("\nData: " + "; ".join(f"{TASK_TITLES[t]}: {a}"
                                           for t, a in results["data"].items()) + ".\n")
    mixed = commits_note(results.get("rows", []))
    if mixed:
        lines.append("\n" + mixed)
    notes = [f"- `{e['label']}` speed cell: {e['speed_error']}\n"
             for e in results["table"] if "speed_error" in e]
    notes += [f"- `{e['label']}` {TASK_TITLES[t]}: {err}\n" for e in results["table"]
              for t, c in e["accuracy"].items() for err in c["errors"]]
    notes += [f"- skipped `{k['mechanism']}`: {k['reason']}\n" for k in results["skipped"]]
    if notes:
        lines.append("\n" + "".join(notes))
    return "".join(lines)


def _env_line(env: dict[str, Any]) -> str:
    where = env.get("gpu") or f"{env.get('cpu')} CPU, {env.get('threads')} thread(s)"
    return f"{where}, torch {env.get('torch')}, {env.get('date')}"


def scatter_plot(results: dict[str, Any], path: str | Path) -> Path | None:
    """``lra.png`` as LRA's Figure 3: average accuracy (y) against training speed relative
    to softmax (x), marker area proportional to peak memory. None when no mechanism has
    both an average and a speed."""
    pts = [e for e in results["table"] if e["average"] is not None and "speed_ratio" in e
           and "peak_mem_mb" in e]
    if not pts:
        return None
    # heavy: matplotlib, imported on use
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import env_title, write_png

    s = results["settings"]
    biggest = max(e["peak_mem_mb"] for e in pts) or 1.0
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for e in pts:
        size = 60 + 1500 * max(e["peak_mem_mb"], 0.0) / biggest
        ax.scatter(e["speed_ratio"], 100 * e["average"], s=size, alpha=0.45,
                   label=f"{e['label']} ({e['peak_mem_mb']:.0f} MB)")
    legend = ax.legend(fontsize=8, title="mechanism (peak memory)", title_fontsize=8)
    for handle in legend.legend_handles:  # one marker size in the legend, not the memory
        handle.set_sizes([40])  # type: ignore[union-attr]  # scatter handles
    ax.set_xlabel(f"training steps/s relative to {baseline_label(results)} "
                  f"(batch {s['batch_size']} x {s['length']} tokens)")
    ax.set_ylabel("accuracy averaged over " + ", ".join(TASK_TITLES[t] for t in
                                                       results["tasks"]) + " (%)")
    ax.set_title(f"bench lra: accuracy vs speed, marker area = peak memory "
                 f"({s['steps']} steps)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.margins(0.2)
    fig.suptitle(env_title(results["environment"]), fontsize=9)
    fig.tight_layout()
    return write_png(fig, path)


def cost_plot(results: dict[str, Any], path: str | Path) -> Path | None:
    """``lra.png`` of a speed-only run: each mechanism's peak memory (y) against its training
    steps/s (x), both relative to softmax, log-log, one labelled point each; softmax sits
    at (1, 1), and the lower right is faster and lighter. None when no mechanism has both
    ratios."""
    pts = [e for e in results["table"] if "speed_ratio" in e and "memory_ratio" in e]
    if not pts:
        return None
    # heavy: matplotlib, imported on use
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import env_title, place_labels, write_png

    s = results["settings"]
    fig, ax = plt.subplots(figsize=(9, 7))
    for e in pts:
        ax.scatter(e["speed_ratio"], e["memory_ratio"], s=25, alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"training steps/s relative to {baseline_label(results)} "
                  f"(batch {s['batch_size']} x {s['length']} tokens)")
    ax.set_ylabel(f"peak memory relative to {baseline_label(results)}")
    ax.set_title(f"bench lra at length {s['length']}: memory vs speed (lower right: faster "
                 "and lighter)", fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    fig.suptitle(env_title(results["environment"]), fontsize=9)
    fig.tight_layout()
    place_labels(ax, [e["speed_ratio"] for e in pts], [e["memory_ratio"] for e in pts],
                 [e["label"] for e in pts])  # no label over another label or point
    return write_png(fig, path)
