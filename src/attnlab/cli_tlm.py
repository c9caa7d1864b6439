"""``attnlab tlm``: TLM's retrieval and its two training stages (wired in by ``attnlab.cli``).

TLM: Yao et al., "NLP From Scratch Without Large-Scale Pretraining: A Simple and Efficient
Framework", ICML 2022. The pipeline is documented in ``recipes.tlm``, the config in
``recipes.tlm_config``::

    attnlab tlm retrieve configs/tlm_cola.yaml              # index + top-K (cached), once
    attnlab tlm train configs/tlm_cola.yaml seed=1 external=random   # stage 1, then stage 2
    attnlab tlm train configs/tlm_cola.yaml --stage1-only   # stage 1 only; then:
    attnlab tlm finetune runs/tlm-cola/bm25/seed-0          # stage 2 of a finished stage 1

``train`` runs both stages by default, so one command gives one (task, condition, seed)
result (``summary.json``, tabulated by ``attnlab collect runs/tlm-cola``). ``--resume``
continues a run that stopped (mid stage 1 exactly, from its last checkpoint). The recipes,
torch and transformers are imported inside the commands, so ``attnlab --help`` stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .cli_errors import user_errors

tlm_app = typer.Typer(
    help="TLM: BM25 retrieval + joint MLM/task training from scratch, then fine-tuning.",
    no_args_is_help=True, pretty_exceptions_show_locals=False)
console = Console()

Overrides = Annotated[list[str] | None, typer.Argument(
    help="Config overrides key.sub=value (YAML values), e.g. seed=1 external=random "
         "stage1.rho1=3.")]
Resume = Annotated[bool, typer.Option(
    help="Continue the run from where it stopped (stage 1's last checkpoint, or stage 2).")]


@contextmanager
def _errors() -> Iterator[None]:
    """Errors of use (bad config, data, missing corpus, empty retrieval, a bad index): one
    line and exit status 2 (``attnlab --debug``: the traceback), as ``attnlab run``."""
    from .tlm.retrieve import EmptyRetrievalError

    with user_errors(EmptyRetrievalError):
        yield


def _config(config: str, overrides: list[str] | None):
    from .recipes.tlm_config import load_tlm_config

    return load_tlm_config(config, overrides or [])


@tlm_app.command("retrieve")
def retrieve(
    config: Annotated[str, typer.Argument(help="TLM YAML config (configs/tlm_*.yaml).")],
    overrides: Overrides = None,
) -> None:
    """Build (or load) the BM25 index and retrieve the config's external set (cached for train).

    bm25: the union of the top-K passages of every training example; random: as many passages
    drawn at random (seeded). external=none has nothing to retrieve."""
    import time

    from .recipes.tlm_config import external_file
    from .tasks import get_task

    with _errors():
        cfg = _config(config, overrides)
        if cfg.external == "none":
            console.print("external=none trains on the task data only: nothing to retrieve")
            return
        t0 = time.perf_counter()
        task = get_task(cfg.task.name)
        from .recipes.evaluation import subset

        t = cfg.task
        examples = subset(task.load(t.train_split or task.train_split, t.data_dir),
                          t.train_fraction, t.train_limit, cfg.seed)
        source = external_file(cfg, examples, progress=True)
    k = f", K = {source['k']}" if source.get("k") else ""
    console.print(f"{cfg.external}: {source['passages']:,} passages for {len(examples):,} "
                  f"{task.name} examples{k} ({time.perf_counter() - t0:.1f} s)", markup=False)
    console.print(f"external set: {source['file']}", markup=False, soft_wrap=True)


@tlm_app.command("train")
def train(
    config: Annotated[str, typer.Argument(help="TLM YAML config (configs/tlm_*.yaml).")],
    overrides: Overrides = None,
    resume: Resume = False,
    overwrite: Annotated[bool, typer.Option(
        help="Empty an existing run folder of the same name first (default: write "
             "<name>-2, ...).")] = False,
    stage1_only: Annotated[bool, typer.Option(
        help="Stop after stage 1 (then `attnlab tlm finetune RUN`).")] = False,
    keep_checkpoints: Annotated[bool, typer.Option(
        help="Keep the checkpoints of finished stages (default: deleted).")] = False,
) -> None:
    """Stage 1 (joint MLM + task from scratch), then stage 2 (fine-tuning): runs/<name>/.

    --stage1-only stops after stage 1 (then `attnlab tlm finetune RUN`). The result, stage 2's
    best dev metric, goes to summary.json (attnlab collect reads it)."""
    from dataclasses import replace

    from .recipes.rundir import fresh_run
    from .recipes.tlm import run_tlm

    with _errors():
        cfg = _config(config, overrides)
        if keep_checkpoints:
            cfg = replace(cfg, keep_checkpoints=True)
        # fresh_run needs only .name, .run_dir and dataclasses.replace (typed for
        # ExperimentConfig): it picks a new folder name, or empties one (--overwrite)
        fresh, note = fresh_run(cast(Any, cfg), resume=resume, overwrite=overwrite)
        cfg = cast(Any, fresh)
        if note:
            console.print(note, markup=False)
        result = run_tlm(cfg, cfg.run_dir, resume=resume,
                         stages=(1,) if stage1_only else (1, 2))
    _report(cfg.run_dir, result)


@tlm_app.command("finetune")
def finetune(
    run_dir: Annotated[Path, typer.Argument(help="A TLM run folder whose stage 1 finished.")],
    overrides: Annotated[list[str] | None, typer.Argument(
        help="stage2.* / eval.* overrides, e.g. stage2.lr=1e-3 (stage 1 is fixed).")] = None,
    resume: Resume = False,
) -> None:
    """Stage 2 of a run: its stage-1 model, task head re-initialised, fine-tuned on the task.

    Settings: the run's config.yaml, with stage2.* / eval.* overrides (saved back to it);
    a new stage 2 replaces the folder's earlier one. --resume continues a stopped stage 2."""
    from .config import ConfigError
    from .recipes.tlm import run_tlm
    from .recipes.tlm_config import STAGE2_KEYS, load_tlm_config

    with _errors():
        if run_dir.is_file():
            raise NotADirectoryError(f"{run_dir} is a file; give the TLM run folder (the one "
                                     "holding config.yaml and stage1/)")
        if not (run_dir / "config.yaml").is_file():
            raise FileNotFoundError(f"{run_dir / 'config.yaml'} not found: is {run_dir} a TLM "
                                    "run folder (attnlab tlm train)?")
        bad = [o for o in overrides or [] if o.split(".", 1)[0] not in STAGE2_KEYS]
        if bad:
            raise ConfigError(f"finetune overrides {bad[0]!r}: only stage2.* and eval.* may "
                              "change (stage 1 is the run's); train a new run for the rest")
        cfg = load_tlm_config(run_dir / "config.yaml", overrides)
        result = run_tlm(cfg, run_dir, resume=resume, stages=(2,))
    _report(run_dir, result)


def _report(run_dir: Path, result: dict) -> None:
    if result.get("status") == "stage1":
        s1 = result["stage1"]
        console.print(f"stage 1 done: {s1['steps']} steps ({s1['task_steps']} task, "
                      f"{s1['external_steps']} external), {s1['seconds_per_step']:.3f} s/step; "
                      f"dev {json.dumps(s1['final_eval'])}", markup=False, soft_wrap=True)
        console.print(f"next: attnlab tlm finetune {run_dir}", markup=False, soft_wrap=True)
        return
    if result.get("status") != "finished":
        console.print(f"stopped ({result.get('status')}); continue with --resume")
        return
    table = Table(title=f"{result['name']}: {result['task']} ({result['tuning']})")
    for col in ("metric", "best (stage 2)", "at step", "steps (both stages)", "s/step"):
        table.add_column(col)
    table.add_row(result["main_metric"], f"{result['best_metric']:.4f}",
                  str(result["best_step"]), str(result["steps"]),
                  f"{result['seconds_per_step']:.3f}")
    console.print(table)
    console.print(f"best dev metrics: {json.dumps(result['best_eval'])}", markup=False)
    if result.get("degenerate"):
        console.print(Text.assemble(("warning:", "bold yellow"),
                                    f" stage 2: {result['degenerate']}"), soft_wrap=True)
    console.print(f"run directory: {run_dir}", markup=False, soft_wrap=True)
