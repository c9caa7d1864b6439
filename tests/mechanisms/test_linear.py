"""linear_elu: the O(n) paths against a naive quadratic reference.

Tolerances: fp32 at 1e-5 (same sums, different order); bf16 vs fp32 at 2e-2 (inputs
rounded to bf16 before the fp32 accumulation).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab.core import RegistryError, causal_mask, resolve_config

H, D = 3, 8


def naive_linear(q, k, v, key_mask=None, causal=False, eps=1e-6):
    """Quadratic form: A = phi(q) phi(k)^T masked, out = A v / (A 1 + eps)."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    a = fq @ fk.transpose(-1, -2)  # [b,h,n,m]
    n, m = a.shape[-2:]
    if causal:
        a = a * causal_mask(n, m)
    if key_mask is not None:
        a = a * key_mask[:, None, None, :]
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def build(spec="linear_elu"):
    return attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, None)).eval()


def rand(b, n, m, seed=0, dv=D):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, H, n, D, generator=g),
        torch.randn(b, H, m, D, generator=g),
        torch.randn(b, H, m, dv, generator=g),
    )


def lengths_mask(lengths, m):
    return torch.arange(m)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", ["linear_elu", "linear_elu(chunk=4)", "linear_elu(chunk=1)"])
def test_matches_naive_with_padding(causal, spec):
    mech = build(spec)
    q, k, v = (t.requires_grad_() for t in rand(3, 23, 23, dv=5))
    key_mask = lengths_mask([23, 11, 2], 23)
    c = attnlab.AttnContext(key_mask=key_mask, causal=causal)
    out = mech(q, k, v, c).out
    ref = naive_linear(q, k, v, key_mask, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,m", [(7, 19), (19, 7), (1, 9), (9, 1), (130, 130)])
@pytest.mark.parametrize("causal", [False, True])
def test_unequal_lengths_and_chunk_boundaries(n, m, causal):
    # causal with n != m aligns queries to the last n keys (as core.reference does)
    mech = build("linear_elu(chunk=8)")
    q, k, v = rand(2, n, m, seed=n * 100 + m)
    out = mech(q, k, v, attnlab.AttnContext(causal=causal)).out
    torch.testing.assert_close(out, naive_linear(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)


def test_chunk_size_does_not_change_the_result():
    q, k, v = rand(2, 70, 70, seed=3)
    c = attnlab.AttnContext(causal=True)
    outs = [build(f"linear_elu(chunk={cs})")(q, k, v, c).out for cs in (1, 7, 64, 500)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_weights_are_the_normalised_kernel_matrix(causal):
    mech = build()
    q, k, v = rand(2, 13, 13, seed=5)
    key_mask = lengths_mask([13, 6], 13)
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    assert res.probs.shape == (2, H, 13, 13)
    assert (res.probs >= 0).all()
    assert (res.probs[1, :, :, 6:] == 0).all()  # padded keys carry no weight
    if causal:
        assert (res.probs.triu(1) == 0).all()
    torch.testing.assert_close(res.probs @ v, res.out, atol=1e-5, rtol=1e-5)
    # rows sum to 1 up to eps / (row sum), far below 1e-4 for these magnitudes
    torch.testing.assert_close(res.probs.sum(-1), torch.ones(2, H, 13), atol=1e-4, rtol=0)


def test_eps_enters_the_denominator():
    q, k, v = rand(1, 5, 5, seed=7)
    out = build("linear_elu(eps=10.0)")(q, k, v, attnlab.AttnContext()).out
    torch.testing.assert_close(out, naive_linear(q, k, v, eps=10.0), atol=1e-5, rtol=1e-5)


def test_bf16_accumulates_in_fp32():
    q, k, v = rand(2, 300, 300, seed=9)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    c = attnlab.AttnContext(causal=True)
    out = build()(qb, kb, vb, c).out
    assert out.dtype == torch.bfloat16
    ref = naive_linear(qb.float(), kb.float(), vb.float(), causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_spec_strings_parse_and_validate():
    cfg = resolve_config("linear_elu(eps=1e-5, chunk=16)")
    assert (cfg.eps, cfg.chunk) == (1e-5, 16)
    assert resolve_config(cfg.spec()) == cfg
    assert resolve_config("linear_elu").eps == 1e-6
    with pytest.raises(RegistryError, match="eps must be > 0"):
        resolve_config("linear_elu(eps=0)")
    with pytest.raises(RegistryError, match="chunk"):
        resolve_config("linear_elu(chunk=0)")
    with pytest.raises(RegistryError, match="did you mean 'eps'"):
        resolve_config("linear_elu(esp=1e-3)")


def test_caps():
    caps = attnlab.core.mechanism_class("linear_elu").caps
    assert (caps.family, caps.exact, caps.complexity) == ("linear", False, "O(n*d^2)")
    assert caps.causal_ok and caps.key_mask_ok
