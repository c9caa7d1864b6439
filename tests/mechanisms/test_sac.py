"""``sac`` (Sparse Adaptive Connection): k = n is softmax, naive reference, predictor gradients.

Tolerances: fp32 outputs, probabilities and gradients vs references 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from saved import kept_for_backward

import attnlab
from attnlab.mechanisms.content_learned import SACConfig

D, H = 8, 2


def qkv(b=3, n=11, m=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    return (torch.randn(b, H, n, D, generator=g), torch.randn(b, H, m, D, generator=g),
            torch.randn(b, H, m, D, generator=g))


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [b,n]


def build(spec):
    torch.manual_seed(0)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(H, D)).eval()


def naive_sac(mech, q, k, v, top_k, key_mask=None, causal=False):
    """Per query: predictor scores by an explicit MLP on [q_i; k_j], the k best allowed keys
    by a stable sort, a softmax over them. Returns (out, probs)."""
    b, h, n, d = q.shape
    m = k.shape[2]
    w1 = torch.cat([mech.w_q.weight, mech.w_k.weight], dim=1)  # W1 [H, 2d]
    out = torch.zeros(b, h, n, v.shape[-1])
    probs = torch.zeros(b, h, n, m)
    for bb in range(b):
        for hh in range(h):
            for i in range(n):
                ok = [j for j in range(m) if (key_mask is None or key_mask[bb, j])
                      and (not causal or j <= i + m - n)]
                if not ok:
                    continue
                x = torch.stack([torch.cat([q[bb, hh, i], k[bb, hh, j]]) for j in ok])
                e = mech.w_out(torch.relu(x @ w1.T + mech.w_q.bias))[:, 0]
                best = [ok[t] for t in torch.sort(e, descending=True, stable=True).indices[:top_k]]
                s = torch.stack([q[bb, hh, i] @ k[bb, hh, j] for j in best]) / d**0.5
                p = torch.softmax(s, 0)
                out[bb, hh, i] = p @ v[bb, hh, best]
                probs[bb, hh, i, best] = p
    return out, probs


@pytest.mark.parametrize("causal", [False, True])
def test_k_equal_n_is_dense_softmax(causal):
    mech = build("sac(k=11)")
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = lengths_mask(11, [11, 6, 1])
    res = mech(q, k, v, attnlab.AttnContext(key_mask=mask, causal=causal, need_weights=True))
    ref, pref = attnlab.reference_attention(q, k, v, key_mask=mask, causal=causal)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.probs, pref, atol=1e-5, rtol=1e-5)
    # v's gradient equals softmax's; q's and k's also carry the predictor's straight-through
    # term (the predictor reads q and k), so they are not compared here
    g = torch.randn_like(ref)
    (gv,) = torch.autograd.grad(res.out, (v,), g)
    (gv_ref,) = torch.autograd.grad(ref, (v,), g)
    torch.testing.assert_close(gv, gv_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k,n,m,padded,causal", [
    (3, 9, 9, False, False), (3, 9, 9, True, False), (2, 7, 7, True, True), (4, 5, 8, True, True),
    (4, 8, 5, False, True),
])
def test_matches_naive_reference(top_k, n, m, padded, causal):
    mech = build(f"sac(k={top_k}, hidden=8)")
    q, k, v = qkv(n=n, m=m, seed=n + m)
    mask = lengths_mask(m, [m, max(1, m - 3), 2]) if padded else None
    with torch.no_grad():
        res = mech(q, k, v, attnlab.AttnContext(key_mask=mask, causal=causal, need_weights=True))
        ref, pref = naive_sac(mech, q, k, v, top_k, mask, causal)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.probs, pref, atol=1e-5, rtol=1e-5)
    assert ((res.probs > 0).sum(-1) <= top_k).all()


def test_predictor_gets_gradients_through_the_straight_through_gate():
    mech = build("sac(k=3, hidden=8)").train()
    q, k, v = (t.requires_grad_() for t in qkv(n=13))
    out = mech(q, k, v, attnlab.AttnContext()).out
    out.square().sum().backward()
    for name, p in mech.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("kwargs,match", [
    ({"k": 0}, "k must be >= 1"), ({"hidden": 0}, "hidden must be >= 1"),
    ({"predictor": "lstm"}, "predictor must be 'mlp'"),
])
def test_bad_specs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SACConfig(**kwargs)


@pytest.mark.parametrize("top_k, n, m, causal", [
    (3, 11, 11, False), (3, 11, 11, True), (4, 6, 13, False), (20, 9, 9, False),
    (2, 9, 9, True),
])
def test_sparse_path_equals_the_dense_one(top_k, n, m, causal, monkeypatch):
    """Without need_weights the predictor scores the edges in chunks without gradient and
    is recomputed on the chosen edges alone (``SAC.sparse_forward``): outputs and the
    gradients of q, k, v and every predictor weight equal the dense path's (the one the
    naive loop checks) to 1e-5, with padding (a row with fewer allowed keys than k, one with
    none), causal, n < m, k > m, and chunks of one query row."""
    from attnlab.mechanisms import content_learned

    monkeypatch.setattr(content_learned, "SCORE_CHUNK_ELEMS", 1)  # one query per chunk
    mech = build(f"sac(k={top_k}, hidden=5)")
    mask = torch.ones(3, m, dtype=torch.bool)
    mask[1, 2:] = False  # two keys: fewer than k
    mask[2] = False  # no key: zeros
    got = []
    for weights in (False, True):
        mech.zero_grad()
        q, k, v = (t.requires_grad_() for t in qkv(n=n, m=m, seed=7))
        out = mech(q, k, v, attnlab.AttnContext(key_mask=mask, causal=causal,
                                                need_weights=weights)).out
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        got.append([out.detach(), q.grad, k.grad, v.grad,
                    *(p.grad.clone() for p in mech.parameters())])
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[0][0][2].abs().max() == 0


def test_training_keeps_no_gathered_edge_rows():
    """The chosen edges' rows of k, v and the key half of the predictor ([b,h,n,k,*] each)
    are gathered again in the backward (a checkpoint), not kept: nothing of 5 dims is
    saved, and the gradients still reach q, k, v and the predictor."""
    mech = build("sac(k=4, hidden=6)").train()
    q, k, v = (t.requires_grad_() for t in qkv(n=32, seed=3))

    with kept_for_backward() as kept:
        out = mech(q, k, v, attnlab.AttnContext()).out
    assert kept.shapes and not [s for s in kept.shapes if len(s) == 5]
    out.square().sum().backward()
    for t in (q, k, v, *mech.parameters()):
        assert t.grad is not None and t.grad.abs().sum() > 0
