"""Saving writes only the tuned weights (atomically); loading reproduces the outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from tuning_helpers import bert_pair_batch, make_bert

from attnlab.tuning import TaskInfo, list_tuners, load_tuned_file, resolve_tuning, save_tuned


def _train_a_bit(tuner, model, steps=2):
    model.train()
    opt = torch.optim.AdamW([p for _, p in tuner.trainable_parameters(model)], lr=1e-2)
    batch = {**bert_pair_batch(), "labels": torch.tensor([0, 1, 2])}
    for _ in range(steps):
        aux = tuner.aux_loss(model)
        loss = model(**batch).loss + (aux if aux is not None else 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("name", sorted(list_tuners()))
def test_round_trip_saves_only_tuned_weights(name, tmp_path):
    pretrained = make_bert()
    tuner, cfg = resolve_tuning(name)
    task = TaskInfo(kind="pair")
    trained = _train_a_bit(tuner, tuner.apply(copy.deepcopy(pretrained), cfg, task=task))
    path = save_tuned(trained, tuner, tmp_path / "sub" / "tuned.safetensors")
    assert [p.name for p in path.parent.iterdir()] == ["tuned.safetensors"]  # no temp left

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata()["attnlab_tuner"] == name
    assert keys == set(tuner.state_dict_to_save(trained))
    saved = sum(t.numel() for t in tuner.state_dict_to_save(trained).values())
    trainable = sum(p.numel() for _, p in tuner.trainable_parameters(trained))
    assert saved == trainable  # nothing frozen is written
    # diff_prune is sparse only after finalize (below); wo_sparse and mae train everything
    if name not in ("full", "diff_prune", "wo_sparse", "mae"):
        assert saved < sum(p.numel() for p in pretrained.parameters()) / 2

    fresh = tuner.apply(copy.deepcopy(pretrained), cfg, task=task).eval()
    batch = bert_pair_batch()
    with torch.no_grad():
        expected = trained(**batch).logits
        assert not torch.equal(fresh(**batch).logits, expected)
        load_tuned_file(fresh, tuner, path)
        assert torch.equal(fresh(**batch).logits, expected)


def test_diff_prune_finalize_keeps_target_share_and_saves_sparse(tmp_path):
    pretrained = make_bert()
    tuner, cfg = resolve_tuning("diff_prune(target_sparsity=0.01)")
    trained = _train_a_bit(tuner, tuner.apply(copy.deepcopy(pretrained), cfg))
    backbone = sum(p.numel() for p in pretrained.bert.parameters())
    tuner.finalize(trained)
    kept = tuner.effective_without_head(trained)
    assert kept == -(-backbone // 100)  # ceil(1% of the backbone)
    assert tuner.aux_loss(trained) is None
    # After finalize the weights differ from theta_0 only at kept entries.
    diffs = sum(int((m.weight != m.parametrizations.weight.original).sum())
                for m in trained.modules() if hasattr(m, "parametrizations")
                and "weight" in m.parametrizations)
    assert 0 < diffs <= kept
    state = tuner.state_dict_to_save(trained)
    assert not any(k.endswith((".w", ".log_alpha")) for k in state)
    assert sum(v.numel() for k, v in state.items() if k.endswith(".values")) == kept
    path = save_tuned(trained, tuner, tmp_path / "d.safetensors")
    fresh = tuner.apply(copy.deepcopy(pretrained), cfg).eval()
    load_tuned_file(fresh, tuner, path)
    batch = bert_pair_batch()
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, trained(**batch).logits)
    assert tuner.effective_without_head(fresh) == kept


def test_loading_into_a_different_tuner_is_refused(tmp_path):
    tuner, cfg = resolve_tuning("bitfit")
    path = save_tuned(tuner.apply(make_bert(), cfg), tuner, tmp_path / "b.safetensors")
    other, ocfg = resolve_tuning("pasta")
    with pytest.raises(ValueError, match="tuner 'bitfit', not 'pasta'"):
        load_tuned_file(other.apply(make_bert(), ocfg, task=TaskInfo(kind="pair")), other, path)


def test_mismatched_state_names_the_keys():
    tuner, cfg = resolve_tuning("adapter")
    model = tuner.apply(make_bert(), cfg)
    state = tuner.state_dict_to_save(model)
    state.pop(next(iter(state)))
    with pytest.raises(KeyError, match="missing"):
        tuner.load_tuned(model, state)
