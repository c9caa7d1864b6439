"""Jump Self-attention: the exact adjacency kernel and the whole head vs naive references.

Tolerances: jump-link counts are integers and must be *equal* (bit for bit, including ties
at the threshold); the official A_hat port is compared exactly as well. Whole-head outputs
and gradients vs the naive n^3 implementation: fp32, atol = rtol = 1e-5 (float
reassociation of J only). c = 0 vs the softmax mechanism and vs the unmodified model: exact
(torch.equal); vs the reference attention: the fp32 tolerance above.
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnlab
from attnlab.mechanisms._jat_adjacency import (
    jump_counts,
    key_length,
    link_census,
    naive_adjacency,
    naive_jump_counts,
    normalized_adjacency,
)
from attnlab.mechanisms.jat import (
    JATConfig,
    jat_probsparse_scores,
    probsparse_generator,
    probsparse_sample,
    probsparse_sizes,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32, reassociated matmuls only


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv(b=2, h=3, n=13, d=8, seed=0, scale=1.0):
    g = gen(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) * scale for _ in range(3))


def lengths_mask(lengths, n):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def build(spec: str, h: int = 3, d: int = 8):
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, d, 128)).eval()


# ------------------------------------------------------------------ naive reference (n^3)


def naive_counts(s, k, rho, sign, valid):
    """Official get_attn_adj up to the mean, with padding as mask_pads defines it."""
    x = torch.where(torch.isnan(s), torch.zeros_like(s), s)
    len_key = torch.clamp_min(torch.linalg.vector_norm(k, dim=-1), 1.0)  # [.., n]
    u = torch.einsum("...yk,...zk->...kyz", x, x) / len_key[..., :, None, None]
    if sign:
        neg = (x < 0).int()
        u[torch.einsum("...yk,...zk->...kyz", neg, neg).bool()] = 0
    u = u / k.shape[-1]
    links = (u >= rho).long()  # B_k [.., k, n, n]
    if valid is not None:
        vk = valid[..., :, None, None] & valid[..., None, :, None] & valid[..., None, None, :]
        links = links * vk
    return links.sum(-3)


def naive_a_hat(s, k, rho, sign, valid):
    n = s.shape[-1]
    counts = naive_counts(s, k, rho, sign, valid)
    denom = n if valid is None else valid.sum(-1)[..., None, None].clamp_min(1)
    a = counts.float() / denom
    a = a + torch.diag_embed(1 - torch.diagonal(a, dim1=-2, dim2=-1))  # diag(A) = 1
    deg = a.sum(-1).clamp_min(1e-4)
    dinv = deg.rsqrt()
    return dinv[..., :, None] * a * dinv[..., None, :]


def naive_phi(a, q, k, order):
    x1 = a @ q @ k.transpose(-1, -2) @ a.transpose(-1, -2)  # official order
    total = x1
    for _ in range(1, order):
        x1 = a @ x1 @ a.transpose(-1, -2)
        total = total + x1
    return total


def naive_jat(q, k, v, *, rho, coef=0.5, order=1, sign=False, mode="mix", key_mask=None,
              mask_pads=False):
    """Steps 1-7 literally (no dropout)."""
    s = q @ k.transpose(-1, -2)
    valid = key_mask[:, None, :] if (mask_pads and key_mask is not None) else None
    a = naive_a_hat(s.detach(), k.detach(), rho, sign, valid)
    jump = naive_phi(a, q, k, order)
    mixed = jump if mode == "replace" else s * (1 - coef) + jump * coef
    logits = mixed / q.shape[-1] ** 0.5
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(logits, -1) @ v


# ------------------------------------------------------------------ adjacency kernel


def tie_scores(b, h, n, seed):
    """Scores from a small dyadic set: many products land exactly on the threshold."""
    vals = torch.tensor([-4.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0])
    return vals[torch.randint(0, len(vals), (b, h, n, n), generator=gen(seed))]


def near_tie_scores(n, d, rho, seed):
    """Column k holds values within +-3 ulps of rho*d*len_k / S[0,k]: rounding decides."""
    g = gen(seed)
    x = torch.randn(1, 1, n, n, generator=g) * 3
    lk = torch.rand(1, 1, n, generator=g) * 3 + 1
    target = (rho * d * lk.double() / x[..., 0, :].double()).float()  # [1, 1, k]
    for r in range(1, n):
        steps = torch.randint(-3, 4, target.shape, generator=g)
        v = target.clone()
        for s in range(3):
            v = torch.where(steps > s, torch.nextafter(v, torch.full_like(v, 1e9)), v)
            v = torch.where(steps < -s, torch.nextafter(v, torch.full_like(v, -1e9)), v)
        keep = torch.rand(target.shape, generator=g) < 0.7
        x[..., r, :] = torch.where(keep, v, x[..., r, :])
    return x, lk


@pytest.mark.parametrize("method", ["pairs", "enumerate", "compare", "direct", "auto"])
@pytest.mark.parametrize("sign", [False, True])
@pytest.mark.parametrize("pads", [False, True])
def test_counts_equal_naive_exactly(method, sign, pads):
    for seed, (n, rho, kind) in enumerate([
        (1, 0.5, "rand"), (2, 0.5, "rand"), (17, 0.3, "rand"), (33, 1.0, "rand"),
        (24, -0.25, "rand"), (16, 0.5, "ties"), (21, 0.0, "ties"), (9, -1.0, "ties"),
    ]):
        b, h, d = 2, 2, 4
        q, k, _ = qkv(b, h, n, d, seed=seed, scale=1.5)
        s = q @ k.transpose(-1, -2)
        lk = key_length(k)
        if kind == "ties":
            s, lk = tie_scores(b, h, n, seed), torch.ones(b, h, n)
        valid = lengths_mask([n, max(1, n // 2)], n)[:, None, :] if pads else None
        ref = naive_jump_counts(s, lk, d, rho, sign, valid)
        got = jump_counts(s, lk, d, rho, sign, valid, method)
        assert got.dtype == torch.int32
        assert torch.equal(got.long(), ref), (n, rho, kind)


@pytest.mark.parametrize("method", ["pairs", "enumerate", "compare", "direct"])
@pytest.mark.parametrize("sign", [False, True])
def test_counts_exact_at_last_ulp(method, sign):
    """Values within 3 ulps of the threshold: the real-number cut would get some wrong."""
    for seed, rho in enumerate([0.3, 0.5, 5.0]):
        n, d = 48, 8
        s, lk = near_tie_scores(n, d, rho, seed)
        ref = naive_jump_counts(s, lk, d, rho, sign)
        got = jump_counts(s, lk, d, rho, sign, None, method)
        assert torch.equal(got.long(), ref)
        # the construction does reach decisions that float rounding flips
        a, bb = s[..., :1, :], s[..., 1:, :]
        fp32 = (a * bb / lk[..., None, :] / d) >= rho
        real = (a.double() * bb.double() / lk[..., None, :].double() / d) >= rho
        assert (fp32 != real).any()


@pytest.mark.parametrize("numpy_on_cpu", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cmp_chunk", [700, 6000])
def test_counts_exact_across_dtypes_backends_and_chunks(monkeypatch, numpy_on_cpu, dtype,
                                                        cmp_chunk):
    """The torch path (other devices, bf16), numpy's, and tiny chunks (``_ENUM_CHUNK`` also
    cuts the candidate pairs): same integers.
    cmp_chunk 700 < 14^3: row blocks of one head; 6000: blocks of 2 whole heads (for the
    compare and the direct counters alike)."""
    from attnlab.mechanisms import _jat_adjacency as adj

    monkeypatch.setattr(adj, "_NUMPY_ON_CPU", numpy_on_cpu)
    monkeypatch.setattr(adj, "_GROUP", 300)  # a few heads per group
    monkeypatch.setattr(adj, "_ENUM_CHUNK", 50)  # many listing chunks
    monkeypatch.setattr(adj, "_CMP_CHUNK", cmp_chunk)
    monkeypatch.setattr(adj, "_DIRECT_CHUNK", cmp_chunk)
    q, k, _ = qkv(2, 3, 14, 4, seed=21, scale=1.5)
    s, lk = (q @ k.transpose(-1, -2)).to(dtype), key_length(k).to(dtype)
    valid = lengths_mask([14, 9], 14)[:, None, :]
    for rho, sign in [(0.5, False), (0.25, True), (-0.5, True)]:
        ref = naive_jump_counts(s, lk, 4, rho, sign, valid)
        for method in ("pairs", "enumerate", "compare", "direct"):
            assert torch.equal(jump_counts(s, lk, 4, rho, sign, valid, method).long(), ref)


@pytest.mark.parametrize("sign", [False, True])
def test_compare_counts_the_upper_triangle_exactly(monkeypatch, sign):
    """``compare`` compares only j >= i and mirrors: row blocks that grow as the columns
    left shrink (2 rows first, then more), padding rows and columns, dense and sparse links:
    the naive integers, and symmetric."""
    from attnlab.mechanisms import _jat_adjacency as adj

    n = 29
    monkeypatch.setattr(adj, "_CMP_CHUNK", 2 * n * n)
    q, k, _ = qkv(2, 2, n, 8, seed=41, scale=1.5)
    s, lk = q @ k.transpose(-1, -2), key_length(k)
    valid = lengths_mask([n, 20], n)[:, None, :]
    for rho in (0.01, 0.5, 3.0):
        for v in (None, valid):
            ref = naive_jump_counts(s, lk, 8, rho, sign, v)
            got = jump_counts(s, lk, 8, rho, sign, v, "compare")
            assert torch.equal(got.long(), ref), (rho, v is None)
            assert torch.equal(got, got.transpose(-1, -2))


@pytest.mark.parametrize("d", [12, 48])
def test_counts_exact_when_head_dim_is_not_a_power_of_two(d):
    """1/d is inexact here, so the division by d must round the same way on both paths."""
    for seed, rho in enumerate([0.3, 0.7]):
        q, k, _ = qkv(2, 2, 20, d, seed=30 + seed, scale=1.2)
        s, lk = q @ k.transpose(-1, -2), key_length(k)
        ns, nlk = near_tie_scores(24, d, rho, seed)
        for sign in (False, True):
            for method in ("pairs", "enumerate", "compare", "direct"):
                ref = naive_jump_counts(s, lk, d, rho, sign)
                assert torch.equal(jump_counts(s, lk, d, rho, sign, None, method).long(), ref)
                ref = naive_jump_counts(ns, nlk, d, rho, sign)
                assert torch.equal(jump_counts(ns, nlk, d, rho, sign, None, method).long(), ref)


def test_auto_counts_candidate_pairs_when_sparse_else_sorted_ranges(monkeypatch):
    """Sparse links: ``auto`` decides them on candidate pairs and sorts nothing; with the
    pair budget at 0 it takes the sorted ranges; the same integers both ways."""
    from attnlab.mechanisms import _jat_adjacency as adj

    sorted_calls = []
    boundaries = adj._boundaries
    monkeypatch.setattr(adj, "_boundaries",
                        lambda *a: sorted_calls.append(1) or boundaries(*a))
    q, k, _ = qkv(2, 3, 40, 8, seed=7, scale=1.5)
    s, lk = q @ k.transpose(-1, -2), key_length(k)
    for rho, sign in [(5.0, False), (4.0, True)]:
        ref = naive_jump_counts(s, lk, 8, rho, sign)
        assert 0 < int(ref.sum()) < 0.01 * ref.numel() * 40  # sparse (< 1% of triples)
        sorted_calls.clear()
        assert torch.equal(jump_counts(s, lk, 8, rho, sign).long(), ref)
        assert not sorted_calls
        assert link_census(s[0, 0], lk[0, 0], 8, rho, sign)[1] == "pairs"
        monkeypatch.setattr(adj, "_PAIRS_PER_SCORE", 0.0)
        assert torch.equal(jump_counts(s, lk, 8, rho, sign).long(), ref)
        assert sorted_calls
        assert link_census(s[0, 0], lk[0, 0], 8, rho, sign)[1] in ("enumerate", "compare")
        monkeypatch.setattr(adj, "_PAIRS_PER_SCORE", 2.0)


@pytest.mark.parametrize("method", ["pairs", "auto", "enumerate"])
def test_counts_exact_when_products_overflow_or_rho_is_subnormal(method):
    """float16: S[i,k] S[j,k] past 65504 rounds to inf, a link that the real numbers deny;
    a rho below the smallest normal float32 is not bounded per column. Both as naive."""
    n, d, rho = 12, 64, 5.0
    g = gen(3)
    s = (torch.rand(1, 1, n, n, generator=g) * 40 + 240) * torch.where(
        torch.rand(1, 1, n, n, generator=g) < 0.5, -1.0, 1.0)
    s, lk = s.half(), torch.full((1, 1, n), 300.0).half()  # rho d len_k = 96000 > 65504
    ref = naive_jump_counts(s, lk, d, rho)
    real = (s.double()[..., :, None, :] * s.double()[..., None, :, :] / 300 / d) >= rho
    assert int(ref.sum()) > 0 and not real.any()  # every link is an overflow
    assert torch.equal(jump_counts(s, lk, d, rho, False, None, method).long(), ref)
    q, k, _ = qkv(1, 2, 10, 4, seed=4)
    s, lk = (q @ k.transpose(-1, -2)) * 1e-20, key_length(k)
    for tiny_rho in (1e-41, 1e-39):
        ref = naive_jump_counts(s, lk, 4, tiny_rho)
        assert torch.equal(jump_counts(s, lk, 4, tiny_rho, False, None, method).long(), ref)


def test_counts_match_independent_reference_and_official_port():
    q, k, _ = qkv(2, 3, 19, 8, seed=5)
    s = q @ k.transpose(-1, -2)
    lk = key_length(k)
    for rho, sign in [(0.3, False), (0.3, True), (1.0, False)]:
        got = jump_counts(s, lk, 8, rho, sign)
        assert torch.equal(got.long(), naive_counts(s, k, rho, sign, None))
        # normalised A_hat equals the line-by-line port of get_attn_adj exactly
        assert torch.equal(normalized_adjacency(got), naive_adjacency(s, k, rho, sign))
        assert got.sum() > torch.diagonal(got, dim1=-2, dim2=-1).sum()  # off-diagonal links


def test_counts_nan_scores_count_as_zero():
    q, k, _ = qkv(1, 1, 9, 4, seed=2)
    s = q @ k.transpose(-1, -2)
    s[0, 0, 3, 4] = float("nan")
    lk = key_length(k)
    for rho in (0.2, -0.1):
        ref = naive_jump_counts(s, lk, 4, rho)
        assert torch.equal(jump_counts(s, lk, 4, rho).long(), ref)


def test_contract_spec_has_jump_links():
    """jat(rho=0.3) with d=8 random normal inputs (the contract test) does link queries."""
    q, k, _ = qkv(3, 4, 19, 8, seed=0)
    c = jump_counts(q @ k.transpose(-1, -2), key_length(k), 8, 0.3)
    off = c - torch.diag_embed(torch.diagonal(c, dim1=-2, dim2=-1))
    assert (off > 0).float().mean() > 0.2


# ------------------------------------------------------------------ whole head vs naive


@pytest.mark.parametrize(
    "spec, kw",
    [
        ("jat(rho=0.3)", {"rho": 0.3}),
        ("jat(rho=0.3, sign=True)", {"rho": 0.3, "sign": True}),
        ("jat(rho=0.5, coef=0.3, order=2)", {"rho": 0.5, "coef": 0.3, "order": 2}),
        ("jat(rho=0.3, mode='replace')", {"rho": 0.3, "mode": "replace"}),
        ("jat(rho=0.3, mask_pads=True)", {"rho": 0.3, "mask_pads": True}),
        ("jat(rho=0.3, adjacency='compare')", {"rho": 0.3}),
        ("jat(rho=0.3, adjacency='naive')", {"rho": 0.3}),
    ],
)
def test_head_matches_naive_forward_and_grads(spec, kw):
    n = 15
    q, k, v = (t.requires_grad_() for t in qkv(3, 3, n, 8, seed=3))
    key_mask = lengths_mask([15, 11, 6], n)
    mech = build(spec)
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    ref = naive_jat(q, k, v, key_mask=key_mask, **kw)
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn_like(out)
    g_out = torch.autograd.grad(out, (q, k, v), grad)
    g_ref = torch.autograd.grad(ref, (q, k, v), grad)
    for a, r in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, r, **TOL)


def test_coef_zero_is_exactly_softmax():
    """c = 0: bit for bit the `softmax` mechanism (the SDPA path of untouched heads), in
    eval and in training (same dropout draws); the reference to fp32 rounding."""
    q, k, v = qkv(2, 3, 17, 8, seed=4)
    key_mask = lengths_mask([17, 9], 17)
    soft = build("softmax")
    for spec in ("jat(rho=0.3, coef=0.0)", "jat(rho=0.3, coef=0.0, variant='probsparse')"):
        ctx = attnlab.AttnContext(key_mask=key_mask, need_weights=False)
        out = build(spec)(q, k, v, ctx).out
        assert torch.equal(out, soft(q, k, v, ctx).out)
        ref, _ = attnlab.reference_attention(q, k, v, key_mask=key_mask)
        torch.testing.assert_close(out, ref, **TOL)
        ctx = attnlab.AttnContext(key_mask=key_mask, dropout=0.3)
        torch.manual_seed(5)
        trained = build(spec).train()(q, k, v, ctx).out
        torch.manual_seed(5)
        assert torch.equal(trained, soft.train()(q, k, v, ctx).out)
        soft.eval()


def test_coef_zero_bert_jat_model_is_the_pretrained_model():
    """The issue: "with c = 0 the model is exactly the pretrained one" (bit for bit)."""
    from transformers import BertConfig, BertModel

    from attnlab.hf.surgery import apply_plan
    from attnlab.presets import bert_jat

    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=128, vocab_size=100)
    base = BertModel(config).eval()
    ids = torch.randint(5, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    ref = base(input_ids=ids, attention_mask=mask).last_hidden_state
    model = copy.deepcopy(base)
    apply_plan(model, bert_jat(layers=[0, 1, 3], jat_heads=2, coef=0.0))
    out = model.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(out, ref)


def test_mixing_changes_the_output():
    q, k, v = qkv(1, 3, 17, 8, seed=6)
    out = build("jat(rho=0.3)")(q, k, v, attnlab.AttnContext()).out
    ref, _ = attnlab.reference_attention(q, k, v)
    assert (out - ref).abs().max() > 1e-3


def test_order_two_is_two_hops():
    q, k, v = qkv(2, 2, 12, 8, seed=7)
    s = q @ k.transpose(-1, -2)
    a = naive_a_hat(s, k, 0.3, False, None)
    phi1 = a @ s @ a.transpose(-1, -2)
    phi2 = a @ phi1 @ a.transpose(-1, -2)
    logits = (0.5 * s + 0.5 * (phi1 + phi2)) / 8**0.5
    ref = torch.softmax(logits, -1) @ v
    out = build("jat(rho=0.3, order=2)", h=2)(q, k, v, attnlab.AttnContext()).out
    torch.testing.assert_close(out, ref, **TOL)


def test_replace_mode_ignores_raw_scores_weight():
    q, k, v = qkv(2, 2, 12, 8, seed=8)
    a = build("jat(rho=0.3, mode='replace', coef=0.1)", h=2)(q, k, v, attnlab.AttnContext())
    b = build("jat(rho=0.3, mode='replace', coef=0.9)", h=2)(q, k, v, attnlab.AttnContext())
    assert torch.equal(a.out, b.out)


def test_batch_one_dense_and_probsparse():
    q, k, v = qkv(1, 3, 20, 8, seed=9)
    for spec in ("jat(rho=0.3)", "jat(rho=0.3, variant='probsparse')"):
        res = build(spec)(q, k, v, attnlab.AttnContext(need_weights=True))
        assert res.out.shape == (1, 3, 20, 8) and torch.isfinite(res.out).all()
        torch.testing.assert_close(res.probs.sum(-1), torch.ones(1, 3, 20), **TOL)


@pytest.mark.parametrize("extra", ["", ", sign=True", ", order=2"])
def test_mask_pads_padding_is_invisible(extra):
    """Real queries of a padded sequence get exactly the result of the unpadded one."""
    n, real = 16, 10
    q, k, v = qkv(1, 3, n, 8, seed=10)
    mech = build(f"jat(rho=0.3, mask_pads=True{extra})")
    key_mask = lengths_mask([real], n)
    padded = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out[:, :, :real]
    alone = mech(q[:, :, :real], k[:, :, :real], v[:, :, :real], attnlab.AttnContext()).out
    torch.testing.assert_close(padded, alone, **TOL)
    # without mask_pads padding keys take part in A (the official behaviour)
    plain = build(f"jat(rho=0.3{extra})")
    off = plain(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out[:, :, :real]
    assert (off - plain(q[:, :, :real], k[:, :, :real], v[:, :, :real],
                        attnlab.AttnContext()).out).abs().max() > 1e-4


# ------------------------------------------------------------------ probsparse


def naive_probsparse(q, k, v, sample, *, rho, factor=2, coef=0.5, order=1, sign=False):
    """The official _prob_QK + get_attn_adj + _merge path, given the sampled indices."""
    b, h, n, d = q.shape
    _, u = probsparse_sizes(n, factor)
    k_expand = k.unsqueeze(-3).expand(b, h, n, n, d)
    k_sample = k_expand[:, :, torch.arange(n).unsqueeze(1), sample, :]  # [b, h, n, U, d]
    qk = torch.matmul(q.unsqueeze(-2), k_sample.transpose(-2, -1)).squeeze(-2)
    m = qk.max(-1)[0] - torch.div(qk.sum(-1), n)
    top = m.topk(u, sorted=False)[1].sort(-1).values
    bi, hi = torch.arange(b)[:, None, None], torch.arange(h)[None, :, None]
    q_r, k_r = q[bi, hi, top, :], k[bi, hi, top, :]
    x = q_r @ k_r.transpose(-1, -2)
    a = naive_a_hat(x.detach(), k_r.detach(), rho, sign, None)
    phi = naive_phi(a, q_r, k_r, order)
    s = q @ k.transpose(-1, -2)
    full = s.clone()
    full[bi[..., None], hi[..., None], top[..., :, None], top[..., None, :]] = phi
    mixed = s * (1 - coef) + full * coef
    return torch.softmax(mixed / d**0.5, -1) @ v


@pytest.mark.parametrize("kw", [{}, {"order": 2}, {"sign": True, "factor": 3}])
def test_probsparse_matches_naive_given_sample(kw):
    n = 40
    q, k, v = (t.requires_grad_() for t in qkv(2, 3, n, 8, seed=11))
    num, u = probsparse_sizes(n, kw.get("factor", 2))
    assert (num, u) == (min(kw.get("factor", 2) * 4, n),) * 2  # ceil(ln 40) = 4
    sample = probsparse_sample(n, num, gen(0))
    cfg = JATConfig(rho=0.3, variant="probsparse", **kw)
    s = q @ k.transpose(-1, -2)
    mixed = jat_probsparse_scores(q, k, s, sample, cfg)
    out = torch.softmax(mixed / 8**0.5, -1) @ v
    ref = naive_probsparse(q, k, v, sample, rho=0.3, **kw)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, **TOL)
    # outside the u x u block the scores are untouched: (1 - c) S + c S
    changed = (mixed - s).abs().detach() > 1e-5
    assert changed.sum(-1).gt(0).sum(-1).le(u).all()


def test_probsparse_sampling_is_seeded_and_eval_deterministic():
    n, layer = 30, 4
    q, k, v = qkv(2, 3, n, 8, seed=12)
    mech = build("jat(rho=0.3, variant='probsparse', seed=7)")
    ctx = attnlab.AttnContext(layer_idx=layer)
    out = mech(q, k, v, ctx).out
    assert torch.equal(out, mech(q, k, v, ctx).out)  # eval: same sample every call
    num, _ = probsparse_sizes(n, 2)
    sample = probsparse_sample(n, num, probsparse_generator(7, layer, n))  # documented rule
    assert torch.equal(mech.sample(n, layer), sample)
    s = q @ k.transpose(-1, -2)
    mixed = jat_probsparse_scores(q, k, s, sample, mech.cfg)
    torch.testing.assert_close(out, torch.softmax(mixed / 8**0.5, -1) @ v, **TOL)
    # training draws afresh each call, through the global RNG: the run's seed fixes them
    mech.train()
    torch.manual_seed(0)
    first, second = mech.sample(n, layer), mech.sample(n, layer)
    assert not torch.equal(first, second)
    torch.manual_seed(0)
    fresh = build("jat(rho=0.3, variant='probsparse', seed=7)").train()
    assert torch.equal(fresh.sample(n, layer), first)
    torch.manual_seed(0)
    assert not torch.equal(fresh.sample(n, layer + 1), first)  # per layer
    # sample_in_eval keeps drawing at eval (official behaviour)
    drawing = build("jat(rho=0.3, variant='probsparse', seed=7, sample_in_eval=True)")
    torch.manual_seed(0)
    assert torch.equal(drawing.sample(n, layer), first)


def test_probsparse_mask_pads_ignores_pad_content():
    n = 24
    q, k, v = qkv(2, 3, n, 8, seed=13)
    key_mask = lengths_mask([24, 13], n)
    mech = build("jat(rho=0.3, variant='probsparse', mask_pads=True)")
    out1 = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    pad = ~key_mask[:, None, :, None]
    g = gen(1)
    q2, k2, v2 = (torch.where(pad, torch.randn(t.shape, generator=g) * 10, t) for t in (q, k, v))
    out2 = mech(q2, k2, v2, attnlab.AttnContext(key_mask=key_mask)).out
    real = key_mask[:, None, :, None].expand_as(out1)
    torch.testing.assert_close(out1[real], out2[real], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ training, errors


def test_dropout_on_jump_scores_only_in_training():
    q, k, v = qkv(2, 3, 14, 8, seed=14)
    mech = build("jat(rho=0.3)")
    ctx = attnlab.AttnContext(dropout=0.3)
    assert torch.equal(mech(q, k, v, ctx).out, mech(q, k, v, attnlab.AttnContext()).out)
    mech.train()
    torch.manual_seed(0)
    a = mech(q, k, v, ctx).out
    torch.manual_seed(1)
    assert not torch.equal(a, mech(q, k, v, ctx).out)


def test_no_trainable_parameters():
    assert list(build("jat()").parameters()) == []


def test_clear_errors():
    q, k, v = qkv(1, 3, 6, 8)
    mech = build("jat(rho=0.3)")
    with pytest.raises(ValueError, match="causal"):
        mech(q, k, v, attnlab.AttnContext(causal=True))
    with pytest.raises(ValueError, match="as many queries as keys"):
        mech(q[:, :, :4], k, v, attnlab.AttnContext())
    with pytest.raises(Exception, match="order"):
        build("jat(order=0)")
    with pytest.raises(Exception, match="mode"):
        build("jat(mode='sum')")
    with pytest.raises(ValueError, match="square"):
        jump_counts(torch.zeros(2, 3), torch.ones(3), 4, 0.5)


# ------------------------------------------------------------------ benchmark smoke test


def test_bench_measure_and_table_smoke():
    from attnlab.bench.jat import format_markdown, measure, naive_peak_gb

    row = {"n": 16, "form": "efficient", "note": "",
           **measure("efficient", 16, batch=1, heads=2, head_dim=8, repeats=1, rho=0.3)}
    assert row["fwd_ms"] > 0 and 0 < row["link_fraction"] < 1
    skipped = {"n": 2048, "form": "naive", "note": "skipped", "fwd_ms": None,
               "fwdbwd_ms": None, "peak_fwd_mb": None, "peak_mem_mb": None}
    table = format_markdown([skipped, {**row, "fwd_speedup": None, "fwdbwd_speedup": None,
                                       "mem_ratio": None}])
    assert table.count("\n") == 4 and "| 16 | efficient |" in table
    assert naive_peak_gb(128, 8, 6) == pytest.approx(0.805, rel=0.01)
