"""The oracle itself, checked against a hand-written loop (fp64, 1e-10)."""

import math

import torch

from attnlab import reference_attention
from attnlab.core import masked_softmax
from attnlab.core.masks import band_pattern, pattern_bias


def loop_attention(q, k, v, allowed, scale):
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                js = [j for j in range(k.shape[2]) if allowed[bi, i, j]]
                if not js:
                    continue
                s = torch.stack([q[bi, hi, i] @ k[bi, hi, j] * scale for j in js])
                p = torch.softmax(s, 0)
                out[bi, hi, i] = sum(p[t] * v[bi, hi, j] for t, j in enumerate(js))
    return out


def test_reference_matches_loop_with_mask_bias_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    key_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    band = band_pattern(6, 6, 1)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    allowed = key_mask[:, None, :] & band & causal
    out, probs = reference_attention(q, k, v, bias=pattern_bias(band, torch.float64),
                                     key_mask=key_mask, causal=True)
    torch.testing.assert_close(out, loop_attention(q, k, v, allowed, 1 / math.sqrt(4)),
                               atol=1e-10, rtol=1e-10)
    # query 0 of example 1 has no allowed key (key 0 padded, causal): zeros, no NaN
    assert (out[1, :, 0] == 0).all() and (probs[1, :, 0] == 0).all()
    assert torch.isfinite(probs).all()


def test_masked_softmax_gradients_are_finite_for_empty_rows():
    s = torch.randn(3, 4, requires_grad=True)
    allowed = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    p = masked_softmax(s, allowed)
    p.sum().backward()
    assert torch.isfinite(s.grad).all() and (p[1] == 0).all()
    torch.testing.assert_close(p.sum(-1), torch.tensor([1.0, 0.0, 1.0]))
