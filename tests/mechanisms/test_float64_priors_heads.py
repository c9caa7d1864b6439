"""float64 inputs are computed in float64: adaptive_span's soft mask, average's averages,
gaussian_prior's and gaussian_transformer's priors, and the disagreement and pattern_loss
regularisers, each against a float64 formula written here (padded batch, causal and not).

Tolerance 1e-12: the same maths in float64 up to summation order; a computation that
passes through float32 is off by about 1e-8 (float32's rounding of O(1) values).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab

B, H, D, N = 2, 4, 3, 7
TOL = {"atol": 1e-12, "rtol": 1e-12}


def setup(spec, seed=0, max_len=16):
    torch.manual_seed(seed)
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, max_len)).double().eval()
    with torch.no_grad():  # parameters off their init, at float64 values
        for p in mech.parameters():
            p.add_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    key_mask = torch.ones(B, N, dtype=torch.bool)
    key_mask[1, -3:] = False
    return mech, q, k, v, key_mask


def allowed(key_mask, causal):
    """[b,1,n,n] bool: key j visible to query i."""
    a = key_mask[:, None, None, :].expand(B, 1, N, N)
    if causal:
        a = a & torch.ones(N, N, dtype=torch.bool).tril()
    return a


def softmax_attend(scores, a, v):
    p = torch.softmax(scores.masked_fill(~a, float("-inf")), -1).nan_to_num(0.0)
    return p @ v, p


CAUSAL = pytest.mark.parametrize("causal", [False, True])


@CAUSAL
def test_adaptive_span_mask_in_float64(causal):
    mech, q, k, v, km = setup("adaptive_span(max_span=8, ramp=3)")
    with torch.no_grad():
        mech.current_val.copy_(torch.tensor([0.1, 0.37, 0.0, 0.71], dtype=torch.float64))
    z = 8 * mech.current_val.detach()  # [h]
    span = min(8, math.ceil(float(z.max())) + 3)
    x = (torch.arange(N)[:, None] - torch.arange(N)[None]).abs().double()  # [n,n]
    a = allowed(km, causal) & (x < span)
    _, p = softmax_attend(q @ k.transpose(-1, -2) / math.sqrt(D), a, v)
    mask = ((3 + z[:, None, None] - x) / 3).clamp(0, 1)  # m_z(x) [h,n,n]
    w = p * mask
    w = w / (w.sum(-1, keepdim=True) + 1e-8)
    res = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal, need_weights=True))
    torch.testing.assert_close(res.probs, w, **TOL)
    torch.testing.assert_close(res.out, w @ v, **TOL)


@CAUSAL
def test_average_in_float64(causal):
    mech, q, k, v, km = setup("average(hidden=5)")
    a = allowed(km, causal).double()
    avg = (a / a.sum(-1, keepdim=True).clamp_min(1)) @ v  # [b,h,n,d]
    g = torch.relu(avg @ mech.ffn_w1 + mech.ffn_b1[:, None]) @ mech.ffn_w2 + mech.ffn_b2[:, None]
    gates = torch.sigmoid(torch.cat([v, g], -1) @ mech.gate_w + mech.gate_b[:, None])
    i_gate, f_gate = gates.chunk(2, -1)
    want = i_gate * v + f_gate * g
    got = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal)).out
    torch.testing.assert_close(got, want, **TOL)


@CAUSAL
def test_gaussian_prior_in_float64(causal):
    mech, q, k, v, km = setup("gaussian_prior")
    length = km.sum(-1).double()[:, None, None]  # I [b,1,1]
    t = torch.tanh(torch.einsum("bhnd,hed->bhne", q, mech.w_p))
    centre = length * torch.sigmoid(torch.einsum("bhne,he->bhn", t, mech.v_p))
    sigma = length * torch.sigmoid(torch.einsum("bhne,he->bhn", t, mech.v_d)) / 2
    j = torch.arange(N, dtype=torch.float64)
    prior = -(j - centre[..., None]).square() / (2 * sigma[..., None].square())
    want, _ = softmax_attend(q @ k.transpose(-1, -2) / math.sqrt(D) + prior,
                             allowed(km, causal), v)
    got = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal)).out
    torch.testing.assert_close(got, want, **TOL)


@CAUSAL
def test_gaussian_transformer_in_float64(causal):
    mech, q, k, v, km = setup("gaussian_transformer(w_init=0.7, b_init=-0.4)")
    w = torch.nn.functional.softplus(mech.w_raw)[:, None, None]
    b = -torch.nn.functional.softplus(mech.b_raw)[:, None, None]
    d2 = (torch.arange(N)[:, None] - torch.arange(N)[None]).double().square()
    want, _ = softmax_attend(q @ k.transpose(-1, -2) / math.sqrt(D) - (w * d2 + b).abs(),
                             allowed(km, causal), v)
    got = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal)).out
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(mech.bias(N, N), -(w * d2 + b).abs(), **TOL)


def mean_cosine(x):
    """1/H^2 sum_ij cos(X^i, X^j) of one example's [h, L, e] (Frobenius)."""
    f = x.flatten(1)
    nrm = f.norm(dim=1)
    return ((f @ f.T) / (nrm[:, None] * nrm[None])).mean()


@CAUSAL
def test_disagreement_loss_in_float64(causal):
    mech, q, k, v, km = setup("disagreement")
    out, p = softmax_attend(q @ k.transpose(-1, -2) / math.sqrt(D), allowed(km, causal), v)
    want = 0.0
    for b in range(B):
        keep = km[b]
        a = p[b][:, keep][:, :, keep]
        want = want + mean_cosine(v[b][:, keep]) + mean_cosine(out[b][:, keep])
        want = want + a.sum(0).square().sum() / H**2
    want = want / B
    for need in (False, True):
        res = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal, need_weights=need))
        torch.testing.assert_close(res.aux_loss, want, **TOL)


@CAUSAL
def test_pattern_loss_in_float64(causal):
    mech, q, k, v, km = setup("pattern_loss(patterns=['prev', 'next', 'first', 'bow'], "
                              "weight=1.0)")
    a = allowed(km, causal)
    _, p = softmax_attend(q @ k.transpose(-1, -2) / math.sqrt(D), a, v)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None]
    av = a[:, 0].double()  # [b,n,n]
    targets = [(j == i - 1) & a[:, 0], (j == i + 1) & a[:, 0], (j == 0) & a[:, 0],
               av / av.sum(-1, keepdim=True)]
    entries = (km[:, :, None] & km[:, None, :]).double()  # [b,n,n] counted pairs
    want = 0.0
    for hi, target in enumerate(targets):
        want = want + ((p[:, hi] - target.double()) * entries).square().sum() / entries.sum()
    for need in (False, True):
        res = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal, need_weights=need))
        torch.testing.assert_close(res.aux_loss, want, **TOL)
