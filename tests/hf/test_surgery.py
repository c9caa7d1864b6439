"""apply_plan on tiny random models: installation, validation, reports, families.

Tolerances: fp32 parity with the untouched model 1e-5 (same maths, different kernels:
SDPA with a [b,1,n,m] mask vs SDPA with a [b,1,1,m] key mask); padding invariance 1e-5;
mean-pooled K/V initialisation 1e-6 (one mean over 4 heads).
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnlab
from attnlab.hf import SurgeryError, UnsupportedModelError, apply_plan, aux_loss
from attnlab.hf.backend import STATE_ATTR, AttnlabLayer
from attnlab.hf.plan import PlanError

REGISTERED = set(attnlab.list_mechanisms())


def needs(*names):
    missing = [n for n in names if n not in REGISTERED]
    return pytest.mark.skipif(bool(missing), reason=f"mechanism(s) {missing} not registered yet")


def run(model, batch):
    return model(**batch).last_hidden_state


def test_softmax_plan_matches_untouched_model(tiny_bert, padded_batch):
    ref = run(tiny_bert, padded_batch)
    report = apply_plan(tiny_bert, [{"layers": "all", "heads": "all", "mechanism": "softmax"}])
    assert tiny_bert.config._attn_implementation == "attnlab"
    torch.testing.assert_close(run(tiny_bert, padded_batch), ref, atol=1e-5, rtol=1e-5)
    assert report.counts == {"softmax": 12} and report.params_added == 0


def test_plan_does_not_switch_a_model_sharing_the_config(bert_factory):
    import transformers

    a = bert_factory()
    b = transformers.BertModel(a.config)
    apply_plan(a, "softmax")
    assert a.config._attn_implementation == "attnlab"
    assert b.config._attn_implementation == "sdpa"
    assert a.encoder.layer[0].attention.self.config is a.config


@needs("band", "jat")
def test_bert_jat_style_mixed_plan_forward_backward(bert_factory, padded_batch):
    model = bert_factory().train()
    plan = [
        {"layers": "all", "heads": [0, 2], "mechanism": "band(window=2)"},
        {"layers": [1, 2], "heads": [1], "mechanism": "jat(rho=0.3, mask_pads=True)"},
    ]
    report = apply_plan(model, plan)
    assert report.table[0][1] == "softmax" and report.table[0][0].startswith("band(")
    assert report.table[1][1].startswith("jat(") and report.table[1][3] == "softmax"
    out = run(model, padded_batch)
    out.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "attention.self.query" in n]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_mixed_heads_forward_backward_and_parameters_registered(bert_factory, padded_batch):
    model = bert_factory().train()
    plan = [
        "all:0,2:linear_elu",
        "1:all:talking_heads",
        "2:1:linformer(k=4)",
    ]
    report = apply_plan(model, plan)
    assert report.table[0] == ["linear_elu(eps=1e-06, chunk=64)", "softmax"] * 2
    assert report.table[1] == ["talking_heads(init='identity')"] * 4
    assert report.table[2][1].startswith("linformer(")
    names = [n for n, _ in model.named_parameters() if ".attnlab." in n]
    assert any("layer.1.attention.self.attnlab.mechanisms.0" in n for n in names)
    assert any("layer.2.attention.self.attnlab.mechanisms" in n for n in names)
    assert report.params_added == sum(
        p.numel() for n, p in model.named_parameters() if ".attnlab." in n
    ) > 0
    out = run(model, padded_batch)
    out.square().mean().backward()
    for n, p in model.named_parameters():
        if ".attnlab." in n:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_head_groups_are_written_back_in_head_order(tiny_bert, padded_batch):
    """Interleaved groups {0,2} and {1,3}, both running softmax, must reproduce the untouched
    model: this checks slicing and the scatter back into head order."""
    ref = run(tiny_bert, padded_batch)
    layer = tiny_bert.encoder.layer[1].attention.self
    apply_plan(tiny_bert, "1:0,2:linear_elu")
    # swap the linear_elu group for softmax to test the scatter path with a known answer
    sm = attnlab.build_mechanism("softmax", attnlab.HeadDims(2, 8))
    inst = layer.attnlab
    assert isinstance(inst, AttnlabLayer) and inst.heads == ((0, 2), (1, 3))
    inst.mechanisms[0] = sm
    torch.testing.assert_close(run(tiny_bert, padded_batch), ref, atol=1e-5, rtol=1e-5)


@needs("band")
def test_padding_does_not_change_real_tokens_with_band(tiny_bert, padded_batch):
    apply_plan(tiny_bert, "all:all:band(window=2)")
    out = run(tiny_bert, padded_batch)
    for i, n in enumerate(padded_batch["attention_mask"].sum(1).tolist()):
        single = {k: v[i : i + 1, :n] for k, v in padded_batch.items()}
        torch.testing.assert_close(run(tiny_bert, single)[0], out[i, :n], atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_real_tokens_with_mixed_plan(tiny_bert, padded_batch):
    apply_plan(tiny_bert, ["all:1,3:linear_elu", "2:all:realformer"])
    out = run(tiny_bert, padded_batch)
    for i, n in enumerate(padded_batch["attention_mask"].sum(1).tolist()):
        single = {k: v[i : i + 1, :n] for k, v in padded_batch.items()}
        torch.testing.assert_close(run(tiny_bert, single)[0], out[i, :n], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ validation


def test_head_index_12_on_12_head_model(bert_factory):
    model = bert_factory(hidden_size=48, num_attention_heads=12)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(PlanError, match=r"rule 0 .*head index 12.*12 heads.*0-11"):
        apply_plan(model, [{"layers": [0], "heads": [3, 12], "mechanism": "linear_elu"}])
    # nothing changed
    assert model.config._attn_implementation == "sdpa"
    assert not any(".attnlab." in k for k in model.state_dict())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_unknown_mechanism_and_key_are_clear(tiny_bert):
    with pytest.raises(PlanError, match="unknown mechanism 'talking_head'.*talking_heads"):
        apply_plan(tiny_bert, "all:all:talking_head")
    with pytest.raises(PlanError, match="unknown parameter 'windw'"):
        apply_plan(tiny_bert, "all:all:linformer(windw=3)")


def test_layer_scope_mechanism_on_head_subset_is_an_error(tiny_bert):
    with pytest.raises(SurgeryError, match=r"rule 0 .*layer 1.*talking_heads.*scope 'layer'.*"
                       r"heads \[2, 3\].*heads: all"):
        apply_plan(tiny_bert, "1:0,1:talking_heads")
    # a later rule that overrides part of a whole-layer rule is caught too
    with pytest.raises(SurgeryError, match="talking_heads"):
        apply_plan(tiny_bert, ["all:all:talking_heads", "0:3:softmax"])
    assert tiny_bert.config._attn_implementation == "sdpa"


def test_linformer_longer_than_max_len(tiny_bert):
    apply_plan(tiny_bert, "all:all:linformer(k=4)", max_len=16)
    ok = torch.randint(1, 100, (1, 16))
    tiny_bert(input_ids=ok)
    with pytest.raises(ValueError, match=r"layer 0 .*linformer.*at most 16 positions.*20"):
        tiny_bert(input_ids=torch.randint(1, 100, (1, 20)))
    with pytest.raises(SurgeryError, match="max_len=65"):
        apply_plan(tiny_bert, "softmax", max_len=65)


def test_causal_host_rejects_non_causal_mechanism(bert_factory):
    model = bert_factory(is_decoder=True)
    with pytest.raises(SurgeryError, match=r"causal.*linformer.*causal_ok=False"):
        apply_plan(model, "2:all:linformer(k=4)")
    assert model.config._attn_implementation == "sdpa"


def test_causal_host_runs_causally(bert_factory):
    model = bert_factory(is_decoder=True)
    ids = torch.randint(1, 100, (2, 10))
    ref = model(input_ids=ids).last_hidden_state
    apply_plan(model, "all:1,3:linear_elu")
    out = model(input_ids=ids).last_hidden_state
    ids2 = ids.clone()
    ids2[:, 6:] = torch.randint(1, 100, (2, 4))
    out2 = model(input_ids=ids2).last_hidden_state
    torch.testing.assert_close(out[:, :6], out2[:, :6], atol=1e-5, rtol=1e-5)
    # the softmax heads of a fresh causal plan reproduce the causal host exactly
    apply_plan(model, "softmax")
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, ref, atol=1e-5,
                               rtol=1e-5)


def test_unsupported_models_say_why():
    from transformers import BigBirdConfig, BigBirdModel

    cfg = BigBirdConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=16)
    with pytest.raises(UnsupportedModelError, match="does not route through.*AttentionInterface"):
        apply_plan(BigBirdModel(cfg), "softmax")
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel|no self-attention"):
        apply_plan(torch.nn.Linear(2, 2), "softmax")


# ----------------------------------------------------------------------- re-plan and state


def test_reapplying_replaces_previous_groups(tiny_bert, padded_batch):
    ref = run(tiny_bert, padded_batch)
    apply_plan(tiny_bert, "1:all:talking_heads")
    assert any(".attnlab." in n for n, _ in tiny_bert.named_parameters())
    report = apply_plan(tiny_bert, "softmax")
    assert not any(".attnlab." in n for n, _ in tiny_bert.named_parameters())
    assert report.params_added == 0
    torch.testing.assert_close(run(tiny_bert, padded_batch), ref, atol=1e-5, rtol=1e-5)


def test_mqa_shrinks_kv_and_cannot_be_undone(tiny_bert, padded_batch):
    attn = tiny_bert.encoder.layer[2].attention.self
    w, bias = attn.key.weight.detach().clone(), attn.key.bias.detach().clone()
    report = apply_plan(tiny_bert, "2:all:mqa")
    assert attn.key.weight.shape == (8, 32) and attn.value.weight.shape == (8, 32)
    # each new K/V head is the mean of the old heads (h=4, d=8)
    torch.testing.assert_close(attn.key.weight, w.view(4, 8, 32).mean(0), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(attn.key.bias, bias.view(4, 8).mean(0), atol=1e-6, rtol=1e-6)
    assert report.kv_heads == {2: 1} and report.params_removed == 2 * 3 * (8 * 32 + 8)
    assert "K/V heads: 1" in str(report)
    out = run(tiny_bert, padded_batch)
    out.sum().backward()
    assert attn.key.weight.grad is not None
    with pytest.raises(SurgeryError, match="cannot be undone"):
        apply_plan(tiny_bert, "softmax")
    with pytest.raises(SurgeryError, match="scope 'module'"):
        apply_plan(type(tiny_bert)(tiny_bert.config), "2:0:mqa")


def test_realformer_state_is_fresh_for_every_forward(tiny_bert, padded_batch):
    apply_plan(tiny_bert, "all:all:realformer")
    a = run(tiny_bert, padded_batch)
    b = run(tiny_bert, padded_batch)
    assert torch.equal(a, b)
    # a deep copy gets its own state holder and reset hook target
    twin = copy.deepcopy(tiny_bert)
    holder = getattr(twin, STATE_ATTR)
    assert holder is not getattr(tiny_bert, STATE_ATTR)
    assert all(m.forward_state is holder for m in twin.modules() if isinstance(m, AttnlabLayer))
    assert torch.equal(run(twin, padded_batch), a)
    assert torch.equal(run(twin, padded_batch), a)
    assert torch.equal(run(tiny_bert, padded_batch), a)
    assert holder.state == {}  # scratch is freed after each forward


def test_aux_loss_is_none_without_regularisers(tiny_bert, padded_batch):
    assert aux_loss(tiny_bert) is None
    apply_plan(tiny_bert, "softmax")
    run(tiny_bert, padded_batch)
    assert aux_loss(tiny_bert) is None


# -------------------------------------------------------------------------------- report


def test_report_renders(tiny_bert):
    report = apply_plan(tiny_bert, ["all:all:linear_elu", "0:1:linear_elu(eps=0.1)",
                                    "2:all:softmax"])
    text = str(report)
    assert "linear_elu#1" in text and "linear_elu#2" in text and "softmax" in text
    assert report.counts_by_name == {"linear_elu": 8, "softmax": 4}
    md = report.to_markdown()
    assert md.splitlines()[0] == "| layer | h0 | h1 | h2 | h3 |"
    d = report.to_dict()
    assert d["num_layers"] == 3 and d["table"][2] == ["softmax"] * 4
    assert attnlab.Plan.parse(d["plan"]) == report.plan

    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(report)
    text = console.export_text()  # compact grid: one letter per spec, then the legend
    assert "B = linear_elu(eps=0.1, chunk=64)  (1 heads)" in text
    assert "    0  A   B   A   A" in text


# ------------------------------------------------------------------------------ families


def _family_model(family: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=100, max_position_embeddings=66, intermediate_size=64)
    if family == "roberta":
        return tf.RobertaForMaskedLM(tf.RobertaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **common))
    if family == "electra":
        return tf.ElectraForTokenClassification(tf.ElectraConfig(
            embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            **common))
    return tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=66))


@pytest.mark.parametrize("family", ["roberta", "electra", "distilbert"])
def test_other_families_accept_a_plan(family, padded_batch):
    model = _family_model(family).eval()
    ref = model(**padded_batch).logits
    apply_plan(model, "softmax")
    torch.testing.assert_close(model(**padded_batch).logits, ref, atol=1e-5, rtol=1e-5)
    report = apply_plan(model, ["all:0,1:linear_elu", "1:all:talking_heads"])
    assert report.model_type == family and report.num_layers == 2 and report.num_heads == 4
    model.train()
    out = model(**padded_batch).logits
    out.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if ".attnlab." in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    # layer indices come from the installed layers (DistilBERT modules have no layer_idx)
    layers = [m for m in model.modules() if isinstance(m, AttnlabLayer)]
    assert [m.layer_idx for m in layers] == [0, 1]


def test_generic_decoder_with_grouped_kv_heads():
    """A model outside FAMILIES that routes through the interface (Llama, GQA, causal)."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, max_position_embeddings=64)).eval()
    ids = torch.randint(0, 100, (2, 9))
    ref = model(input_ids=ids).last_hidden_state
    report = apply_plan(model, "softmax")
    assert report.model_type == "llama"
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, ref, atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(SurgeryError, match="causal"):
        apply_plan(model, "all:all:linformer(k=4)")
    apply_plan(model, "1:all:mqa")
    assert model.layers[1].self_attn.k_proj.out_features == 8
    assert torch.isfinite(model(input_ids=ids).last_hidden_state).all()


@pytest.mark.parametrize("spec", ["collaborative", "mqa"])
def test_a_wrapped_projection_is_refused_before_anything_changes(bert_factory, spec):
    """Mechanisms that replace (collaborative) or shrink (mqa) the projections need plain
    nn.Linear ones: a tuner's wrapper in a later layer is refused up front, the model as it
    was (it had been half-converted, or lost the wrapper's parameters)."""
    from torch import nn

    class Wrapped(nn.Linear):  # stands in for a tuner's wrapper (peft's LoRA layer)
        pass

    model = bert_factory()
    attn = model.encoder.layer[1].attention.self
    for name in ("query", "key", "value"):
        old = getattr(attn, name)
        new = Wrapped(old.in_features, old.out_features)
        new.load_state_dict(old.state_dict())
        setattr(attn, name, new)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    with pytest.raises(SurgeryError, match="is not a plain nn.Linear"):
        attnlab.apply_plan(model, f"all:all:{spec}")
    assert model.config._attn_implementation == impl
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
