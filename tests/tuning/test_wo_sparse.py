"""wo_sparse: the W_O penalty against a hand computation, its gradient reaches W_O only; the
heads' subspace overlap (attnlab.analysis.overlap) on known subspaces; saving; the runner."""

from __future__ import annotations

import math

import pytest
import torch
from tuning_helpers import bert_pair_batch, make_bert

import attnlab
from attnlab.analysis.overlap import (
    head_bases,
    layer_overlap,
    model_overlap,
    pairwise_overlap,
    subspace_overlap,
)
from attnlab.tuning import TaskInfo, resolve_tuning
from attnlab.tuning.wo_sparse import wo_penalty

# W_O [D=3, h*dv=4] with h=2 heads of dv=2 columns each.
W = torch.tensor([[1.0, -2.0, 3.0, 0.0],
                  [0.0, 0.0, -1.0, 2.0],
                  [2.0, 2.0, 0.0, 0.0]])


def test_penalty_equals_a_hand_computation():
    l1 = 13.0  # sum of |entries|
    # groups (row r, head i): [1,-2] [3,0] / [0,0] [-1,2] / [2,2] [0,0]
    group = math.sqrt(5) + 3 + 0 + math.sqrt(5) + math.sqrt(8) + 0
    got = wo_penalty([W, 2 * W], num_heads=2, l1=0.5, group=2.0)
    assert got.item() == pytest.approx(0.5 * (l1 + 2 * l1) + 2.0 * (group + 2 * group), rel=1e-6)


def test_tuner_penalty_sums_every_layer_by_hand():
    tuner, cfg = resolve_tuning("wo_sparse(l1=0.01, group=0.1)")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair"))
    expected = 0.0
    for layer in model.bert.encoder.layer:
        w = layer.attention.output.dense.weight.detach().double()  # [16, 2 * 8]
        expected += 0.01 * w.abs().sum().item()
        for r in range(w.shape[0]):
            for i in range(2):
                expected += 0.1 * w[r, i * 8:(i + 1) * 8].norm().item()
    assert tuner.aux_loss(model).item() == pytest.approx(expected, rel=1e-6)


def test_penalty_gradient_reaches_only_the_w_o_weights():
    """d/dW = l1 sign(W) + group W[r, head] / ||W[r, head]|| on W_O; None everywhere else."""
    tuner, cfg = resolve_tuning("wo_sparse(l1=0.01, group=0.1)")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair"))
    tuner.aux_loss(model).backward()
    for name, p in model.named_parameters():
        if name.endswith("attention.output.dense.weight"):
            w = p.detach()
            groups = w.view(w.shape[0], 2, -1)
            expected = 0.01 * w.sign() + 0.1 * (groups / groups.norm(dim=-1, keepdim=True)
                                                ).view_as(w)
            torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7)
        else:
            assert p.grad is None, name


def test_all_weights_train_and_zero_weights_add_nothing():
    tuner, cfg = resolve_tuning("wo_sparse(l1=0.0, group=0.0)")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair"))
    assert tuner.aux_loss(model) is None
    assert all(p.requires_grad for p in model.parameters())


# ----------------------------------------------------------------------------- overlap


def test_identical_subspaces_overlap_one_and_orthogonal_zero():
    e = torch.eye(6, dtype=torch.float64)
    same = torch.cat([e[:, :2], e[:, :2] @ torch.tensor([[2.0, 1.0], [0.5, -3.0]],
                                                         dtype=torch.float64)], dim=1)
    assert pairwise_overlap(same, 2)[0, 1].item() == pytest.approx(1.0, abs=1e-12)
    orth = torch.cat([e[:, :2], e[:, 2:4]], dim=1)
    assert pairwise_overlap(orth, 2)[0, 1].item() == pytest.approx(0.0, abs=1e-12)


def test_overlap_is_the_mean_squared_cosine_of_the_principal_angles():
    """span{e1, e2} against span{e1, cos t e2 + sin t e3}: angles 0 and t."""
    t = 0.7
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0], [0.0, math.cos(t)], [0.0, math.sin(t)]], dtype=torch.float64)
    assert subspace_overlap(a, b) == pytest.approx((1 + math.cos(t) ** 2) / 2, abs=1e-12)
    # a line inside a plane: the one principal angle is 0
    line = torch.tensor([[0.6], [0.8], [0.0]], dtype=torch.float64)
    assert subspace_overlap(a, line) == pytest.approx(1.0, abs=1e-12)


def test_overlap_is_invariant_to_a_change_of_basis_within_each_head():
    gen = torch.Generator().manual_seed(0)
    h, dv, d = 4, 3, 10
    w = torch.randn(d, h * dv, generator=gen, dtype=torch.float64)
    changed = torch.cat([w[:, i * dv:(i + 1) * dv]
                         @ (torch.randn(dv, dv, generator=gen, dtype=torch.float64)
                            + 3 * torch.eye(dv, dtype=torch.float64))
                         for i in range(h)], dim=1)
    before, after = pairwise_overlap(w, h), pairwise_overlap(changed, h)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-10)
    assert not torch.allclose(changed, w)
    off = before[~torch.eye(h, dtype=torch.bool)]
    assert ((off > 0) & (off < 1)).all()  # random subspaces: strictly between the extremes
    assert layer_overlap(w, h) == pytest.approx(off.mean().item(), abs=1e-12)


def test_a_zero_head_shares_nothing_and_rank_is_numerical():
    w = torch.cat([torch.eye(4)[:, :2], torch.zeros(4, 2)], dim=1)
    assert [b.shape[1] for b in head_bases(w, 2)] == [2, 0]
    assert pairwise_overlap(w, 2)[0, 1].item() == 0.0


def test_model_overlap_reports_every_layer():
    report = model_overlap(make_bert())
    assert len(report["per_layer"]) == 2
    assert all(0.0 <= v <= 1.0 for v in report["per_layer"])
    assert report["chance"] == pytest.approx(8 / 16)


# ----------------------------------------------------------------------------- saving, runner


def test_wo_sparse_model_saves_and_reloads_through_save_pretrained(tmp_path):
    tuner, cfg = resolve_tuning("wo_sparse(l1=0.01, group=0.01)")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair")).train()
    opt = torch.optim.AdamW([p for _, p in tuner.trainable_parameters(model)], lr=1e-2)
    batch = bert_pair_batch()
    loss = model(**batch, labels=torch.tensor([0, 1, 2])).loss + tuner.aux_loss(model)
    loss.backward()
    opt.step()
    model.eval()
    untrained = make_bert().eval()
    attnlab.save_pretrained(model, tmp_path / "m")
    assert not (tmp_path / "m" / "rebuild.json").exists()  # nothing added to rebuild
    loaded = attnlab.load_pretrained(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)
        assert not torch.equal(untrained(**batch).logits, model(**batch).logits)


def test_runner_stores_the_overlap_before_and_after(tmp_path, capsys):
    from attnlab.config import load_config
    from attnlab.recipes.finetune import run_experiment

    cfg = load_config(None, ["task.data_dir=builtin", "model.name=scratch:tiny",
                             "model.max_length=16", "train.batch_size=8", "train.max_steps=2",
                             "task.train_limit=16", "task.eval_limit=8", "optim.lr=1e-2",
                             "name=wo", f"output_dir={tmp_path}",
                             "tuning.method=wo_sparse(l1=0.001, group=0.001)"])
    summary = run_experiment(cfg)
    overlap = summary["head_overlap"]
    layers = len(overlap["before"]["per_layer"])
    assert layers > 0 and len(overlap["after"]["per_layer"]) == layers
    assert overlap["before"]["per_layer"] != overlap["after"]["per_layer"]  # W_O trained
    assert "W_O subspace overlap" in capsys.readouterr().out
