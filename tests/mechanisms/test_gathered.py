"""The chunked gathered-key-set attention (mechanisms/_gathered.py) against autograd through
the plain gather + masked softmax: outputs and q/keys/values gradients to 1e-5 (fp32),
several chunks, repeated keys, fully masked rows, per-batch masks; dropout by gradcheck
(fp64, the keep-mask fixed by its seed)."""

from __future__ import annotations

import pytest
import torch

from attnlab.core import masked_softmax
from attnlab.mechanisms import _gathered
from attnlab.mechanisms._gathered import _GatheredAttention, gathered_attention


def plain(q, keys, vals, idx, allowed, scale):
    kx, vx = keys[:, :, idx], vals[:, :, idx]  # [b,h,n,K,d]
    s = (q.unsqueeze(-2) @ kx.transpose(-1, -2)).squeeze(-2) * scale  # [b,h,n,K]
    probs = masked_softmax(s, allowed.expand(s.shape))
    return (probs.unsqueeze(-2) @ vx).squeeze(-2)


def case(b=2, h=3, n=20, m=26, k=7, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype, requires_grad=True)
    keys = torch.randn(b, h, m, d, generator=g, dtype=dtype, requires_grad=True)
    vals = torch.randn(b, h, m, d + 2, generator=g, dtype=dtype, requires_grad=True)
    idx = torch.randint(0, m, (n, k), generator=g)  # repeats allowed
    allowed = torch.rand(b, 1, n, k, generator=g) < 0.7
    allowed[0, 0, 3] = False  # a row with no allowed key
    return q, keys, vals, idx, allowed


@pytest.mark.parametrize("chunk_bytes", [1, 2000, 1 << 30])  # 1 row, a few rows, one chunk
def test_equals_autograd_through_the_gather(monkeypatch, chunk_bytes):
    monkeypatch.setattr(_gathered, "CHUNK_BYTES", chunk_bytes)
    q, keys, vals, idx, allowed = case()
    w = torch.randn(2, 3, 20, 10, generator=torch.Generator().manual_seed(5))
    out = gathered_attention(q, keys, vals, idx, allowed, scale=0.3)
    ref = plain(q, keys, vals, idx, allowed, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    got = torch.autograd.grad((out * w).sum(), (q, keys, vals))
    want = torch.autograd.grad((ref * w).sum(), (q, keys, vals))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dropout_gradients_pass_gradcheck(monkeypatch):
    monkeypatch.setattr(_gathered, "CHUNK_BYTES", 3000)
    q, keys, vals, idx, allowed = case(b=1, h=2, n=9, m=11, k=4, d=3, dtype=torch.float64)

    def fn(q, keys, vals):
        return _GatheredAttention.apply(q, keys, vals, idx, allowed, 0.5, 0.3, 1234)

    assert torch.autograd.gradcheck(fn, (q, keys, vals))
    dropped = fn(q, keys, vals)
    plain_out = plain(q, keys, vals, idx, allowed, 0.5)
    assert not torch.allclose(dropped, plain_out)  # the dropout did something
