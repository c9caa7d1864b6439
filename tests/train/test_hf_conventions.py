"""The training loop against Hugging Face Trainer's and PyTorch's conventions: weight-decay
groups, the warmup count, the loss metrics.jsonl logs, resume at an epoch's end after a short
accumulation window, length groups per optimizer step, skipped fp16 updates, step counts."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_model
from transformers import Trainer, get_linear_schedule_with_warmup
from transformers.trainer_pt_utils import get_length_grouped_indices

from attnlab.config import load_config
from attnlab.recipes.finetune import run_experiment
from attnlab.train.loop import (
    LoopParts,
    LoopSettings,
    epoch_batches,
    fit,
    optimizer_step,
    plan_steps,
)
from attnlab.train.optim import OptimSettings, build_optimizer, param_groups, warmup_steps

TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=24",
        "train.batch_size=8", "task.train_limit=40", "task.eval_limit=16",
        "train.keep_best=false", "optim.lr=1e-3"]


def _undecayed(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}


def _hf_undecayed(model):
    decay = set(Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    return {n for n, p in model.named_parameters() if p.requires_grad and n not in decay}


def test_no_decay_on_layernorm_modules_whatever_their_name():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 2))
    got = _undecayed(model, param_groups(model, 0.01))
    assert got == _hf_undecayed(model) == {"0.bias", "1.weight", "1.bias", "2.bias"}


def test_no_decay_groups_match_hf_trainer_on_a_diff_prune_model():
    """Diff-Prune parametrizes LayerNorm weights: their diff vectors stay undecayed."""
    from attnlab.recipes.runmodel import build_model, task_kind
    from attnlab.tasks import get_task
    from attnlab.tuning.base import TaskInfo, resolve_tuning

    cfg = load_config(None, TINY + ["tuning.method=diff_prune"])
    task = get_task(cfg.task.name)
    model, tok = build_model(cfg, task)
    tuner, tcfg = resolve_tuning(cfg.tuning.method)
    model = tuner.apply(model, tcfg, task=TaskInfo.from_tokenizer(tok, task_kind(task)))
    options = tuner.param_options(model)  # log_alpha: own groups at weight decay 0
    got = _undecayed(model, param_groups(model, 0.01, options))
    own = {n for n, p in model.named_parameters() if id(p) in options}
    assert any("LayerNorm.parametrizations.weight" in n for n in got - own)
    assert got - own == _hf_undecayed(model) - own


def _lrs(settings, total):
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = build_optimizer(model, settings, total)
    out = []
    for _ in range(total + 1):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_warmup_counts_whole_steps_without_float_noise():
    assert 0.29 * 100 < 29  # the float product falls just short
    assert warmup_steps(0.29, 100) == 29
    assert warmup_steps(0.1, 804) == 80  # floor (the Trainer's ceil gives 81)
    settings = OptimSettings(lr=1.0, weight_decay=0.0, warmup_ratio=0.29, schedule="linear")
    got = _lrs(settings, 100)
    ref_opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    ref = get_linear_schedule_with_warmup(ref_opt, 29, 100)
    want = []
    for _ in range(101):
        want.append(ref.get_last_lr()[0])
        ref_opt.step()
        ref.step()
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == 0.0 and got[28] < 1.0 and got[29] == 1.0
    assert got[99] == pytest.approx(1 / 71) and got[100] == 0.0


def _records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r]


def test_log_lines_hold_the_window_mean_loss(tmp_path):
    """As Hugging Face's Trainer: "loss" is the mean over the steps since the last line.
    "lr" is the schedule's value after the line's step (the next step's rate; decisions)."""
    base = TINY + ["train.max_steps=6", "optim.warmup_ratio=0.0", f"output_dir={tmp_path}"]
    run_experiment(load_config(None, base + ["name=every", "train.log_every=1"]))
    run_experiment(load_config(None, base + ["name=third", "train.log_every=3"]))
    every, third = _records(tmp_path / "every"), _records(tmp_path / "third")
    assert [r["lr"] for r in every] == pytest.approx([1e-3 * (5 - i) / 6 for i in range(6)])
    assert [r["step"] for r in third] == [3, 6]
    for line, steps in zip(third, (every[:3], every[3:]), strict=True):
        assert line["loss"] == pytest.approx(sum(r["loss"] for r in steps) / 3, rel=1e-9)
        assert line["lr"] == steps[-1]["lr"]


@pytest.mark.parametrize("cut", [3, 5])
def test_resume_at_an_epochs_end_after_a_short_accumulation_window(tmp_path, cut):
    """5 micro-batches an epoch, 2 per step: windows 2, 2, 1. Cut at step 3 (the epoch's
    end, after its 1-micro-batch window) or 5 (mid epoch 1), resumed: the same weights and
    the same metrics.jsonl, whose 4-step loss windows span the cut."""
    base = TINY + ["train.grad_accum=2", "train.max_steps=8", "train.save_every=1",
                   "train.log_every=4", "train.eval_every=3", f"output_dir={tmp_path}"]
    run_experiment(load_config(None, base + ["name=full"]))
    cut_cfg = load_config(None, base + ["name=cut"])
    assert run_experiment(cut_cfg, stop_after=cut)["interrupted"]
    run_experiment(cut_cfg, resume=True)
    a, b = (load_file(tmp_path / n / "tuned.safetensors") for n in ("full", "cut"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    assert ((tmp_path / "full" / "metrics.jsonl").read_text()
            == (tmp_path / "cut" / "metrics.jsonl").read_text())


def test_length_groups_are_cut_per_optimizer_step():
    """With gradient accumulation the Trainer's LengthGroupedSampler groups batch size x
    accumulation examples (megabatches of 50 optimizer steps)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 129, (3000,), generator=g).tolist()
    seed, epoch, bs, accum = 4, 1, 8, 4
    ref = get_length_grouped_indices(
        lengths, bs * accum, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    got = epoch_batches(len(lengths), bs, seed, epoch, 0, 1, lengths, accum)
    assert got == [ref[i:i + bs] for i in range(0, len(ref), bs)]
    assert got != epoch_batches(len(lengths), bs, seed, epoch, 0, 1, lengths)


def test_step_counts_follow_the_trainer():
    """Updates per epoch: ceil(micro-batches / accumulation); epochs may be fractional
    (ceil(epochs x per epoch)); max_steps wins over epochs."""
    features = [{"input_ids": [1] * 5}] * 40  # 5 micro-batches of 8
    settings = LoopSettings(name="t", seed=0, batch_size=8, grad_accum=2, epochs=1.5)
    plan = plan_steps(settings, features)
    assert (plan.steps_per_epoch, plan.total, plan.eval_every) == (3, math.ceil(4.5), 3)
    capped = LoopSettings(name="t", seed=0, batch_size=8, grad_accum=2, epochs=9, max_steps=2)
    assert plan_steps(capped, features).total == 2


def test_a_skipped_fp16_update_leaves_the_schedule():
    model = torch.nn.Linear(2, 2)
    settings = OptimSettings(lr=1.0, weight_decay=0.0, warmup_ratio=0.5, schedule="linear")
    optimizer, scheduler = build_optimizer(model, settings, 4)
    model(torch.ones(1, 2)).sum().backward()
    optimizer_step(SimpleNamespace(optimizer_step_was_skipped=True), optimizer, scheduler,
                    [], None)
    assert scheduler.last_epoch == 0 and scheduler.get_last_lr()[0] == 0.0
    optimizer_step(SimpleNamespace(optimizer_step_was_skipped=False), optimizer, scheduler,
                    [], None)
    assert scheduler.last_epoch == 1 and scheduler.get_last_lr()[0] == 0.5


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        return SimpleNamespace(loss=((self.lin(x).squeeze(-1) - y) ** 2).mean())


def test_a_fresh_run_never_restores_an_older_runs_best_weights(tmp_path):
    """An older run's best.safetensors left in the folder: a fresh run none of whose
    evaluations counts (NaN metric) ends with its own weights, not that file's."""
    from attnlab.train.accel import run_accelerator

    other = _Regression()
    torch.nn.init.constant_(other.lin.weight, 7.0)
    save_model(other, str(tmp_path / "best.safetensors"))
    torch.manual_seed(0)
    model = _Regression()
    start = model.lin.weight.detach().clone()
    features = [{"x": torch.randn(3), "y": torch.tensor(0.0)} for _ in range(16)]
    settings = LoopSettings(name="t", seed=0, batch_size=4, max_steps=2, log_every=1)
    plan = plan_steps(settings, features)
    optimizer, scheduler = build_optimizer(model, OptimSettings(
        lr=0.0, weight_decay=0.0, warmup_ratio=0.0, schedule="constant"), plan.total)
    parts = LoopParts(model=model, optimizer=optimizer, scheduler=scheduler,
                      train_features=features,
                      collate=lambda fs: {k: torch.stack([f[k] for f in fs]) for k in fs[0]},
                      evaluate=lambda m: {"m": float("nan")}, main_metric="m",
                      greater_is_better=True)
    state = fit(parts, settings, plan, run_accelerator("no"), tmp_path)
    assert state.best_step is None
    assert torch.equal(model.lin.weight, start)
