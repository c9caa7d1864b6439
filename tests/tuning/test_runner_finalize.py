"""The runner finalizes Diff-Prune: the saved model is the pruned one, its metric is the
run's result, and `attnlab eval` on the saved weights reproduces it."""

import json

import pytest
import torch

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


def _dp(tmp_path, name, mask_epochs, resume=False, stop_after=None):
    cfg = load_config(None, BASE + [f"name={name}", f"output_dir={tmp_path}",
                                    f"tuning.method=diff_prune(target_sparsity=0.01, "
                                    f"mask_epochs={mask_epochs})"])
    return run_experiment(cfg, resume=resume, stop_after=stop_after)


def test_masked_epochs_train_only_the_kept_entries_and_resume(tmp_path):
    """Stage 2 (mask fixed): same mask as pruning alone, the kept values move, the result is
    stage 2's best; cut inside stage 2 and resumed, it ends where an uncut run ends."""
    from safetensors.torch import load_file

    pruned = _dp(tmp_path, "p0", 0)
    full = _dp(tmp_path, "p1", 1)
    assert pruned["masked_steps"] is None and full["masked_steps"] == 6  # 48 examples / 8
    assert full["steps"] == 4 + 6
    assert full["pruned_eval"] == pytest.approx(pruned["best_eval"], abs=1e-6)
    a, b = load_file(tmp_path / "p0" / "tuned.safetensors"), load_file(
        tmp_path / "p1" / "tuned.safetensors")
    assert a.keys() == b.keys()
    idx = [k for k in a if k.endswith(".indices")]
    assert idx and all(torch.equal(a[k], b[k]) for k in idx)  # the mask is stage 1's
    moved = sum(not torch.equal(a[k[:-8] + ".values"], b[k[:-8] + ".values"]) for k in idx)
    assert moved > len(idx) // 2  # the kept entries trained
    evals = [json.loads(x) for x in (tmp_path / "p1" / "masked" / "metrics.jsonl")
             .read_text().splitlines() if "eval" in x]
    main = full["main_metric"]
    assert full["best_metric"] == pytest.approx(max(e["eval"][main] for e in evals))
    assert evaluate_run(tmp_path / "p1") == pytest.approx(full["best_eval"], abs=1e-6)

    cut = _dp(tmp_path, "cut", 1, stop_after=4 + 3)
    assert cut["interrupted"] and cut["masked_steps"] == 3
    resumed = _dp(tmp_path, "cut", 1, resume=True)
    assert not resumed["interrupted"] and resumed["steps"] == full["steps"]
    c = load_file(tmp_path / "cut" / "tuned.safetensors")
    for k in b:
        torch.testing.assert_close(c[k], b[k], atol=1e-6, rtol=0)
    assert resumed["best_eval"] == pytest.approx(full["best_eval"], abs=1e-6)


def test_mask_epochs_must_not_be_negative(tmp_path):
    with pytest.raises(Exception, match="mask_epochs"):
        _dp(tmp_path, "neg", -1)


def test_masked_epochs_use_mask_lr(tmp_path):
    """diff_prune(mask_lr=...) sets the fixed-mask epochs' peak lr (official: 5e-5 after
    1e-5); without it they use optim.lr."""
    def first_masked_lr(name, spec):
        cfg = load_config(None, BASE + [f"name={name}", f"output_dir={tmp_path}",
                                        "train.log_every=1", "optim.warmup_ratio=0",
                                        f"tuning.method={spec}"])
        run_experiment(cfg)
        lines = (tmp_path / name / "masked" / "metrics.jsonl").read_text().splitlines()
        first = next(json.loads(x) for x in lines if '"lr"' in x)
        steps = sum(1 for x in lines if '"loss"' in x)  # linear decay, no warmup
        return first["lr"] / (1 - 1 / steps)

    spec = "diff_prune(target_sparsity=0.01, mask_epochs=1, mask_lr=3e-2)"
    assert first_masked_lr("own", spec) == pytest.approx(3e-2)
    assert first_masked_lr("run", spec.replace(", mask_lr=3e-2", "")) == pytest.approx(1e-3)
