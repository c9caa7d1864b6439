"""The short-input path of the position patterns (``_maskedsdpa.masked_sdpa``) against
``core.reference_attention``: outputs and gradients to 1e-5 (fp32; the fused kernel sums in
another order), with pattern rows that have no key, key masks (one sequence all padding)
and causal masking; and the patterns themselves below the blocked engine's length.
``sdpa`` with unequal q/k and v head dims: the same tolerance against the reference, and
the CPU fused kernel taken (SDPA's math path would keep the [b, h, n, m] probabilities)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab.core import reference_attention
from attnlab.mechanisms._maskedsdpa import masked_sdpa, sdpa

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _inputs(b=3, h=2, n=11, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).requires_grad_() for _ in range(3))


def _bias(n, seed=1):
    """A random pattern with row 3 empty (no key at all) and the diagonal kept elsewhere."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(n, n, generator=g) > 0.5
    allowed |= torch.eye(n, dtype=torch.bool)
    allowed[3] = False
    return torch.zeros(1, n, n).masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [None, [11, 6, 0]])
def test_masked_sdpa_equals_the_reference_with_gradients(causal, lengths):
    q, k, v = _inputs()
    n = q.shape[2]
    bias = _bias(n)
    key_mask = None if lengths is None else torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    out = masked_sdpa(q, k, v, bias, key_mask, causal, 0.3, 0.0)
    ref, _ = reference_attention(q, k, v, bias=bias, key_mask=key_mask, causal=causal,
                                 scale=0.3)
    torch.testing.assert_close(out, ref, **TOL)
    assert (out[:, :, 3] == 0).all()  # the empty pattern row
    if lengths is not None:
        assert (out[2] == 0).all()  # the sequence of padding only
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, **TOL)


def test_masked_sdpa_drops_attention_only_when_asked():
    q, k, v = _inputs(seed=2)
    bias = _bias(q.shape[2], seed=3)
    plain = masked_sdpa(q, k, v, bias, None, False, 0.3, 0.0)
    torch.manual_seed(0)
    dropped = masked_sdpa(q, k, v, bias, None, False, 0.3, 0.5)
    assert not torch.allclose(plain, dropped)
    assert (dropped[:, :, 3] == 0).all()


@pytest.mark.parametrize("spec", ["band(window=2)", "dilated(window=2, dilation=2)",
                                  "longformer(window=2, global_tokens=(0, 5))",
                                  "bigbird(block=2, num_random_blocks=1)", "random(num_random=3)",
                                  "sparse_transformer(stride=3)"])
def test_patterns_below_the_blocked_length_match_their_reference(spec):
    """n = 11 < DENSE_FALLBACK_MAX_LEN: the pattern runs on masked_sdpa (no weights) and
    on the reference (weights asked for); both give the same output and gradients."""
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(2, 8, 64)).eval()
    q, k, v = _inputs(seed=4)
    key_mask = torch.arange(11)[None] < torch.tensor([11, 7, 2])[:, None]
    for causal in (False, True):
        fast = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal)).out
        slow = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                                 need_weights=True)).out
        torch.testing.assert_close(fast, slow, **TOL)
        g = torch.randn_like(fast)
        for a, r in zip(torch.autograd.grad(fast, (q, k, v), g),
                        torch.autograd.grad(slow, (q, k, v), g), strict=True):
            torch.testing.assert_close(a, r, **TOL)


@pytest.mark.parametrize("d, dv", [(16, 8), (8, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_with_unequal_head_dims_equals_the_reference(d, dv, causal):
    """Zero columns on the narrower side (q and k, or v) change nothing: outputs and the
    gradients of q, k and v (at their own widths) to 1e-5, with a key mask."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 3, 13, d, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(2, 3, 13, dv, generator=g).requires_grad_()
    keep = (torch.arange(13)[None] < torch.tensor([13, 9])[:, None])[:, None, None]
    out = sdpa(q, k, v, attn_mask=keep, is_causal=False, scale=0.4) if not causal else \
        sdpa(q, k, v, is_causal=True, scale=0.4)
    ref, _ = reference_attention(q, k, v, key_mask=None if causal else keep[:, 0, 0],
                                 causal=causal, scale=0.4)
    assert out.shape == (2, 3, 13, dv)
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(ref, (q, k, v), grad), strict=True):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, **TOL)


@pytest.mark.parametrize("spec", ["collaborative", "lowrank_band(rank=4, window=2)"])
def test_unequal_head_dims_run_on_the_fused_kernel(spec):
    """With only the fused kernel allowed, SDPA refuses unequal head dims ("No available
    kernel"); ``sdpa``, and the mechanisms whose q/k width is not v's (collaborative's
    shared Dk = h*d against d, lowrank_band's rank r), run forward and backward on it."""
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(2, 2, 300, 8, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(2, 2, 300, 16, generator=g).requires_grad_()
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(2, 16, 512)).train()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        sdpa(q, k, v, scale=0.3).sum().backward()
        x = torch.randn(2, 2, 300, 16, generator=g, requires_grad=True)
        mech(x, x, x, attnlab.AttnContext()).out.sum().backward()
    assert torch.isfinite(x.grad).all()
