"""Training loop: an interrupted run resumed from its checkpoint ends where an uninterrupted
run ends (same seed, CPU): final weights equal to 1e-6."""

import json

import pytest
import torch
from safetensors.torch import load_file

from attnlab.config import load_config
from attnlab.recipes.finetune import run_experiment

BASE = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=24",
        "train.batch_size=8", "train.max_steps=6", "train.eval_every=2", "train.log_every=1",
        "task.train_limit=64", "task.eval_limit=16", "train.keep_best=false",
        "train.grad_accum=2", "optim.lr=1e-3"]


def _run(tmp_path, name, resume=False, stop_after=None):
    cfg = load_config(None, BASE + [f"name={name}", f"output_dir={tmp_path}"])
    return run_experiment(cfg, resume=resume, stop_after=stop_after)


def assert_same_weights(folder, min_keys: int = 1) -> None:
    """The tuned weights of runs ``full`` and ``cut`` (resumed) in ``folder`` to 1e-6."""
    a = load_file(folder / "full" / "tuned.safetensors")
    b = load_file(folder / "cut" / "tuned.safetensors")
    assert a.keys() == b.keys() and len(a) >= min_keys
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    full = _run(tmp, "full")
    part = _run(tmp, "cut", stop_after=3)
    resumed = _run(tmp, "cut", resume=True)
    return tmp, full, part, resumed


def test_resume_reproduces_uninterrupted_run(runs):
    tmp, full, part, resumed = runs
    assert part["interrupted"] and part["steps"] == 3
    assert resumed["steps"] == full["steps"] == 6
    assert_same_weights(tmp, min_keys=11)
    assert resumed["final_eval"] == pytest.approx(full["final_eval"], abs=1e-6)


def test_run_dir_contents(runs):
    tmp, full, _, _ = runs
    run = tmp / "full"
    for name in ("config.yaml", "plan.json", "metrics.jsonl", "summary.json"):
        assert (run / name).is_file(), name
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in lines if "eval" in r] == [2, 4, 6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["params"]["trainable_total"] > 0 and summary["seconds_per_step"] > 0
    assert not (run / "checkpoints").exists()  # a finished run keeps its result only


def test_resumed_metrics_log_has_no_duplicates(runs):
    tmp, _, _, _ = runs
    lines = [json.loads(x) for x in (tmp / "cut" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_fresh_start_removes_an_older_runs_checkpoints(tmp_path):
    """A run started again without --resume in the same folder: a later --resume must
    continue this run, not the older run's (higher-numbered) checkpoint."""
    _run(tmp_path, "again", stop_after=5)  # an older run, cut at step 5
    _run(tmp_path, "again", stop_after=2)  # started over, cut at step 2
    ckpts = sorted(p.name for p in (tmp_path / "again" / "checkpoints").iterdir())
    assert ckpts == ["step-00000002"]
    resumed = _run(tmp_path, "again", resume=True)
    lines = [json.loads(x) for x in (tmp_path / "again" / "metrics.jsonl").read_text()
             .splitlines()]
    assert resumed["steps"] == 6 and [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4,
                                                                                  5, 6]


def test_resume_survives_a_half_written_metrics_line(tmp_path, runs):
    """A kill while appending to metrics.jsonl leaves a cut line: resume drops it."""
    _, full, _, _ = runs
    _run(tmp_path, "cutline", stop_after=3)
    log = tmp_path / "cutline" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 4, "lo')
    resumed = _run(tmp_path, "cutline", resume=True)
    assert resumed["final_eval"] == pytest.approx(full["final_eval"], abs=1e-6)


def test_an_early_stopped_run_stays_stopped_on_resume(tmp_path):
    """Resuming a run whose last checkpoint already met the patience trains no further."""
    extra = ["train.early_stopping_patience=1", "train.eval_every=1", "train.save_every=1",
             "optim.lr=0.0", "train.max_steps=12"]  # lr 0: no eval can improve on the first
    cfg = load_config(None, BASE + extra + ["name=es", f"output_dir={tmp_path}"])
    done = run_experiment(cfg)
    assert done["steps"] == 2
    (tmp_path / "es" / "summary.json").unlink()  # as if killed before the summary
    again = run_experiment(cfg, resume=True)
    assert again["steps"] == 2


def test_accumulation_tail_is_the_mean_of_its_micro_batches(tmp_path):
    """grad_accum=2 over an epoch of 3 micro-batches: the last step's single micro-batch
    counts whole (not halved), so batch 4 x 2 equals batch 8 to float rounding."""
    common = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
              "task.train_limit=20", "task.eval_limit=8", "train.max_steps=3",
              "train.keep_best=false", "optim.lr=1e-3", "model.dropout=0.0",
              "optim.max_grad_norm=null", "optim.warmup_ratio=0.0", f"output_dir={tmp_path}"]
    run_experiment(load_config(None, common + ["name=acc", "train.batch_size=4",
                                               "train.grad_accum=2"]))
    run_experiment(load_config(None, common + ["name=big", "train.batch_size=8"]))
    a = load_file(tmp_path / "acc" / "tuned.safetensors")
    b = load_file(tmp_path / "big" / "tuned.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_mlm_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Masked LM: the masks of a resumed run are those of the uninterrupted one (they are
    seeded per batch, not by a collator stream the checkpoint does not hold)."""
    mlm = BASE + ["task.name=mlm", "train.save_every=1", f"output_dir={tmp_path}"]
    full = run_experiment(load_config(None, mlm + ["name=full"]))
    run_experiment(load_config(None, mlm + ["name=cut"]), stop_after=3)
    resumed = run_experiment(load_config(None, mlm + ["name=cut"]), resume=True)
    assert_same_weights(tmp_path)
    assert resumed["final_eval"] == pytest.approx(full["final_eval"], abs=1e-6)


def test_resume_refuses_another_chunk_size(tmp_path, monkeypatch):
    """A checkpoint records ATTNLAB_CHUNK_ELEMS (the sparse patterns' dropout masks are
    drawn per chunk); resuming under another value is a one-line error naming the fix."""
    from attnlab.config import ConfigError
    from attnlab.mechanisms import _blocklayout, chunk_elems
    from attnlab.train.checkpoint import STATE_FILE, TrainerState, check_chunking
    from attnlab.train.loop import MetricsLog, start_state

    class _Acc:  # what start_state uses of an Accelerator when nothing is to resume
        is_main_process = True

    log = MetricsLog(tmp_path / "metrics.jsonl", True)
    fresh = start_state(_Acc(), tmp_path, log, False, 10)
    assert fresh.chunk_elems == chunk_elems()
    ckpt = tmp_path / "step-00000001"
    ckpt.mkdir()
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 1, "chunk_elems": 4096}))
    monkeypatch.setattr(_blocklayout, "CHUNK_ELEMS", 8192)
    with pytest.raises(ConfigError, match=r"ATTNLAB_CHUNK_ELEMS=4096, this process has 8192: "
                                          r"set ATTNLAB_CHUNK_ELEMS=4096"):
        check_chunking(TrainerState(step=1, chunk_elems=4096), ckpt)
    check_chunking(TrainerState(step=1, chunk_elems=8192), ckpt)  # same value: fine
    check_chunking(TrainerState(step=1), ckpt)  # older checkpoints without the field: fine


@pytest.mark.parametrize("spec", ["performer(num_features=8)", "probsparse(factor=1)",
                                  "clustered(clusters=2, bits=4, iterations=2)",
                                  "jat(variant='probsparse')"])
def test_training_draws_resume_where_they_stood(tmp_path, spec):
    """Mechanisms that draw afresh at every training forward (performer's features,
    probsparse's samples, the clustered hashes, JAT's probsparse variant) draw through the
    global RNG (``core.masks.training_generator``), which the checkpoint restores, so the
    resumed run draws what the uninterrupted one draws (with generators of their own,
    restarted on resume: performer 2.5e-3, probsparse 2.1e-3 from the uninterrupted
    weights)."""
    base = [x for x in BASE if not x.startswith("train.grad_accum")] + [f"plan=all:all:{spec}"]

    def run(name, **kw):
        cfg = load_config(None, base + [f"name={name}", f"output_dir={tmp_path}"])
        return run_experiment(cfg, **kw)

    run("full")
    assert run("cut", stop_after=3)["interrupted"]
    run("cut", resume=True)
    assert_same_weights(tmp_path)


@pytest.mark.parametrize("tuning", ["full", "diff_prune(mask_epochs=0)"])
def test_weights_tied_across_layers_resume(tmp_path, tuning, caplog):
    """A plan that shares one weight across layers (luna's P): the checkpoint stores it
    once (safetensors), the resumed run ties it again and ends where the uninterrupted run
    ends, also under Diff-Prune (one diff on the shared weight); Accelerate's notice that it
    removed the shared names is not shown."""
    base = [x for x in BASE if not x.startswith("train.grad_accum")] + [
        "plan=all:all:luna(num_memory=2)", f"tuning.method={tuning}", "train.save_every=1"]

    def run(name, **kw):
        cfg = load_config(None, base + [f"name={name}", f"output_dir={tmp_path}"])
        return run_experiment(cfg, **kw)

    with caplog.at_level("WARNING"):
        full = run("full")
        assert run("cut", stop_after=3)["interrupted"]
        resumed = run("cut", resume=True)
    assert not [r for r in caplog.records if "Removed shared tensor" in r.getMessage()]
    assert_same_weights(tmp_path)
    assert resumed["final_eval"] == pytest.approx(full["final_eval"], abs=1e-6)
