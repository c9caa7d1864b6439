"""realformer: residual scores passed up the stack through ctx.state.

The manual computation uses ``core.reference_attention`` with the previous layers' raw
scores as the additive bias. Tolerance 1e-6 (the same operations in the same order up to
float reassociation of the score sum).
"""

from __future__ import annotations

import pytest
import torch
from saved import kept_for_backward

import attnlab
from attnlab.core import RegistryError, resolve_config
from attnlab.mechanisms.priors import REALFORMER_STATE_KEY

B, H, D = 2, 3, 8
TOL = {"atol": 1e-6, "rtol": 1e-6}


def build(h=H):
    return attnlab.build_mechanism("realformer", attnlab.HeadDims(h, D, None)).eval()


def rand(n, m=None, seed=0, h=H):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    return tuple(torch.randn(B, h, x, D, generator=g) for x in (n, m, m))


def raw_scores(q, k):
    return q @ k.transpose(-1, -2) * D**-0.5


@pytest.mark.parametrize("causal", [False, True])
def test_single_layer_equals_softmax(causal):
    q, k, v = rand(9)
    key_mask = torch.arange(9)[None, :] < torch.tensor([9, 4])[:, None]
    res = build()(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal, state={},
                                               need_weights=True))
    ref, pref = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)


def test_state_none_is_plain_softmax():
    q, k, v = rand(7)
    out = build()(q, k, v, attnlab.AttnContext(state=None)).out
    torch.testing.assert_close(out, attnlab.reference_attention(q, k, v)[0], **TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["explicit", "default"])
def test_three_stacked_layers_equal_manual_computation(monkeypatch, causal, form):
    """The default at this length is the factored form (widths d, 2d, 3d): the scores
    passed up are then the factors' product, equal up to reassociated sums."""
    from attnlab.mechanisms import priors

    tol = TOL
    if form == "explicit":
        monkeypatch.setattr(priors, "FACTORED_SHORT_WIDTH", 0)
    else:
        tol = FACTORED_TOL
    layers = [build() for _ in range(3)]
    key_mask = torch.arange(11)[None, :] < torch.tensor([11, 6])[:, None]
    state: dict = {}
    inputs = [rand(11, seed=s) for s in range(3)]
    outs = []
    for idx, (mech, (q, k, v)) in enumerate(zip(layers, inputs, strict=True)):
        c = attnlab.AttnContext(key_mask=key_mask, causal=causal, layer_idx=idx * 2,
                                state=state)
        outs.append(mech(q, k, v, c).out)
    s0 = raw_scores(*inputs[0][:2])
    s1 = raw_scores(*inputs[1][:2]) + s0  # layer 1's scores are themselves residual
    for out, (q, k, v), prev in zip(outs[1:], inputs[1:], (s0, s1), strict=True):
        ref, _ = attnlab.reference_attention(q, k, v, bias=prev, key_mask=key_mask,
                                             causal=causal)
        torch.testing.assert_close(out, ref, **tol)
    # the stored entry is the last layer's raw (un-masked, finite) score sum
    entry = state[REALFORMER_STATE_KEY]
    kind = priors.ResidualScores if form == "explicit" else priors.ResidualFactors
    assert isinstance(entry, kind)
    scores = entry.scores if form == "explicit" else entry.product()
    assert entry.layer_idx == 4 and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, raw_scores(*inputs[2][:2]) + s1, **tol)


def test_gradients_flow_through_the_residual():
    (q0, k0, v0), (q1, k1, v1) = rand(6, seed=0), rand(6, seed=1)
    q0.requires_grad_()
    state: dict = {}
    build()(q0, k0, v0, attnlab.AttnContext(layer_idx=0, state=state))
    out = build()(q1, k1, v1, attnlab.AttnContext(layer_idx=1, state=state)).out
    (g,) = torch.autograd.grad(out.square().sum(), q0)
    assert g.abs().sum() > 0  # layer 1's output depends on layer 0's queries only via S_0


def test_shape_mismatch_between_layers_is_a_clear_error():
    state: dict = {}
    build(h=3)(*rand(5, h=3), attnlab.AttnContext(layer_idx=0, state=state))
    with pytest.raises(ValueError, match=r"layer 1 has scores of shape.*layer 0 passed up"):
        build(h=2)(*rand(5, h=2), attnlab.AttnContext(layer_idx=1, state=state))
    with pytest.raises(ValueError, match="same heads and lengths"):
        build()(*rand(6), attnlab.AttnContext(layer_idx=1, state=state))


def test_reused_state_is_a_clear_error():
    state: dict = {}
    mech = build()
    mech(*rand(5), attnlab.AttnContext(layer_idx=2, state=state))
    with pytest.raises(ValueError, match="fresh dict for each forward pass"):
        mech(*rand(5), attnlab.AttnContext(layer_idx=2, state=state))


def test_caps_and_spec():
    caps = attnlab.core.mechanism_class("realformer").caps
    assert (caps.family, caps.exact, caps.scope) == ("priors", False, "layer")
    assert resolve_config("realformer") == resolve_config("realformer()")
    with pytest.raises(RegistryError, match="unknown parameter"):
        resolve_config("realformer(alpha=1)")


# ------------------------------------------------- the factored form (ResidualFactors)

FACTORED_TOL = {"atol": 1e-5, "rtol": 1e-5}  # SDPA over the factors: reassociated sums


def run_stack(inputs, need_weights=(), **ctx_kw):
    """Layers 0.. of realformer sharing one state; (outputs, probs or None, state)."""
    state: dict = {}
    results = [build()(q, k, v, attnlab.AttnContext(layer_idx=i, state=state,
                                                    need_weights=i in need_weights,
                                                    **ctx_kw))
               for i, (q, k, v) in enumerate(inputs)]
    return [r.out for r in results], [r.probs for r in results], state


@pytest.mark.parametrize("causal", [False, True])
def test_factored_stack_equals_the_explicit_one(monkeypatch, causal):
    """Factors up to 2 head dims wide: layers 0-1 factored, layer 2 explicit from the
    factors' product, layer 3 explicit. Outputs, the scores passed up and the gradients of
    every layer's q, k, v equal the all-explicit stack's; padding and a causal mask."""
    from attnlab.mechanisms import priors

    key_mask = torch.arange(11)[None, :] < torch.tensor([11, 6])[:, None]
    results = []
    for factored in (True, False):
        monkeypatch.setattr(priors, "FACTORED_LONG_SCORES", 1)
        monkeypatch.setattr(priors, "FACTORED_MAX_WIDTH", 2 if factored else 0)
        inputs = [tuple(x.requires_grad_() for x in rand(11, seed=s)) for s in range(4)]
        outs, _, state = run_stack(inputs, key_mask=key_mask, causal=causal)
        entries = state[REALFORMER_STATE_KEY]
        assert isinstance(entries, priors.ResidualScores)
        g = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
        leaves = [x for qkv in inputs for x in qkv]
        results.append((outs, entries.scores, torch.autograd.grad(loss, leaves)))
    (outs_a, s_a, g_a), (outs_b, s_b, g_b) = results
    for a, b in zip([*outs_a, s_a, *g_a], [*outs_b, s_b, *g_b], strict=True):
        torch.testing.assert_close(a, b, **FACTORED_TOL)


def test_factored_layers_pass_factors_and_weights_come_from_their_product(monkeypatch):
    """Layers 0-1 pass ResidualFactors up ([b,h,n,d] then [b,h,n,2d]); a layer asked for
    weights computes S_1 from them and returns the explicit stack's probabilities."""
    from attnlab.mechanisms import priors

    monkeypatch.setattr(priors, "FACTORED_LONG_SCORES", 1)
    inputs = [rand(9, seed=s) for s in range(3)]
    state: dict = {}
    widths = []
    for i, (q, k, v) in enumerate(inputs[:2]):
        build()(q, k, v, attnlab.AttnContext(layer_idx=i, state=state))
        entry = state[REALFORMER_STATE_KEY]
        assert isinstance(entry, priors.ResidualFactors)
        widths.append(entry.queries.shape[-1])
    assert widths == [D, 2 * D]
    q, k, v = inputs[2]
    res = build()(q, k, v, attnlab.AttnContext(layer_idx=2, state=state, need_weights=True))
    bias = raw_scores(*inputs[0][:2]) + raw_scores(*inputs[1][:2])
    ref, probs = attnlab.reference_attention(q, k, v, bias=bias)
    torch.testing.assert_close(res.out, ref, **FACTORED_TOL)
    torch.testing.assert_close(res.probs, probs, **FACTORED_TOL)


def test_factored_width_is_capped_by_the_input_length():
    """Short inputs (under 512 x 512 scores per head) factor up to 4 head dims, long ones
    up to 8; past the cap the stack continues explicit."""
    from attnlab.mechanisms import priors

    d = 32
    assert priors.factored_fits(128, 128, 4 * d, d) and not priors.factored_fits(
        128, 128, 5 * d, d)
    assert priors.factored_fits(512, 512, 8 * d, d) and not priors.factored_fits(
        512, 512, 9 * d, d)
    assert priors.factored_fits(1024, 256, 8 * d, d)  # n * m counts, not n alone
    inputs = [rand(9, seed=s) for s in range(6)]
    state: dict = {}
    kinds = []
    for i, (q, k, v) in enumerate(inputs):
        build()(q, k, v, attnlab.AttnContext(layer_idx=i, state=state))
        kinds.append(type(state[REALFORMER_STATE_KEY]).__name__)
    assert kinds == ["ResidualFactors"] * 4 + ["ResidualScores"] * 2


def test_factored_training_keeps_no_score_map():
    """At n = 1024 (factored by default) two layers in training keep under a tenth of one
    [b, h, n, n] float32 tensor; the explicit form keeps S_l and more."""
    n = 1024
    inputs = [tuple(x.requires_grad_() for x in rand(n, seed=s)) for s in range(2)]

    with kept_for_backward() as kept:
        outs, _, _ = run_stack(inputs)
    assert kept.bytes < B * H * n * n * 4 / 10
    (g,) = torch.autograd.grad(outs[1].square().sum(), inputs[0][0])
    assert g.abs().sum() > 0  # layer 1 depends on layer 0's queries through the factors
