"""The "attnlab" attention function: masks, weights, per-forward state, aux losses.

Tolerances: fp32 comparisons with transformers' own eager/SDPA paths at 1e-5.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

import attnlab
from attnlab.core import AttnOutput, Capabilities, HeadDims, resolve_config
from attnlab.hf import apply_plan, aux_loss
from attnlab.hf.backend import (
    LAYER_ATTR,
    AttnlabLayer,
    ForwardState,
    install_reset_hook,
    key_mask_from_hf,
    register_backend,
)


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert register_backend() == register_backend() == "attnlab"
    assert "attnlab" in AttentionInterface()
    assert AttentionMaskInterface()["attnlab"] is sdpa_mask


def test_key_mask_from_hf_forms():
    keep = torch.tensor([[True, True, False], [True, False, False]])
    b4 = keep[:, None, None, :].expand(2, 1, 4, 3)
    assert torch.equal(key_mask_from_hf(b4, 2, 3), keep)
    additive = torch.zeros(2, 1, 4, 3).masked_fill(~b4, torch.finfo(torch.float32).min)
    assert torch.equal(key_mask_from_hf(additive, 2, 3), keep)
    assert torch.equal(key_mask_from_hf(additive.masked_fill(~b4, float("-inf")), 2, 3), keep)
    assert torch.equal(key_mask_from_hf(keep.long(), 2, 3), keep)
    assert key_mask_from_hf(None, 2, 3) is None
    # a causal mask keeps every key some query can see (the last row sees all)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    assert key_mask_from_hf(causal, 1, 3).all()
    with pytest.raises(ValueError, match="neither"):
        key_mask_from_hf(torch.ones(2, 3, 3, dtype=torch.bool), 2, 3)


def test_unplanned_attnlab_equals_sdpa_and_eager_weights(bert_factory, padded_batch):
    sdpa = bert_factory()
    eager = bert_factory()
    eager.set_attn_implementation("eager")
    ours = bert_factory()
    register_backend()
    ours.set_attn_implementation("attnlab")
    ref = sdpa(**padded_batch).last_hidden_state
    out = ours(**padded_batch, output_attentions=True)
    torch.testing.assert_close(out.last_hidden_state, ref, atol=1e-5, rtol=1e-5)
    ref_w = eager(**padded_batch, output_attentions=True).attentions
    assert len(out.attentions) == 3
    for a, r in zip(out.attentions, ref_w, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # no weights unless asked
    assert ours(**padded_batch).attentions is None


class _NoProbs(nn.Module):
    """Test-only mechanism (never registered) that never materialises probabilities."""

    caps: ClassVar[Capabilities] = Capabilities(family="test", paper="none")

    def __init__(self, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = resolve_config("softmax"), dims
        self.inner = attnlab.build_mechanism("softmax", dims)

    def forward(self, q, k, v, ctx) -> AttnOutput:
        return AttnOutput(self.inner(q, k, v, ctx).out)


def test_weights_only_when_every_group_has_probs(tiny_bert, padded_batch):
    apply_plan(tiny_bert, "1:0,1:linear_elu")
    layer = getattr(tiny_bert.encoder.layer[1].attention.self, LAYER_ATTR)
    layer.mechanisms[0] = _NoProbs(HeadDims(2, 8))
    out = tiny_bert(**padded_batch, output_attentions=True)
    # layer 1 gives no probabilities for heads 0-1, so transformers records only 2 layers
    assert len(out.attentions) == 2
    with pytest.raises(ValueError, match=r"layer 1: mechanism\(s\) \['softmax'\] do not"):
        attnlab.capture_attention(tiny_bert, padded_batch)
    cache = attnlab.capture_attention(tiny_bert, padded_batch, on_missing="none")
    assert cache[1] is None and cache[0].shape == (3, 4, 12, 12)
    with pytest.raises(ValueError, match=r"layers \[1\] have no probabilities"):
        cache.stack()


# ------------------------------------------------------------------- per-forward state, aux


class _Probe(nn.Module):
    """Test-only mechanism (never registered): softmax output, an aux loss of 1 per call,
    and a counter in ctx.state that shows whether the state is fresh each forward."""

    caps: ClassVar[Capabilities] = Capabilities(family="test", paper="none")

    def __init__(self, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = resolve_config("softmax"), dims
        self.inner = attnlab.build_mechanism("softmax", dims)
        self.seen: list[int] = []

    def forward(self, q, k, v, ctx) -> AttnOutput:
        calls = ctx.state.get("calls", 0)
        ctx.state["calls"] = calls + 1
        self.seen.append(calls)
        res = self.inner(q, k, v, ctx)
        return AttnOutput(res.out, res.probs, torch.ones(()))


def test_state_is_fresh_per_forward_and_aux_losses_sum(tiny_bert, padded_batch):
    holder = ForwardState()
    probes = []
    for i, layer in enumerate(tiny_bert.encoder.layer):
        probe = _Probe(HeadDims(4, 8))
        probes.append(probe)
        setattr(layer.attention.self, LAYER_ATTR,
                AttnlabLayer(i, 4, [((0, 1, 2, 3), probe)], holder))
    install_reset_hook(tiny_bert, holder)
    install_reset_hook(tiny_bert, holder)  # idempotent: one hook, not two
    register_backend()
    tiny_bert.set_attn_implementation("attnlab")
    for _ in range(2):
        tiny_bert(**padded_batch)
        assert float(aux_loss(tiny_bert)) == 3.0  # one per layer, reset each forward
    assert [p.seen for p in probes] == [[0, 0], [1, 1], [2, 2]]
    assert len(tiny_bert._forward_pre_hooks) == 1


def test_attnlab_layer_rejects_incomplete_groups():
    sm = attnlab.build_mechanism("softmax", HeadDims(2, 8))
    with pytest.raises(ValueError, match="cover heads"):
        AttnlabLayer(0, 4, [((0, 1), sm)], ForwardState())


def test_dropout_reaches_mechanisms_only_in_training(bert_factory, padded_batch):
    model = bert_factory(attention_probs_dropout_prob=0.5)
    apply_plan(model, "softmax")
    a = model(**padded_batch).last_hidden_state
    assert torch.equal(a, model(**padded_batch).last_hidden_state)
    model.train()
    torch.manual_seed(0)
    b = model(**padded_batch).last_hidden_state
    assert not torch.allclose(a, b, atol=1e-3)
