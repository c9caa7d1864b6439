"""The runner gives task-conditioned mechanisms (camtl_prior) the run's ``task.task_id``, in
training and when a finished run is rebuilt, and refuses plans that leave one without an id
before anything is written."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.hf import set_task_id
from attnlab.hf.backend import forward_state
from attnlab.recipes.finetune import evaluate_run
from attnlab.recipes.runmodel import load_run_model

runner = CliRunner()
TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "task.train_limit=16", "task.eval_limit=8", "train.batch_size=8", "train.max_steps=2"]
CAMTL = "plan=all:all:camtl_prior(tasks=3, blocks=4, task_dim=8)"


def _run(tmp_path, *extra: str):
    return runner.invoke(app, ["run", *TINY, "name=r", f"output_dir={tmp_path}", *extra])


def test_the_run_and_its_reload_condition_on_the_configured_task(tmp_path):
    res = _run(tmp_path, CAMTL, "task.task_id=2")
    assert res.exit_code == 0, res.output
    run = tmp_path / "r"
    model, tok, cfg = load_run_model(run)
    state = forward_state(model)
    assert cfg.task.task_id == 2 and state is not None and int(state.task_ids) == 2
    batch = tok(["a short sentence", "another one"], return_tensors="pt", padding=True)
    with torch.no_grad():
        as_run = model(**batch).logits
        set_task_id(model, 0)  # another task's prior gives other outputs
        other = model(**batch).logits
    assert not torch.equal(as_run, other)
    summary = json.loads((run / "summary.json").read_text())
    metric = summary["main_metric"]
    assert evaluate_run(run)[metric] == summary["final_eval"][metric]


def test_plans_without_a_task_id_are_refused_before_anything_is_written(tmp_path):
    cases = {
        (CAMTL,): "needs a task id: set task.task_id (0..2)",
        (CAMTL, "task.task_id=3"): "task.task_id=3 is not a task of",
        ("plan=all:all:band(window=2)", "task.task_id=0"): "no mechanism of the plan is "
                                                           "task-conditioned",
        ("task.task_id=0",): "no mechanism of the plan is task-conditioned",
    }
    for extra, message in cases.items():
        res = _run(tmp_path, *extra)
        assert res.exit_code != 0 and message in res.output, (extra, res.output)
        assert "Traceback" not in res.output
    assert not (tmp_path / "r").exists()


def test_a_fixed_task_in_the_spec_needs_no_run_task_id(tmp_path):
    res = _run(tmp_path, "plan=all:all:camtl_prior(tasks=3, blocks=4, task_dim=8, task=1)")
    assert res.exit_code == 0, res.output
