"""The runner finalizes Diff-Prune: the saved model is the pruned one, its metric is the
run's result, and `attnlab eval` on the saved weights reproduces it."""

import pytest

from attnlab.config import load_config
from attnlab.recipes.finetune import evaluate_run, run_experiment

BASE = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=24",
        "train.batch_size=8", "train.max_steps=4", "train.eval_every=2",
        "task.train_limit=48", "task.eval_limit=32", "optim.lr=1e-3"]


def test_diff_prune_run_is_finalized_and_reevaluated(tmp_path):
    cfg = load_config(None, BASE + ["name=dp", f"output_dir={tmp_path}",
                                    "tuning.method=diff_prune(target_sparsity=0.01)"])
    summary = run_experiment(cfg)
    assert summary["before_finalize"] is not None
    assert summary["best_metric"] == summary["best_eval"][summary["main_metric"]]
    params = summary["params"]
    # after finalize the effective count is the kept 1% of the backbone entries
    kept = params["effective_without_head"]
    assert kept == pytest.approx(0.01 * params["backbone_total"], rel=0.01, abs=2)
    again = evaluate_run(tmp_path / "dp")
    assert again == pytest.approx(summary["best_eval"], abs=1e-6)


def test_other_tuners_are_not_reevaluated(tmp_path):
    cfg = load_config(None, BASE + ["name=bf", f"output_dir={tmp_path}",
                                    "tuning.method=bitfit"])
    summary = run_experiment(cfg)
    assert summary["before_finalize"] is None
