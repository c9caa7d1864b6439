"""Run folders: never overwritten (a new one per run, or --overwrite), what summary.json
records (provenance, status, the plan as an object), failed runs, what a finished run keeps,
and the warning for a run that predicts one class. Through the command line, as users run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.config import load_config
from attnlab.recipes.evaluation import degenerate_warning
from attnlab.recipes.finetune import run_experiment

runner = CliRunner()
TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "task.train_limit=16", "task.eval_limit=8", "train.batch_size=8", "train.max_steps=2"]


def _run(tmp_path, *extra: str):
    res = runner.invoke(app, ["run", *TINY, "name=r", f"output_dir={tmp_path}", *extra])
    return res


def test_a_second_run_gets_a_new_folder_and_overwrite_empties_the_old(tmp_path):
    first = _run(tmp_path)
    assert first.exit_code == 0, first.output
    (tmp_path / "r" / "report.html").write_text("stale")  # e.g. an older report
    second = _run(tmp_path)
    assert second.exit_code == 0, second.output
    assert "r-2" in second.output and (tmp_path / "r-2" / "summary.json").is_file()
    assert (tmp_path / "r" / "report.html").read_text() == "stale"  # the first run untouched
    third = _run(tmp_path, "--overwrite")
    assert third.exit_code == 0, third.output
    assert not (tmp_path / "r" / "report.html").exists()  # emptied, then written anew
    assert (tmp_path / "r" / "summary.json").is_file() and not (tmp_path / "r-3").exists()


def test_summary_records_provenance_status_and_the_plan_as_an_object(tmp_path):
    res = _run(tmp_path, "plan=0:all:band(window=2)")
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    for key in ("attnlab_version", "git_commit", "versions", "device", "seed", "started",
                "finished", "wall_seconds", "status"):
        assert key in summary, key
    assert summary["status"] == "finished" and summary["wall_seconds"] > 0
    assert {"python", "torch", "transformers", "peft"} <= set(summary["versions"])
    assert summary["versions"]["torch"] and summary["versions"]["transformers"]
    assert summary["plan"] == [{"layers": [0], "heads": "all",
                                "mechanism": {"name": "band", "window": 2}}]
    plan = json.loads((tmp_path / "r" / "plan.json").read_text())
    assert plan == {"plan": summary["plan"]}  # an object, not a JSON string inside JSON


def test_a_finished_run_keeps_its_result_not_its_checkpoints(tmp_path):
    assert _run(tmp_path).exit_code == 0
    run = tmp_path / "r"
    assert (run / "tuned.safetensors").is_file()
    assert not (run / "checkpoints").exists() and not (run / "best.safetensors").exists()
    kept = runner.invoke(app, ["run", *TINY, "name=k", f"output_dir={tmp_path}",
                               "--keep-checkpoints"])
    assert kept.exit_code == 0, kept.output
    assert any((tmp_path / "k" / "checkpoints").iterdir())
    ev = runner.invoke(app, ["eval", str(run)])  # what is left is enough to evaluate
    assert ev.exit_code == 0, ev.output
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads(ev.output)["mcc"] == pytest.approx(summary["best_eval"]["mcc"], abs=1e-6)


def test_a_failed_run_writes_status_failed_with_the_error(tmp_path, monkeypatch):
    import attnlab.recipes.finetune as ft

    def broken(*args, **kwargs):
        raise RuntimeError("out of cheese")

    monkeypatch.setattr(ft, "fit", broken)
    cfg = load_config(None, [*TINY, "name=f", f"output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="cheese"):
        run_experiment(cfg)
    summary = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert summary["status"] == "failed" and "out of cheese" in summary["error"]
    assert summary["started"] and summary["finished"] and "versions" in summary


def test_ctrl_c_writes_status_interrupted(tmp_path, monkeypatch):
    import attnlab.recipes.finetune as ft

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ft, "fit", stopped)
    cfg = load_config(None, [*TINY, "name=c", f"output_dir={tmp_path}"])
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg)
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["interrupted"] is True


def test_collect_and_compare_leave_failed_runs_out():
    from attnlab.recipes.summary import RunSummary

    def is_finished(data):
        return RunSummary.from_dict(data).is_finished

    assert is_finished({"status": "finished"}) and is_finished({})  # older summaries
    assert not is_finished({"status": "failed"}) and not is_finished({"interrupted": True})


def test_one_class_predictions_end_with_a_loud_warning(tmp_path):
    # lr 0: the random head never moves, and on 8 dev sentences it predicts one class
    res = _run(tmp_path, "optim.lr=0.0", "model.dropout=0.0")
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["best_eval"]["mcc"] == 0.0 and summary["degenerate"]
    assert "WARNING" in res.output and "majority class" in res.output
    assert "optim.lr" in res.output and "train.epochs" in res.output


def test_degenerate_warning_reads_the_kept_evaluation():
    evals = [{"step": 1}, {"step": 2}]
    assert degenerate_warning([True, False], evals, 2, 2, 1e-4) is None
    assert "majority class" in degenerate_warning([False, True], evals, 2, 2, 1e-4)
    assert degenerate_warning([], evals, 2, 2, 1e-4) is None
    # a resumed process saw only the last evaluation
    assert "2 steps" in degenerate_warning([True], evals, 2, 2, 1e-4)


def test_config_paths_resolve_from_the_config_file(tmp_path):
    sub = tmp_path / "cfgs"
    sub.mkdir()
    (tmp_path / "data").mkdir()
    (sub / "c.yaml").write_text(yaml.safe_dump({"task": {"name": "cola",
                                                         "data_dir": "../data"}}))
    cfg = load_config(sub / "c.yaml")
    assert cfg.task.data_dir == str((tmp_path / "data").resolve())
    over = load_config(sub / "c.yaml", ["task.data_dir=rel"])  # overrides: from the cwd
    assert over.task.data_dir == str(Path("rel").resolve())


def test_a_multi_process_run_refuses_an_existing_folder_instead_of_renaming(tmp_path,
                                                                            monkeypatch):
    from attnlab.config import ConfigError
    from attnlab.recipes.rundir import fresh_run

    cfg = load_config(None, [*TINY, "name=d", f"output_dir={tmp_path}"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "summary.json").write_text("{}")
    assert fresh_run(cfg)[0].name == "d-2"  # one process: a new folder
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="--overwrite"):
        fresh_run(cfg)  # every process refuses alike (they could pick different names)
    assert fresh_run(cfg, overwrite=True)[0].name == "d"
    assert (tmp_path / "d").exists()  # only rank 0 deletes
    monkeypatch.setenv("RANK", "0")
    fresh_run(cfg, overwrite=True)
    assert not (tmp_path / "d").exists()
