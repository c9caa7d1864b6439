"""capture_attention: probabilities from the attnlab backend, checked against eager.

Tolerances: probabilities vs transformers' eager ``output_attentions`` 1e-5 (fp32); row sums
1e-5.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.hf import AttentionCache, apply_plan, capture_attention


def test_softmax_capture_equals_eager_output_attentions(bert_factory, padded_batch):
    eager = bert_factory()
    eager.set_attn_implementation("eager")
    ref = eager(**padded_batch, output_attentions=True).attentions
    model = bert_factory().train()
    cache = capture_attention(model, {**padded_batch, "labels": torch.zeros(3)})
    assert isinstance(cache, AttentionCache) and list(cache) == [0, 1, 2]
    for layer, r in enumerate(ref):
        assert cache[layer].dtype == torch.float32 and cache[layer].device.type == "cpu"
        torch.testing.assert_close(cache[layer], r, atol=1e-5, rtol=1e-5)
    # the model is back on its own implementation and in training mode
    assert model.config._attn_implementation == "sdpa" and model.training
    assert torch.equal(cache.input_ids, padded_batch["input_ids"])
    assert torch.equal(cache.attention_mask, padded_batch["attention_mask"])
    assert cache.mechanisms[0] == ["softmax"]
    assert cache.stack().shape == (3, 3, 4, 12, 12)
    with pytest.raises(KeyError, match="layers are 0-2"):
        cache[3]


def test_capture_on_planned_model_keeps_plan(tiny_bert, padded_batch):
    apply_plan(tiny_bert, ["all:0,1:linear_elu", "1:all:talking_heads"])
    cache = capture_attention(tiny_bert, padded_batch)
    assert tiny_bert.config._attn_implementation == "attnlab"
    assert cache.mechanisms[1] == ["talking_heads"]
    assert cache.mechanisms[0] == ["linear_elu", "softmax"]
    out = tiny_bert(**padded_batch, output_attentions=True).attentions
    for layer in range(3):
        torch.testing.assert_close(cache[layer], out[layer].detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.skipif("band" not in attnlab.list_mechanisms(), reason="band not registered yet")
def test_band_capture_is_banded(tiny_bert, padded_batch):
    apply_plan(tiny_bert, "all:all:band(window=2)")
    cache = capture_attention(tiny_bert, padded_batch)
    i = torch.arange(12)
    outside = (i[:, None] - i[None, :]).abs() > 2
    mask = padded_batch["attention_mask"].bool()
    for layer in cache:
        p = cache[layer]  # [b,h,n,m]
        assert (p[..., outside] == 0).all()
        assert (p[~mask[:, None, None, :].expand_as(p)] == 0).all()  # padded keys: nothing
        rows = p.sum(-1)[mask[:, None, :].expand(-1, 4, -1)]
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=1e-5)


def test_batch_without_inputs_is_an_error(tiny_bert):
    with pytest.raises(ValueError, match="none of BertModel.forward's inputs"):
        capture_attention(tiny_bert, {"text": ["a"]})
    with pytest.raises(ValueError, match="on_missing"):
        capture_attention(tiny_bert, {"input_ids": torch.ones(1, 3).long()}, on_missing="skip")


def test_capture_through_lora_wrapped_projections(bert_factory, padded_batch):
    """peft's LoRA wraps query/value in layers holding the nn.Linear as ``base_layer``."""
    from attnlab.tuning import resolve_tuning

    model = bert_factory("BertForSequenceClassification")
    before = capture_attention(model, padded_batch)
    tuner, cfg = resolve_tuning("lora(r=4)")
    wrapped = tuner.apply(model, cfg)
    after = capture_attention(wrapped, padded_batch)  # LoRA B starts at zero: same maps
    for layer in before:
        torch.testing.assert_close(after[layer], before[layer], atol=1e-6, rtol=1e-6)
