"""``attnlab tlm``: task-driven language modelling from scratch, top to bottom.

TLM (Yao, Zheng, Yang and Yang, "NLP From Scratch Without Large-Scale Pretraining: A Simple
and Efficient Framework", ICML 2022) trains a random encoder on the task's data and on text
retrieved for it from a general corpus, then fine-tunes it on the task:

1. retrieval (``attnlab.tlm.retrieve``): the corpus is cut into passages and indexed with
   BM25 once (cached in ``retrieval.cache_dir``); each training example's text queries it
   for its K nearest passages (K = ``retrieval.k``, default ``default_k``: 50 for tasks over
   100K examples, 500 for middle, 5000 for small ones); the union is the external set,
   cached as a JSONL file per (task, queries, K);
2. stage 1 (``tlm_train.train_stage1``): ``stage1.steps`` steps; a task batch every
   ``rho1 + 1`` steps (the last of each group), external batches otherwise; loss L_mlm on
   external batches, (rho2 L_mlm + L_task)/(rho2 + 1) on (masked) task batches;
3. stage 2 (``tlm_train.run_stage2``, on ``train.loop.fit``): the task head re-initialised,
   plain fine-tuning with the task loss; the best dev evaluation is the run's result.

Conditions (``external``), for experiments at equal steps:

- ``bm25``: the paper's method;
- ``random``: as many passages as BM25 retrieves (or ``retrieval.random_count``), drawn
  uniformly from the same passage pool with the run's seed: retrieval without relevance;
- ``none``: task data only. Every stage-1 step is a task batch with the same joint loss
  (rho1 = 0): exactly what the official code does with ``--external_ratio 0``. So the
  controls differ from TLM only in where the masked-LM text of the non-task steps comes
  from (retrieved, random, or the task's own), at the same steps, batch, objective and
  stage 2.

One command runs the whole pipeline of one (task, condition, seed) and writes
``<output_dir>/<name>/`` (``name`` default ``tlm-<task>/<external>/seed-<seed>``, so
``attnlab collect runs/tlm-cola`` tabulates the conditions over seeds)::

    config.yaml       the resolved config (paths absolute)
    external.json     the external set used: file, passages, K, condition
    stage1/           metrics.jsonl, checkpoints/ (while running), model.safetensors, state.json
    stage2/           metrics.jsonl, checkpoints/ (while running)
    model.safetensors the reported model (stage 2's best on dev)
    tlm.json          both stages' steps, times, losses and evaluations
    summary.json      RunSummary (recipes.summary): best dev metric of stage 2, cost

``--resume`` continues where a run stopped: inside stage 1 from its last checkpoint
(exactly: same batches, masks, dropout and optimizer state), after stage 1 with stage 2.

Deviations from the official code (github.com/yaoxingcheng/TLM): dynamic padding instead of
``--pad_to_max_length`` (the same losses, less compute); torch's AdamW (eps 1e-8) instead of
transformers' (eps 1e-6); one batch per optimizer step in stage 1 (no gradient
accumulation); stage 1 is evaluated on dev at its end (and every ``stage1.eval_every``) for
the record only, stage 2 starting from the final stage-1 weights as the official
``finetune.sh`` does; CoNLL-2003 puts the task head on every token (the paper has sequence
tasks only); BM25 is ``bm25s`` with Lucene's formula rather than Elasticsearch
(``tlm.retrieve``); masked positions are never chosen on any special token ([UNK] and
[MASK] included) in either stream, where the official collator uses the tokenizer's mask
([CLS]/[SEP]/[PAD] only), so it may choose [UNK].
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..io import atomic_write, write_json
from ..train.memory import reset_peak_rss
from . import tlm_train as tt
from .rundir import now, provenance
from .summary import RunSummary, read_summary, write_summary
from .tlm_config import STAGE2_KEYS, TlmConfig, config_yaml, saved_config_changes, tuning_spec

# ----------------------------------------------------------------------------- the pipeline

_NO_STAGE1 = ("{run_dir} has no finished stage 1 (stage1/model.safetensors): run `attnlab tlm "
              "train` first, or continue it with --resume")


def run_tlm(cfg: TlmConfig, run_dir: Path | None = None, *, resume: bool = False,
            stages: tuple[int, ...] = (1, 2), stop_after: int | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Run (or, ``resume``, continue) the stages of ``cfg`` in ``run_dir`` (default
    ``cfg.run_dir``); returns the summary dict (``summary.json`` once stage 2 is done).

    stages: (1, 2) both; (1,) stage 1 only (then ``attnlab tlm finetune``); (2,) stage 2 of
    a run whose stage 1 finished. stop_after: stop stage 1 right after that step's
    checkpoint, as if killed (tests of ``resume``). A run that raises writes
    ``summary.json`` with status ``failed`` (``interrupted`` for Ctrl-C) and re-raises."""
    run_dir = Path(run_dir) if run_dir is not None else cfg.run_dir
    if resume or stages == (2,):
        # a new stage 2 may change its own settings; continuing anything may not
        free = () if resume else STAGE2_KEYS
        changes = saved_config_changes(run_dir, cfg, ignore=free)
        if changes:
            raise ConfigError(f"cannot continue {run_dir}: it was run under another config ("
                              + "; ".join(changes) + "); give another name or output_dir")
    if resume and stages == (1, 2) and (done := _finished(run_dir)) is not None:
        return done  # nothing left to do
    if stages == (2,) and tt.stage1_result(run_dir) is None:  # refused before any write
        raise ConfigError(_NO_STAGE1.format(run_dir=run_dir))
    started, t0 = now(), time.perf_counter()
    try:
        return _run_tlm(cfg, run_dir, resume, stages, stop_after, progress, started, t0)
    except BaseException as e:
        if run_dir.is_dir():
            write_summary(run_dir, RunSummary(
                name=str(cfg.name), task=cfg.task.name, seed=cfg.seed,
                error=f"{type(e).__name__}: {e}",
                status="interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                tuning=tuning_spec(cfg), **provenance(), started=started, finished=now(),
                wall_seconds=time.perf_counter() - t0))
        raise


def _finished(run_dir: Path) -> dict[str, Any] | None:
    """The summary of a run that finished both stages, else None."""
    if not (run_dir / "summary.json").is_file():
        return None
    summary = read_summary(run_dir)
    return summary.to_dict() if summary.is_finished else None


def _run_tlm(cfg: TlmConfig, run_dir: Path, resume: bool, stages: tuple[int, ...],
             stop_after: int | None, progress: bool, started: str, t0: float
             ) -> dict[str, Any]:
    reset_peak_rss()
    # a finished stage 1 is reused only when continuing; a fresh run trains it again
    stage1 = tt.stage1_result(run_dir) if (resume or stages == (2,)) else None
    # data first: a run that cannot start writes nothing
    data = tt.prepare(cfg, progress, external=1 in stages and stage1 is None)
    if stage1 is not None and (run_dir / "external.json").is_file():  # what stage 1 used
        data.source = json.loads((run_dir / "external.json").read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", config_yaml(cfg))
    if 1 in stages and stage1 is None:
        write_json(run_dir / "external.json", data.source)
        stage1 = tt.run_stage1(cfg, data, run_dir, resume=resume, stop_after=stop_after)
        if stage1 is None:  # stopped by stop_after
            return {"status": "interrupted", "stage": 1}
        if not cfg.keep_checkpoints:
            tt.prune(run_dir / "stage1")
    if 2 not in stages:
        return {"status": "stage1", "stage1": stage1}
    if stage1 is None:
        raise ConfigError(_NO_STAGE1.format(run_dir=run_dir))
    stage2 = tt.run_stage2(cfg, data, run_dir, resume=resume)
    summary = tt.write_results(cfg, data, run_dir, stage1, stage2, started, t0)
    if not cfg.keep_checkpoints:
        tt.prune(run_dir / "stage2")
    return summary
