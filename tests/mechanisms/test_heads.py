"""talking_heads and mqa against naive references.

Tolerances: identity-init talking heads vs softmax at 1e-6 (an identity einsum adds
exact zeros); random-init vs the looped reference and mqa vs the dense oracle at 1e-5
(same products, different summation order).
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.core import RegistryError, masked_softmax, resolve_config
from attnlab.core.reference import causal_mask

B, H, D = 2, 4, 8


def build(spec, h=H):
    torch.manual_seed(0)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, None)).eval()


def rand(n, m=None, seed=0, kv_heads=H):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.randn(B, H, n, D, generator=g)
    return q, torch.randn(B, kv_heads, m, D, generator=g), torch.randn(B, kv_heads, m, D,
                                                                         generator=g)


def naive_talking_heads(q, k, v, P_l, P_w, key_mask=None, causal=False):
    """Explicit loops over heads: J'_g = sum_h P_l[h,g] J_h; W'_g = sum_h P_w[h,g] W_h."""
    h, (n, m) = q.shape[1], (q.shape[2], k.shape[2])
    J = q @ k.transpose(-1, -2) * D**-0.5  # [b,h,n,m]
    Jp = torch.stack([sum(P_l[i, g] * J[:, i] for i in range(h)) for g in range(h)], 1)
    allowed = causal_mask(n, m) if causal else torch.ones(n, m, dtype=torch.bool)
    allowed = allowed.expand(Jp.shape)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    W = masked_softmax(Jp, allowed)
    Wp = torch.stack([sum(P_w[i, g] * W[:, i] for i in range(h)) for g in range(h)], 1)
    return Wp @ v, Wp


# ----------------------------------------------------------------------------- talking heads


@pytest.mark.parametrize("causal", [False, True])
def test_identity_init_equals_softmax(causal):
    mech = build("talking_heads")
    assert torch.equal(mech.P_l, torch.eye(H)) and torch.equal(mech.P_w, torch.eye(H))
    q, k, v = rand(10, seed=1)
    key_mask = torch.arange(10)[None, :] < torch.tensor([10, 3])[:, None]
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, pref = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(res.out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(res.probs, pref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_random_init_matches_looped_reference(causal):
    mech = build("talking_heads(init='random')")
    assert not torch.allclose(mech.P_l, torch.eye(H))
    q, k, v = (t.requires_grad_() for t in rand(9, seed=2))
    key_mask = torch.arange(9)[None, :] < torch.tensor([9, 5])[:, None]
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, wref = naive_talking_heads(q, k, v, mech.P_l, mech.P_w, key_mask, causal)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.probs, wref, atol=1e-5, rtol=1e-5)
    assert (res.probs[1, :, :, 5:] == 0).all()  # W' of padded keys is exactly 0
    g = torch.randn_like(ref)
    params = (q, k, v, mech.P_l, mech.P_w)
    for a, r in zip(torch.autograd.grad(res.out, params, g, retain_graph=True),
                    torch.autograd.grad(ref, params, g), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_gradients_reach_mixing_matrices_at_identity():
    mech = build("talking_heads").train()
    q, k, v = rand(7, seed=3)
    mech(q, k, v, attnlab.AttnContext()).out.square().sum().backward()
    for p in (mech.P_l, mech.P_w):
        assert p.grad is not None and torch.isfinite(p.grad).all()
        assert p.grad.abs().sum() > 0
        assert (p.grad - p.grad.diag().diag()).abs().sum() > 0  # off-diagonal terms learn


def test_heads_really_talk():
    mech = build("talking_heads(init='random')")
    q, k, v = rand(6, seed=4)
    out = mech(q, k, v, attnlab.AttnContext()).out
    k2 = k.clone()
    # head 1's keys change head 0's weights (each head keeps its own V; a constant shift
    # of the keys would only move whole score rows, which softmax ignores)
    k2[:, 1] = torch.randn_like(k2[:, 1])
    out2 = mech(q, k2, v, attnlab.AttnContext()).out
    assert not torch.allclose(out[:, 0], out2[:, 0])
    ident = build("talking_heads")  # ...which does not happen at identity init
    torch.testing.assert_close(ident(q, k, v, attnlab.AttnContext()).out[:, 0],
                               ident(q, k2, v, attnlab.AttnContext()).out[:, 0])


def test_talking_heads_caps_and_spec():
    caps = attnlab.core.mechanism_class("talking_heads").caps
    assert (caps.family, caps.scope, caps.exact) == ("heads", "layer", False)
    assert resolve_config("talking_heads").init == "identity"
    assert resolve_config("talking_heads(init='random')").init == "random"
    with pytest.raises(RegistryError, match="init must be one of"):
        resolve_config("talking_heads(init='orthogonal')")


def test_talking_heads_rejects_wrong_head_count():
    mech = build("talking_heads", h=3)
    with pytest.raises(ValueError, match="built for 3"):
        mech(*rand(5), attnlab.AttnContext())


# --------------------------------------------------------------------------------- mqa


def mqa_reference(q, k, v, **kw):
    """Dense softmax with k, v replaced by their head-mean, repeated to every head."""
    km = k.mean(1, keepdim=True).repeat(1, q.shape[1], 1, 1)
    vm = v.mean(1, keepdim=True).repeat(1, q.shape[1], 1, 1)
    return attnlab.reference_attention(q, km, vm, **kw)


@pytest.mark.parametrize("kv_heads", [1, H])
@pytest.mark.parametrize("causal", [False, True])
def test_mqa_equals_dense_softmax_over_mean_kv(kv_heads, causal):
    mech = build("mqa")
    q, k, v = (t.requires_grad_() for t in rand(9, seed=5, kv_heads=kv_heads))
    key_mask = torch.arange(9)[None, :] < torch.tensor([9, 2])[:, None]
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal))
    ref, _ = mqa_reference(q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(res.out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    wres = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                             need_weights=True))
    torch.testing.assert_close(wres.out, ref, atol=1e-5, rtol=1e-5)
    assert wres.probs.shape == (B, H, 9, 9)


def test_mqa_one_head_equals_pooled_heads():
    mech = build("mqa")
    q, k, v = rand(8, seed=6)
    full = mech(q, k, v, attnlab.AttnContext()).out
    one = mech(q, k.mean(1, keepdim=True), v.mean(1, keepdim=True), attnlab.AttnContext()).out
    torch.testing.assert_close(full, one, atol=1e-6, rtol=1e-6)


def test_mqa_rejects_other_kv_head_counts():
    q, k, v = rand(5, kv_heads=2)
    with pytest.raises(ValueError, match="accepted K/V head counts"):
        build("mqa")(q, k, v, attnlab.AttnContext())


def test_mqa_caps_and_spec():
    caps = attnlab.core.mechanism_class("mqa").caps
    assert (caps.family, caps.scope, caps.kv_heads, caps.exact) == ("heads", "module", 1,
                                                                     False)
    assert resolve_config("mqa") == resolve_config("mqa()")
    with pytest.raises(RegistryError, match="unknown parameter"):
        resolve_config("mqa(kv_heads=2)")
