"""``softmax(fused=False)`` (mechanisms/dense.py): the vanilla Transformer's attention, the
cost baseline of ``bench lra --baseline``. Tolerance: 1e-5 (fp32) against the fused path and
``core.reference_attention``, outputs and gradients."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.core import resolve_config


def _run(spec: str, q, k, v, **ctx):
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(q.shape[1], q.shape[-1])).eval()
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = mech(q, k, v, attnlab.AttnContext(state={}, **ctx)).out
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,m", [(7, 7), (5, 9)])
def test_the_explicit_form_equals_the_fused_path_and_the_reference(causal, n, m):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, L, 8, generator=g) for L in (n, m, m))
    key_mask = torch.ones(3, m, dtype=torch.bool)
    key_mask[1, m // 2:] = False
    key_mask[2] = False  # a sequence of padding only: every row has no key
    ref, _ = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
    out, grads = _run("softmax(fused=False)", q, k, v, key_mask=key_mask, causal=causal)
    fused, fused_grads = _run("softmax", q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, fused, atol=1e-5, rtol=1e-5)
    assert (out[2] == 0).all()
    for a, b in zip(grads, fused_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused,stores_map", [(False, True), (True, False)])
def test_only_the_explicit_form_keeps_the_n_by_m_probabilities(fused, stores_map):
    """What makes it the vanilla baseline: autograd saves a [b, h, n, m] tensor."""
    q, k, v = (torch.randn(2, 2, 48, 8, requires_grad=True) for _ in range(3))
    mech = attnlab.build_mechanism(f"softmax(fused={fused})", attnlab.HeadDims(2, 8))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mech(q, k, v, attnlab.AttnContext(state={}))
    assert ((2, 2, 48, 48) in shapes) == stores_map


def test_the_default_keeps_its_spelling():
    assert resolve_config("softmax").spec() == "softmax"
    assert resolve_config("softmax(fused=True)").spec() == "softmax"
    assert resolve_config("softmax(fused=False)").spec() == "softmax(fused=False)"
    assert resolve_config("softmax(fused=False)").to_dict() == {"name": "softmax",
                                                                "fused": False}


def test_the_explicit_form_drops_probabilities_in_training_only():
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    mech = attnlab.build_mechanism("softmax(fused=False)", attnlab.HeadDims(2, 8))
    ctx = attnlab.AttnContext(state={}, dropout=1.0)
    assert (mech.train()(q, k, v, ctx).out == 0).all()  # every probability dropped
    ref, _ = attnlab.reference_attention(q, k, v)
    torch.testing.assert_close(mech.eval()(q, k, v, ctx).out, ref, atol=1e-5, rtol=1e-5)
