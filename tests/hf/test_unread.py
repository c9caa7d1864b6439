"""Projections no head reads: listed after surgery, and a tuner that trains them is warned.

A tiny BertForSequenceClassification (3 layers, 4 heads): layer 0 wholly ``mega`` (reads
neither q nor k), layer 1 wholly the pure dense ``synthesizer`` (reads q, not k), layer 2
``synthesizer`` on two heads only (the other two read q and k as before). The listed
projections are exactly the ones whose parameters get no gradient in a training step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_bert

from attnlab.config import load_config
from attnlab.hf import apply_plan
from attnlab.hf.unread import unread_projections, untrained_warning
from attnlab.recipes.finetune import run_experiment
from attnlab.tuning import resolve_tuning

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = ["0:all:mega(ndim=4, zdim=8, chunk=8)", "1:all:synthesizer", "2:0,1:synthesizer"]
SELF = "bert.encoder.layer.{}.attention.self.{}"


def _model():
    model = make_tiny_bert("BertForSequenceClassification", num_labels=2)
    return model, apply_plan(model, PLAN, max_len=16).unread


def test_lists_the_projections_no_head_reads():
    got = {(u.layer, u.role, u.path) for u in unread_projections(*_model())}
    assert got == {(0, "query", SELF.format(0, "query")), (0, "key", SELF.format(0, "key")),
                   (1, "key", SELF.format(1, "key"))}
    assert unread_projections(make_tiny_bert("BertForSequenceClassification"), {}) == []


def test_the_surgery_report_says_it():
    model = make_tiny_bert("BertForSequenceClassification", num_labels=2)
    report = apply_plan(model, PLAN, max_len=16)
    assert report.unread == {0: ("query", "key"), 1: ("key",)}
    assert report.to_dict()["unread"] == {"0": ["query", "key"], "1": ["key"]}
    line = ("not read by any head (no gradient from the task loss): layer 0: query/key; "
            "layer 1: key")
    assert line in str(report) and line in report.to_markdown()
    plain = apply_plan(make_tiny_bert(), "2:0,1:synthesizer", max_len=16)
    assert plain.unread == {} and "not read" not in str(plain)


def test_listed_projections_are_exactly_the_ones_without_gradient(padded_batch):
    model, roles = _model()
    model.train()(**padded_batch, labels=torch.tensor([0, 1, 1])).loss.backward()
    listed = {u.path for u in unread_projections(model, roles)}
    for layer in range(3):
        for role in ("query", "key"):
            path = SELF.format(layer, role)
            lin = model.get_submodule(path)
            assert (lin.weight.grad is None) == (path in listed), path


@pytest.mark.parametrize("method, example", [
    ("lora(r=2, target_modules=('query', 'value'))",
     "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.default.weight"),
    ("bitfit", "bert.encoder.layer.0.attention.self.query.bias"),
])
def test_tuner_on_unread_projections_is_named(method, example):
    model, roles = _model()
    unread = unread_projections(model, roles)
    tuner, cfg = resolve_tuning(method)
    tuned = tuner.apply(model, cfg)
    msg = untrained_warning(tuned, unread)
    assert msg is not None and f"(e.g. {example})" in msg
    assert "layer(s) 0" in msg and "mega" in msg
    lora = method.startswith("lora")
    # LoRA on query/value: A and B of layer 0's query (layer 1's query is read); BitFit: the
    # query and key biases of layer 0, the key bias of layer 1
    assert msg.startswith("2 trainable parameter(s) in the query projections" if lora
                          else "3 trainable parameter(s) in the query/key projections")


def test_nothing_to_say_when_the_targets_are_read():
    model, roles = _model()
    unread = unread_projections(model, roles)
    tuner, cfg = resolve_tuning("lora(r=2, target_modules=('value',))")
    assert untrained_warning(tuner.apply(model, cfg), unread) is None


BASE = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=24",
        "train.batch_size=8", "train.max_steps=1", "task.train_limit=8", "task.eval_limit=8"]


MEGA0 = "plan=['0:all:mega(ndim=4, zdim=8, chunk=8)']"


def test_the_runner_warns_lora(tmp_path):
    cfg = load_config(None, BASE + ["name=u", f"output_dir={tmp_path}", MEGA0,
                                    "tuning.method=lora(r=2, target_modules=('query', 'key'))"])
    with pytest.warns(UserWarning, match=r"lora: 4 trainable parameter\(s\) in the "
                      r"query/key projections of layer\(s\) 0 get no gradient from the task"):
        run_experiment(cfg)


@pytest.mark.parametrize("method", ["full", "bitfit"])
def test_tuners_without_targets_are_not_warned(tmp_path, recwarn, method):
    """Full fine-tuning and BitFit train every weight / bias: the unchanged Q/K of such a
    layer is the plan's documented effect, not a choice of targets."""
    cfg = load_config(None, BASE + ["name=f", f"output_dir={tmp_path}", MEGA0,
                                    f"tuning.method={method}"])
    run_experiment(cfg)
    assert not [w for w in recwarn if "get no gradient" in str(w.message)]


def test_the_fix_names_the_family_s_own_modules():
    """DistilBERT's projections are q_lin / k_lin: the warning names those, not BERT's."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=64))
    unread = unread_projections(model, apply_plan(model, "1:all:synthesizer", max_len=16).unread)
    assert [(u.layer, u.role, u.path) for u in unread] == [
        (1, "key", "distilbert.transformer.layer.1.attention.k_lin")]
    tuner, cfg = resolve_tuning("lora(r=2, target_modules=('q_lin', 'k_lin', 'v_lin'))")
    msg = untrained_warning(tuner.apply(model, cfg), unread)
    assert msg is not None and msg.startswith("2 trainable parameter(s) in the k_lin "
                                              "projections of layer(s) 1")
    assert "leave k_lin out of target_modules" in msg


@pytest.mark.parametrize("method, expected", [
    ("lora(r=2, target_modules=('query', 'key'))", "the query/key projections of layer(s) 0"),
    ("lora(r=2)", "the query projections of layer(s) 0"),  # BERT's default: query, value
    ("bitfit", None),
])
def test_validate_warns_from_the_config_alone(tmp_path, method, expected):
    """`attnlab validate` gives the LoRA warning before anything is built or trained."""
    from typer.testing import CliRunner

    from attnlab.cli import app

    args = ["task.data_dir=builtin", "model.name=scratch:tiny", f"output_dir={tmp_path}",
            f"tuning.method={method}", MEGA0]
    res = CliRunner().invoke(app, ["validate", *args])
    assert res.exit_code == 0 and "config is valid" in res.output, res.output
    text = " ".join(res.output.split())
    if expected is None:
        assert "warning:" not in text
    else:
        assert f"warning: lora: target_modules include {expected}" in text, text
