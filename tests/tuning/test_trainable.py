"""Each tuner trains exactly its parameters: all others stay bit-identical after steps."""

from __future__ import annotations

import re

import pytest
import torch
from tuning_helpers import bert_pair_batch, make_bert

from attnlab.tuning import TaskInfo, list_tuners, resolve_tuning

HEAD = r"^(base_model\.(model\.)?)?classifier\..*"
# Trainable parameter names per tuner (regex, full match), for BertForSequenceClassification.
EXPECTED = {
    "full": r".*",
    "bitfit": rf".*\.bias|{HEAD}",
    "pasta": rf"bert\.pasta\.vectors\.\d\.weight|{HEAD}",
    "adapter": rf".*\.adapter\.(down|up)\.(weight|bias)|.*LayerNorm\.(weight|bias)|{HEAD}",
    "lora": r"base_model\.model\.bert\..*\.(query|value)\.lora_[AB]\.default\.weight"
            r"|base_model\.model\.classifier\.modules_to_save\.default\.(weight|bias)",
    "prefix": rf"bert\.attnlab_prefix\.embedding\.weight|{HEAD}",
    "diff_prune": rf"bert\..*\.parametrizations\.\w+\.0\.(w|log_alpha)|{HEAD}",
    "wo_sparse": r".*",
    "mae": r".*",  # the gates (attention.self.mae_gate.*) included
}


def test_every_registered_tuner_is_covered():
    assert set(list_tuners()) == set(EXPECTED)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_only_intended_parameters_change(name):
    tuner, cfg = resolve_tuning(name)
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair")).train()
    trainable = dict(tuner.trainable_parameters(model))
    pattern = re.compile(EXPECTED[name])
    all_names = [n for n, _ in model.named_parameters()]
    assert set(trainable) == {n for n in all_names if pattern.fullmatch(n)}, name
    assert trainable, name
    before = _snapshot(model)
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2, weight_decay=0.01)
    batch = {**bert_pair_batch(), "labels": torch.tensor([0, 1, 2])}
    for _ in range(2):  # two steps: LoRA's A gets gradient only once B is non-zero
        out = model(**batch)
        aux = tuner.aux_loss(model)
        loss = out.loss + (aux if aux is not None else 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _snapshot(model)
    changed = {n for n in all_names if not torch.equal(before[n], after[n])}
    frozen_changed = changed - set(trainable)
    assert not frozen_changed, f"{name}: frozen parameters changed: {sorted(frozen_changed)[:5]}"
    # Every kind of tuned parameter moved (a few single tensors may get exactly zero
    # gradient, e.g. key biases under softmax shift invariance, so check by kind).
    kinds = {re.sub(r"\d+", "#", n) for n in trainable}
    moved = {re.sub(r"\d+", "#", n) for n in changed}
    unmoved = {k for k in kinds - moved if not k.endswith("attention.self.key.bias")}
    assert not unmoved, f"{name}: no update for {sorted(unmoved)[:5]}"


def test_diff_prune_keeps_pretrained_weights_and_moves_effective_ones():
    tuner, cfg = resolve_tuning("diff_prune")
    model = tuner.apply(make_bert(), cfg).train()
    lin = model.bert.encoder.layer[0].attention.self.query
    theta0 = lin.parametrizations.weight.original.detach().clone()
    opt = torch.optim.AdamW([p for _, p in tuner.trainable_parameters(model)], lr=1e-2)
    batch = {**bert_pair_batch(), "labels": torch.tensor([0, 1, 2])}
    loss = model(**batch).loss + tuner.aux_loss(model)
    loss.backward()
    opt.step()
    assert torch.equal(lin.parametrizations.weight.original, theta0)
    model.eval()
    assert not torch.equal(lin.weight, theta0)


def test_applying_twice_is_an_error():
    tuner, cfg = resolve_tuning("bitfit")
    model = tuner.apply(make_bert(), cfg)
    with pytest.raises(ValueError, match="already tuned"):
        resolve_tuning("pasta")[0].apply(model, resolve_tuning("pasta")[1],
                                         task=TaskInfo(kind="pair"))


def test_unknown_tuning_key_names_the_fix():
    from attnlab.core import RegistryError

    with pytest.raises(RegistryError, match=r"unknown parameter 'rank' for tuner 'lora'"):
        resolve_tuning("lora(rank=8)")
    with pytest.raises(RegistryError, match=r"did you mean 'pasta'"):
        resolve_tuning("pastaa")
    assert resolve_tuning(None)[1].name == "full"
    assert resolve_tuning({"name": "lora", "r": 4})[1].r == 4
    assert resolve_tuning("lora(r=8, alpha=16)")[1].spec().startswith("lora(r=8, alpha=16")


def test_registered_tuners_follow_the_protocol():
    from attnlab.tuning import TUNERS, Tuner

    for name in TUNERS.names():
        tuner = TUNERS.get(name)
        assert isinstance(tuner, Tuner) and tuner.name == name
        assert tuner.config_cls.__doc__


def test_full_can_keep_the_word_embeddings_fixed():
    tuner, cfg = resolve_tuning("full(freeze_embeddings=True)")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair")).train()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["bert.embeddings.word_embeddings.weight"]
    before = model.bert.embeddings.word_embeddings.weight.detach().clone()
    opt = torch.optim.AdamW([p for _, p in tuner.trainable_parameters(model)], lr=1e-2)
    model(**bert_pair_batch(), labels=torch.tensor([0, 1, 2])).loss.backward()
    opt.step()
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, before)
    assert "bert.embeddings.word_embeddings.weight" not in tuner.state_dict_to_save(model)


@pytest.mark.parametrize("name", [*sorted(EXPECTED), "lora(dropout=0.5)"])
def test_modules_a_tuner_adds_take_the_model_mode(name):
    """A model tuned in eval stays in eval: PASTA's dropout, Diff-Prune's sampled gates and
    LoRA's dropout would otherwise make two eval calls differ."""
    tuner, cfg = resolve_tuning(name)
    model = tuner.apply(make_bert().eval(), cfg, task=TaskInfo(kind="pair"))
    assert not [n for n, m in model.named_modules() if m.training]
    with torch.no_grad():  # tuned weights away from their init (LoRA's B, the diff: 0)
        for _, p in tuner.trainable_parameters(model):
            p.add_(0.1 * torch.randn_like(p))
        batch = bert_pair_batch()
        assert torch.equal(model(**batch).logits, model(**batch).logits)
    trained = tuner.apply(make_bert().train(), cfg, task=TaskInfo(kind="pair"))
    assert all(m.training for m in trained.modules())
