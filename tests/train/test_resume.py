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
    a = load_file(tmp / "full" / "tuned.safetensors")
    b = load_file(tmp / "cut" / "tuned.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
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
    ckpts = list((run / "checkpoints").iterdir())
    assert len(ckpts) == 1 and not any(p.name.startswith(".") for p in ckpts)


def test_resumed_metrics_log_has_no_duplicates(runs):
    tmp, _, _, _ = runs
    lines = [json.loads(x) for x in (tmp / "cut" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
