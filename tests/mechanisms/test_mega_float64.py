"""mega in float64: a float64 input is computed in float64 throughout, the damped EMA (its
kernel, FFT convolution, ``step`` and ``final_state``) included, so the layer equals the
naive float64 reference of ``mega_reference.py`` to 1e-12 and passes ``gradcheck``.

Before, the EMA's coefficients and kernel were always float32 (the official precision), so
a float64 layer was off the reference by ~1e-6 (the float32 rounding of O(1) values).
Tolerance 1e-12: the same maths in float64 up to summation order (FFT against loops).
"""

from __future__ import annotations

import pytest
import torch
from mega_reference import exact_laplace, naive_ema, naive_mega

import attnlab
from attnlab.mechanisms._ema import DampedEMA

B, H, D = 2, 2, 4  # batch, heads, head dim: the model width is H*D = 8
TOL = {"atol": 1e-12, "rtol": 1e-12}
SPECS = ["mega(ndim=3, zdim=6)", "mega(ndim=3, zdim=6, chunk=4)",
         "mega(ndim=3, zdim=6, attention_fn='laplace')",
         "mega(ndim=3, zdim=6, chunk=5, attention_fn='laplace', hdim=5)"]
CAUSAL = pytest.mark.parametrize("causal", [False, True])


def perturbed_ema(seed: int, channels: int = 5, ndim: int = 4) -> DampedEMA:
    torch.manual_seed(seed)
    ema = DampedEMA(channels, ndim).double()
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return ema


def build(spec: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, 32)).double().eval()
    with torch.no_grad():  # off the init (kappa ~ 0.02 would make attention nearly uniform)
        for p in mech.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return mech


def lengths_mask(n: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [b,n] True = token


@CAUSAL
@pytest.mark.parametrize("n", [1, 6, 37])
def test_float64_ema_equals_the_recurrence(causal, n):
    ema = perturbed_ema(n)
    x = torch.randn(2, n, 5, dtype=torch.float64)
    keep = lengths_mask(n, [n, max(1, n - 2)])
    out = ema(x, keep, causal)
    assert out.dtype == torch.float64 and ema.kernel(n, torch.float64).dtype == torch.float64
    torch.testing.assert_close(out, naive_ema(ema, x * keep[..., None], causal), **TOL)


def test_float64_step_and_final_state_continue_the_fft():
    ema = perturbed_ema(1)
    x = torch.randn(2, 11, 5, dtype=torch.float64)
    full = ema(x, causal=True)
    state = ema.final_state(x[:, :4])
    assert state.dtype == torch.float64
    for t in range(4, 11):
        o, state = ema.step(x[:, t], state)
        assert o.dtype == state.dtype == torch.float64
        torch.testing.assert_close(o, full[:, t], **TOL)
    torch.testing.assert_close(ema.final_state(x), state, **TOL)


def test_float32_inputs_keep_the_float32_ema():
    """The official precision for float32 (and half) inputs: the kernel stays float32."""
    torch.manual_seed(0)
    ema = DampedEMA(3, 2)
    x = torch.randn(1, 7, 3)
    assert ema(x).dtype == torch.float32 and ema.kernel(7).dtype == torch.float32
    o, h = ema.step(x[:, 0])
    assert o.dtype == h.dtype == torch.float32
    o, h = ema.step(x[:, 0].bfloat16())
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32  # the state keeps float32


@pytest.mark.parametrize("spec", SPECS)
@CAUSAL
@pytest.mark.parametrize("n", [1, 13])
def test_float64_mechanism_matches_the_naive_reference(spec, causal, n):
    mech = build(spec)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(3))
    key_mask = lengths_mask(n, [n, max(1, n // 2)])
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, amap = naive_mega(mech, v, key_mask, causal, laplace=exact_laplace)
    assert res.out.dtype == torch.float64
    torch.testing.assert_close(res.out, ref, **TOL)
    assert res.probs is not None
    torch.testing.assert_close(res.probs, amap[:, None].expand(B, H, n, n), **TOL)


@pytest.mark.parametrize("spec", [SPECS[1], SPECS[3]])
@CAUSAL
def test_float64_gradcheck(spec, causal):
    """Finite differences agree with the backward (the EMA's hand-written FFT backward and
    the checkpointed gates included), which needs float64 all the way through."""
    mech = build(spec, seed=2)
    v = torch.randn(B, H, 9, D, dtype=torch.float64, requires_grad=True)
    ctx = attnlab.AttnContext(key_mask=lengths_mask(9, [9, 5]), causal=causal)
    assert torch.autograd.gradcheck(lambda v: mech(v, v, v, ctx).out, (v,))
