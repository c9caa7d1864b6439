"""The FlexAttention backend of the sparse patterns (``mechanisms/_flex.py``): its cached
block masks and key-mask ``score_mod`` against the dense reference with eager FlexAttention
on CPU (forward only there), its power-of-two length buckets, and, on a CUDA GPU, the
compiled kernels against the CPU blocked engine, outputs and gradients."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from test_sparse import FAST, N_FAST, _qkv, build  # tests/mechanisms is on sys.path

import attnlab

FLEX_SPECS = ["band(window=5)", "longformer(window=4, global_tokens=[0, 9])",
              "bigbird(block=8, window_blocks=3, num_random_blocks=1, global_blocks=1)",
              "random(num_random=3)"]


@pytest.mark.parametrize("spec", FLEX_SPECS)
@pytest.mark.parametrize("causal", [False, True])
def test_flex_masks_match_reference_on_cpu_forward(spec, causal):
    """The cached BlockMask + key-mask score_mod, run by eager FlexAttention (forward only
    on CPU): equal to the reference at 1e-5."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from attnlab.mechanisms import _flex

    mech = build(spec)
    n = 70
    q, k, v = (t.detach() for t in _qkv(n, seed=3))
    key_mask = torch.arange(n)[None, :] < torch.tensor([n, 33, 0])[:, None]
    bias = mech.bias(n, n, layer_idx=1)
    with warnings.catch_warnings():  # eager FlexAttention warns that it is slow
        warnings.simplefilter("ignore")
        out = _flex.flex_pattern_attention(
            q, k, v, lambda: bias[0] == 0, (mech.cfg, 1), key_mask=key_mask, causal=causal,
            scale=8**-0.5, compiled=False,
        )
    ref, _ = attnlab.reference_attention(q, k, v, bias=bias, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_padding_to_blocks_keeps_each_length_its_own_pattern(causal):
    """Lengths 70, 100 (padded to 128), 128 (not padded), 200 (padded to 256) and 256, one
    after another with the same cache key: each equals the reference, so the cached mask is
    per true length."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from attnlab.mechanisms import _flex

    assert [_flex.padded_length(n) for n in (1, 70, 128, 129, 200, 256, 257, 5000)] == [
        128, 128, 128, 256, 256, 256, 512, 8192]
    mech = build("bigbird(block=8, window_blocks=3, num_random_blocks=1, global_blocks=1)")
    for n in (70, 100, 128, 200, 256):
        q, k, v = (t.detach() for t in _qkv(n, seed=n))
        key_mask = torch.arange(n)[None, :] < torch.tensor([n, n - 9, 1])[:, None]
        bias = mech.bias(n, n, layer_idx=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _flex.flex_pattern_attention(
                q, k, v, lambda bias=bias: bias[0] == 0, (mech.cfg, 0), key_mask=key_mask,
                causal=causal, scale=8**-0.5, compiled=False)
        ref, _ = attnlab.reference_attention(q, k, v, bias=bias, key_mask=key_mask,
                                             causal=causal)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backend needs CUDA")
@pytest.mark.parametrize("spec", FAST[:3] + FAST[-2:])
def test_flex_cuda_matches_cpu_blocked_path(spec):
    from attnlab.mechanisms import _flex

    mech = build(spec, head_dim=16)  # FlexAttention needs head dim >= 16
    q, k, v = _qkv(N_FAST, d=16, seed=1)
    key_mask = torch.arange(N_FAST)[None, :] < torch.tensor([N_FAST, 170, 0])[:, None]
    c = attnlab.AttnContext(key_mask=key_mask, causal=True)
    out = mech(q, k, v, c).out
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    cc = attnlab.AttnContext(key_mask=key_mask.cuda(), causal=True)
    with mock.patch.object(_flex, "flex_pattern_attention",
                           wraps=_flex.flex_pattern_attention) as spy:
        out_c = mech.cuda()(qc, kc, vc, cc).out
    assert spy.called, "the FlexAttention path did not run"
    torch.testing.assert_close(out_c.cpu(), out, atol=1e-5, rtol=1e-5)  # fp32 on both sides
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_c = torch.autograd.grad(out_c, (qc, kc, vc), g.cuda())
    for a, r in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a.cpu(), r, atol=1e-5, rtol=1e-5)
