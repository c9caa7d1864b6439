"""compare --resume / run --resume: interrupted runs continue from their checkpoint, and a
run is never continued or reused under a config it was not run with."""

import json

import pytest
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.config import ConfigError, load_config
from attnlab.recipes.finetune import run_experiment

runner = CliRunner()
TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "train.batch_size=4", "train.max_steps=4", "train.eval_every=2",
        "task.train_limit=16", "task.eval_limit=8", "train.keep_best=false", "optim.lr=1e-3"]


def _compare(tmp_path, name, *extra):
    return runner.invoke(app, ["compare", f"name={name}", f"output_dir={tmp_path}", *TINY,
                               "--vary", "plan=baseline", "--seeds", "1", *extra])


def _cut(tmp_path, name, stop_after=2, extra=()):
    """seed 0 of compare's `baseline` variant, killed after ``stop_after`` steps."""
    cfg = load_config(None, [*TINY, *extra, "name=seed-0",
                             f"output_dir={tmp_path / name / 'baseline'}"])
    return run_experiment(cfg, stop_after=stop_after)


@pytest.mark.parametrize("parallel", [1, 2])
def test_compare_resume_continues_an_interrupted_run(tmp_path, parallel):
    assert _compare(tmp_path, "whole").exit_code == 0
    assert _cut(tmp_path, "cut")["interrupted"]
    res = _compare(tmp_path, "cut", "--resume", "--parallel", str(parallel))
    assert res.exit_code == 0, res.output
    run = tmp_path / "cut" / "baseline" / "seed-0"
    log = (run.parent / "seed-0.log").read_text() if parallel > 1 else res.output
    assert "resumed from" in log and "(step 2/4)" in log
    whole = json.loads((tmp_path / "whole" / "baseline" / "seed-0" / "summary.json").read_text())
    cut = json.loads((run / "summary.json").read_text())
    assert cut["steps"] == whole["steps"] == 4
    assert cut["final_eval"] == pytest.approx(whole["final_eval"], abs=1e-6)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # the replayed steps are not logged twice


def test_resume_refuses_checkpoints_of_another_config(tmp_path):
    _cut(tmp_path, "cut")
    cfg = load_config(None, [*TINY, "optim.lr=2e-3", "name=seed-0",
                             f"output_dir={tmp_path / 'cut' / 'baseline'}"])
    with pytest.raises(ConfigError, match=r"cannot resume .*optim\.lr: 0\.001 -> 0\.002"):
        run_experiment(cfg, resume=True)
    res = _compare(tmp_path, "cut", "optim.lr=2e-3", "--resume")
    assert res.exit_code != 0
    assert "optim.lr: 0.001 -> 0.002" in " ".join(res.output.split())
    # without --resume the old behaviour stands: the run starts over under the new config
    assert _compare(tmp_path, "cut", "optim.lr=2e-3").exit_code == 0


def test_compare_resume_does_not_reuse_a_run_finished_under_another_config(tmp_path):
    assert _compare(tmp_path, "done").exit_code == 0
    res = _compare(tmp_path, "done", "train.max_steps=6", "--resume")
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "finished under another config" in text
    assert "train.max_steps: 4 -> 6" in text
    # a run's name and folder are not settings: moving a finished run keeps it reusable
    (tmp_path / "moved").mkdir()
    (tmp_path / "done").rename(tmp_path / "moved" / "done")
    res = runner.invoke(app, ["compare", "name=done", f"output_dir={tmp_path / 'moved'}",
                              *TINY, "--vary", "plan=baseline", "--seeds", "1", "--resume"])
    assert res.exit_code == 0 and "resumed from" not in res.output


def _run(tmp_path, *extra):
    return runner.invoke(app, ["run", *TINY, "name=r", f"output_dir={tmp_path}", *extra])


def test_run_resume_of_a_finished_run_reports_it_and_trains_nothing(tmp_path):
    assert _run(tmp_path).exit_code == 0
    summary = (tmp_path / "r" / "summary.json").read_bytes()
    weights = (tmp_path / "r" / "tuned.safetensors").read_bytes()
    res = _run(tmp_path, "--resume")
    assert res.exit_code == 0, res.output
    assert "has finished: nothing to resume" in res.output and "best dev metrics" in res.output
    assert (tmp_path / "r" / "summary.json").read_bytes() == summary
    assert (tmp_path / "r" / "tuned.safetensors").read_bytes() == weights


def test_run_resume_refuses_a_finished_run_of_another_config_and_keeps_it(tmp_path):
    assert _run(tmp_path).exit_code == 0
    files = {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir() if p.is_file()}
    res = _run(tmp_path, "train.batch_size=8", "--resume")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "finished under another config" in text
    assert "train.batch_size: 4 -> 8" in text and "--overwrite" in text
    assert {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir() if p.is_file()} == files


def test_a_refused_resume_leaves_the_interrupted_run_as_it_was(tmp_path):
    _cut(tmp_path, "cut")
    run = tmp_path / "cut" / "baseline" / "seed-0"
    before = (run / "summary.json").read_bytes()
    cfg = load_config(None, [*TINY, "optim.lr=2e-3", "name=seed-0",
                             f"output_dir={tmp_path / 'cut' / 'baseline'}"])
    with pytest.raises(ConfigError, match="cannot resume"):
        run_experiment(cfg, resume=True)
    assert (run / "summary.json").read_bytes() == before  # not rewritten as "failed"
