"""Tuners on a model whose attention heads were changed by a plan (attnlab.hf surgery)."""

from __future__ import annotations

import copy

import pytest
import torch
from tuning_helpers import BERT_PAIR_INDEX, bert_pair_batch, make_bert

import attnlab
from attnlab.tuning import TaskInfo, list_tuners, resolve_tuning
from attnlab.tuning.base import encoder_layers
from attnlab.tuning.pasta import pasta_module

surgery = pytest.importorskip("attnlab.hf.surgery")

# Prefer the paper pairing (band / JAT heads + PASTA); fall back to what is registered.
CANDIDATES = ["band(window=2)", "jat", "linear_elu", "talking_heads", "softmax"]


def _plan():
    names = attnlab.list_mechanisms()
    head_scoped = [s for s in CANDIDATES if s.split("(")[0] in names
                   and attnlab.core.mechanism_class(s.split("(")[0]).caps.scope == "head"]
    if len(head_scoped) < 1:
        pytest.skip("no head-scoped mechanism registered")
    first, second = (head_scoped * 2)[:2]
    return [{"layers": "all", "heads": [0], "mechanism": first},
            {"layers": [1], "heads": [1], "mechanism": second}]


def _planned_bert():
    model = make_bert()
    plan = _plan()
    report = surgery.apply_plan(model, plan)
    assert report.table[1][1].startswith(plan[1]["mechanism"].split("(")[0])
    return model.eval()


def test_pasta_on_planned_heads_adds_vectors_exactly():
    planned = _planned_bert()
    tuner, cfg = resolve_tuning("pasta")
    model = tuner.apply(copy.deepcopy(planned), cfg, task=TaskInfo(kind="pair")).eval()
    batch = bert_pair_batch()
    before, after, handles = {}, {}, []
    for i, layer in enumerate(encoder_layers(model)):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, i=i: before.__setitem__(i, a[0].detach().clone()), prepend=True))
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, i=i: after.__setitem__(i, a[0].detach().clone())))
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    idx = BERT_PAIR_INDEX
    for layer, table in enumerate(pasta_module(model).vectors):
        add = table.weight.detach()[idx.clamp(min=0)] * (idx >= 0).unsqueeze(-1)
        assert torch.equal(after[layer], before[layer] + add)
    with torch.no_grad():  # zero vectors: exactly the planned model
        for table in pasta_module(model).vectors:
            table.weight.zero_()
        assert torch.equal(model(**batch).logits, planned(**batch).logits)


@pytest.mark.parametrize("name", sorted(list_tuners()))
def test_every_tuner_trains_on_a_planned_model(name):
    tuner, cfg = resolve_tuning(name)
    token_keyed = [r["mechanism"] for r in _plan() if attnlab.core.mechanism_class(
        r["mechanism"].split("(")[0]).caps.keys_are_tokens]
    if name == "prefix" and token_keyed:
        # Prefix tuning gives every layer m = n + prefix keys; band / JAT read key j as
        # token j, so the tuner refuses the plan up front, naming the mechanism.
        with pytest.raises(ValueError, match=f"virtual keys.*{token_keyed[0].split('(')[0]}"):
            tuner.apply(_planned_bert(), cfg, task=TaskInfo(kind="pair"))
        return
    model = tuner.apply(_planned_bert(), cfg, task=TaskInfo(kind="pair")).train()
    trainable = [p for _, p in tuner.trainable_parameters(model)]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    batch = {**bert_pair_batch(), "labels": torch.tensor([0, 1, 2])}
    aux = tuner.aux_loss(model)
    loss = model(**batch).loss + (aux if aux is not None else 0.0)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_prefix_tuning_accepts_plans_without_token_keyed_mechanisms():
    model = make_bert()
    surgery.apply_plan(model, [{"layers": "all", "heads": [0], "mechanism": "linear_elu"}])
    tuner, cfg = resolve_tuning("prefix(num_virtual_tokens=3)")
    model = tuner.apply(model, cfg, task=TaskInfo(kind="pair")).eval()
    batch = bert_pair_batch()
    assert torch.isfinite(model(**batch).logits).all()


@pytest.mark.parametrize("name", ["bitfit", "pasta", "adapter"])
def test_weights_a_plan_adds_stay_frozen_under_partial_tuners(name):
    """docs/decisions.md: weights that an attention plan adds stay frozen under pasta, bitfit
    and adapter; sac's projections have biases, which bitfit's name rule alone would pick."""
    model = make_bert()
    surgery.apply_plan(model, [{"layers": "all", "heads": "all", "mechanism": "sac"}])
    added = [n for n, _ in model.named_parameters() if ".attnlab." in n]
    assert any(n.endswith(".bias") for n in added)
    tuner, cfg = resolve_tuning(name)
    model = tuner.apply(model, cfg, task=TaskInfo(kind="pair"))
    trained = {n for n, _ in tuner.trainable_parameters(model)}
    assert trained and not trained & set(added)
