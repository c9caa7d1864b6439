"""linear, linear_elu, linear_relu: the O(n) paths against a naive quadratic reference and
the token-by-token recurrence; every mechanism of linear.py (performer too) in a BERT plan.

Tolerances: fp32 at 1e-5 (same sums, different order); bf16 vs fp32 at 2e-2 (inputs
rounded to bf16 before the fp32 accumulation); relu gradients at 1e-4 (see the test);
aliases equal their ``linear`` form exactly
(one implementation).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plan_step import train_one_step

import attnlab
from attnlab.core import RegistryError, causal_mask, resolve_config

H, D = 3, 8


PHI = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu}


def naive_linear(q, k, v, key_mask=None, causal=False, eps=1e-6, feature_map="elu"):
    """Quadratic form: A = phi(q) phi(k)^T masked, out = A v / (A 1 + eps)."""
    fq, fk = PHI[feature_map](q), PHI[feature_map](k)
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


# ------------------------------------------------------- linear(feature_map=...), linear_relu


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec,feature_map", [
    ("linear", "elu"), ("linear(feature_map='relu', chunk=4)", "relu"),
    ("linear_relu", "relu"), ("linear_relu(chunk=1)", "relu"),
])
def test_feature_maps_match_naive_with_padding(spec, feature_map, causal):
    """Outputs to 1e-5; gradients to 1e-5 (elu) or 1e-4 (relu: a row whose relu features
    nearly vanish has a tiny normaliser that amplifies fp32 rounding; measured 1.1e-5)."""
    mech = build(spec)
    q, k, v = (t.requires_grad_() for t in rand(3, 23, 23, seed=11, dv=5))
    key_mask = lengths_mask([23, 11, 2], 23)
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal)).out
    ref = naive_linear(q, k, v, key_mask, causal, feature_map=feature_map)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    tol = 1e-5 if feature_map == "elu" else 1e-4
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, atol=tol, rtol=tol)


@pytest.mark.parametrize("alias,full", [
    ("linear_elu(eps=1e-3, chunk=5)", "linear(feature_map='elu', eps=1e-3, chunk=5)"),
    ("linear_relu(eps=1e-3, chunk=5)", "linear(feature_map='relu', eps=1e-3, chunk=5)"),
])
@pytest.mark.parametrize("causal", [False, True])
def test_aliases_equal_linear(alias, full, causal):
    q, k, v = rand(2, 17, 17, seed=4)
    c = attnlab.AttnContext(key_mask=lengths_mask([17, 8], 17), causal=causal,
                            need_weights=True)
    a, b = build(alias)(q, k, v, c), build(full)(q, k, v, c)
    assert torch.equal(a.out, b.out) and torch.equal(a.probs, b.probs)


@pytest.mark.parametrize("spec", ["linear", "linear_relu", "linear_elu(chunk=4)"])
def test_causal_form_equals_the_recurrence(spec):
    """Causal linear attention is an RNN: S_i = S_{i-1} + phi(k_i) v_i^T,
    z_i = z_{i-1} + phi(k_i), out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps), stepped token
    by token, equals the parallel (chunked prefix-sum) causal output to 1e-5."""
    mech = build(spec)
    phi = PHI[mech.cfg.feature_map]
    q, k, v = rand(2, 23, 23, seed=8, dv=5)
    key_mask = lengths_mask([23, 14], 23)
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=True)).out
    fq, fk = phi(q), phi(k) * key_mask[:, None, :, None]  # [b,h,n,d]
    s = torch.zeros(2, H, D, 5)  # S_0 [b,h,d,dv]
    z = torch.zeros(2, H, D)  # z_0 [b,h,d]
    steps = []
    for i in range(23):
        s = s + fk[:, :, i, :, None] * v[:, :, i, None, :]  # S_i
        z = z + fk[:, :, i]  # z_i
        num = torch.einsum("bhd,bhde->bhe", fq[:, :, i], s)  # [b,h,dv]
        den = torch.einsum("bhd,bhd->bh", fq[:, :, i], z)  # [b,h]
        steps.append(num / (den[..., None] + mech.cfg.eps))
    torch.testing.assert_close(out, torch.stack(steps, dim=2), atol=1e-5, rtol=1e-5)


def test_linear_specs_validate():
    assert resolve_config("linear").feature_map == "elu"
    cfg = resolve_config("linear(feature_map='relu', eps=1e-4)")
    assert resolve_config(cfg.spec()) == cfg and cfg.spec().startswith("linear(feature_map=")
    assert resolve_config("linear_relu").spec() == "linear_relu(eps=1e-06, chunk=64)"
    with pytest.raises(RegistryError, match=r"feature_map must be one of \['elu', 'relu'\]"):
        resolve_config("linear(feature_map='gelu')")
    with pytest.raises(RegistryError, match="unknown parameter 'feature_map'"):
        resolve_config("linear_relu(feature_map='elu')")  # the alias fixes its map
    with pytest.raises(RegistryError, match="eps must be > 0"):
        resolve_config("linear_relu(eps=-1.0)")
    with pytest.raises(ValueError, match="feature_map must be one of"):
        type(resolve_config("linear"))(feature_map="gelu")  # direct construction checks too


# ------------------------------------------------------------ every linear.py mechanism in BERT


@pytest.mark.parametrize("spec", [
    "linear(feature_map='relu')", "linear_relu", "linear_elu", "performer(num_features=16)",
])
def test_in_a_plan_on_tiny_bert_forward_and_training_step(spec, bert_factory, padded_batch):
    report, out, _ = train_one_step(bert_factory(), [
        {"layers": "all", "heads": [0, 2], "mechanism": spec},
        {"layers": [1], "heads": "all", "mechanism": spec}], padded_batch)
    assert report.table[1] == [resolve_config(spec).spec()] * 4
    assert report.table[0][1] == "softmax"
    assert out.shape == (3, 12, 32)  # [b,n,hidden]

