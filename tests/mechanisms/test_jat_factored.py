"""Jump Self-attention without [b, h, n, n] tensors kept for the backward: the factored
path (S~ = Q~ K~^T through SDPA, or query rows in checkpointed chunks with dropout on J),
A_hat kept sparse or as the identity, and the no-link test that skips the sort.

Tolerances: jump-link counts and the no-link decision are exact (the naive n^3 counts are
the oracle); A_hat in its sparse and identity forms equals the dense one bit for bit (the
same values, stored otherwise); whole-head outputs and gradients against the naive
reference of test_jat.py: fp32, atol = rtol = 1e-5 (reassociated matmuls and SDPA).
"""

from __future__ import annotations

import pytest
import torch
from saved import kept_for_backward
from test_jat import TOL, build, lengths_mask, naive_jat, qkv

import attnlab
from attnlab.mechanisms import _jat_adjacency as adj
from attnlab.mechanisms import _rowchunks
from attnlab.mechanisms import jat as jat_module
from attnlab.mechanisms._jat_adjacency import (
    jump_counts,
    jump_strength,
    key_length,
    may_link,
    naive_jump_counts,
)
from attnlab.mechanisms.jat import JATConfig, head_adjacency, jat_adjacency


def mixed_heads(b=2, h=3, n=20, d=8, seed=0):
    """q, k, v where head 0 has jump links at rho = 0.3 and the others (scaled down) none."""
    q, k, v = qkv(b, h, n, d, seed=seed, scale=1.5)
    small = torch.ones(1, h, 1, 1)
    small[:, 1:] = 0.05
    return q * small, k * small, v


# ------------------------------------------------------------------ no-link test (exact)


def test_may_link_is_false_only_without_links():
    """Against the naive counts, over random heads of every scale and both signs."""
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        scale = [0.05, 0.3, 0.6, 1.0][seed % 4]
        q, k = (torch.randn(1, 1, 11, 4, generator=g) * scale for _ in range(2))
        s, lk = q @ k.transpose(-1, -2), key_length(k)
        for rho, sign in [(0.3, False), (0.3, True), (0.05, False), (-0.1, False)]:
            linked = bool(naive_jump_counts(s, lk, 4, rho, sign).any())
            assert may_link(s, lk, 4, rho, sign) or not linked  # never misses a link
            if rho <= 0:
                assert may_link(s, lk, 4, rho, sign)


def test_may_link_keeps_a_link_exactly_at_the_threshold():
    """rho = U(max, max) exactly: that one pair (i = j) links, so the sort must run."""
    s = torch.tensor([[[0.5, -0.25], [0.125, 0.0625]]])  # [1, 2, 2] scores
    lk = torch.ones(1, 2)
    rho = float(jump_strength(s[0, 0, 0], s[0, 0, 0], lk[0, 0], 2, False))
    assert naive_jump_counts(s, lk, 2, rho).sum() == 1
    assert may_link(s, lk, 2, rho)
    assert not may_link(s, lk, 2, rho * (1 + 1e-6))
    assert torch.equal(jump_counts(s, lk, 2, rho).long(), naive_jump_counts(s, lk, 2, rho))


@pytest.mark.parametrize("method", ["auto", "pairs", "enumerate"])
def test_counts_or_none_is_none_exactly_when_no_head_links(method):
    """None (nothing counted or allocated) only without links, at the threshold too;
    otherwise the counts themselves."""
    from attnlab.mechanisms._jat_adjacency import jump_counts_or_none

    s = torch.tensor([[[0.5, -0.25], [0.125, 0.0625]]])  # [1, 2, 2] scores
    lk = torch.ones(1, 2)
    rho = float(jump_strength(s[0, 0, 0], s[0, 0, 0], lk[0, 0], 2, False))
    got = jump_counts_or_none(s, lk, 2, rho, method=method)
    assert got is not None and torch.equal(got.long(), naive_jump_counts(s, lk, 2, rho))
    assert jump_counts_or_none(s, lk, 2, rho * (1 + 1e-6), method=method) is None
    for seed in range(12):
        q, k, _ = qkv(2, 2, 11, 4, seed=seed, scale=[0.05, 0.6, 1.0][seed % 3])
        s, lk = q @ k.transpose(-1, -2), key_length(k)
        for rho, sign in [(0.3, False), (0.3, True)]:
            ref = naive_jump_counts(s, lk, 4, rho, sign)
            got = jump_counts_or_none(s, lk, 4, rho, sign, method=method)
            assert (got is None) == (not ref.any())
            assert got is None or torch.equal(got.long(), ref)


def test_may_link_ignores_nan_scores():
    """NaN counts as 0 (the official rule); a NaN must not hide a column's linking value."""
    q, k, _ = qkv(1, 1, 9, 4, seed=2, scale=1.5)
    s, lk = q @ k.transpose(-1, -2), key_length(k)
    s[0, 0, :, 3] = float("nan")
    s[0, 0, 5, 3] = 0.0
    assert may_link(s, lk, 4, 0.3) == bool(naive_jump_counts(s, lk, 4, 0.3).any())


def test_unlinked_heads_are_not_sorted(monkeypatch):
    """Heads without links skip the sort; the counts still equal the naive ones."""
    calls = []
    boundaries = adj._boundaries
    monkeypatch.setattr(adj, "_boundaries", lambda *a: calls.append(1) or boundaries(*a))
    monkeypatch.setattr(adj, "_GROUP", 20 * 20)  # one head per group
    q, k, _ = mixed_heads()
    s, lk = q @ k.transpose(-1, -2), key_length(k)
    got = jump_counts(s, lk, 8, 0.3)
    assert torch.equal(got.long(), naive_jump_counts(s, lk, 8, 0.3))
    assert got[:, 0].sum() > 20 and not got[:, 1:].any()
    assert len(calls) == 2  # head 0 of each of the 2 batch rows


# --------------------------------------------------------------- A_hat: dense, sparse, I


@pytest.mark.parametrize("sparse_min_n", [1, 10_000])
@pytest.mark.parametrize("group", [1, 10_000])
@pytest.mark.parametrize("method", ["auto", "naive"])
def test_head_adjacency_equals_the_dense_adjacency(monkeypatch, sparse_min_n, group, method):
    """Sparse (n >= _SPARSE_MIN_N) or dense, one head per group or all, with padding: the
    same values as jat_adjacency on the whole [b, h, n, n] scores; unlinked heads are I."""
    monkeypatch.setattr(jat_module, "_SPARSE_MIN_N", sparse_min_n)
    monkeypatch.setattr(jat_module, "_SPARSE_FRACTION", 1.0)  # head 0 has many links
    monkeypatch.setattr(jat_module, "_GROUP_SCORES", group)
    q, k, _ = mixed_heads()
    key_mask = lengths_mask([20, 13], 20)
    for valid in (None, key_mask):
        cfg = JATConfig(rho=0.3, adjacency=method, mask_pads=valid is not None)
        got = head_adjacency(q, k, cfg, valid)
        assert got.is_sparse == (sparse_min_n == 1)
        got = got.to_dense().view(2, 3, 20, 20)
        vmask = None if valid is None else valid[:, None, :]
        want = jat_adjacency(q @ k.transpose(-1, -2), k, 0.3, False, vmask, method)
        assert torch.equal(got, want)
        assert torch.equal(got[:, 1:], torch.eye(20).expand(2, 2, 20, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sparse_normalisation_is_the_dense_one_bit_for_bit(dtype):
    """A_hat built from the links alone (rows with a link summed densely, the rest 1) has
    the dense normalisation's indices and values exactly, with padding too; None above
    its nonzero budget."""
    from attnlab.mechanisms._jat_adjacency import normalized_adjacency, normalized_adjacency_coo

    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        heads, n = 1 + seed % 3, 1 + (7 * seed) % 37
        counts = ((torch.rand(heads, n, n, generator=g) < 0.08)
                  * torch.randint(1, n + 1, (heads, n, n), generator=g)).int()
        valid = None
        if seed % 2:
            valid = torch.arange(n)[None] < torch.randint(1, n + 1, (heads,), generator=g)[:, None]
            counts *= valid[:, :, None] & valid[:, None, :]
        want = normalized_adjacency(counts, valid, dtype).to_sparse().coalesce()
        got = normalized_adjacency_coo(counts, valid, dtype)
        assert torch.equal(got.indices(), want.indices())
        assert torch.equal(got.values(), want.values())
        assert normalized_adjacency_coo(counts, valid, dtype, want.values().numel() - 1) is None


def test_dense_links_keep_a_dense_adjacency(monkeypatch):
    """Above _SPARSE_FRACTION nonzeros the kept A_hat is dense (COO would be larger)."""
    monkeypatch.setattr(jat_module, "_SPARSE_MIN_N", 1)
    q, k, _ = qkv(1, 2, 16, 8, seed=1, scale=2.0)
    got = head_adjacency(q, k, JATConfig(rho=0.3))
    assert not got.is_sparse and (got != 0).float().mean() > jat_module._SPARSE_FRACTION


# ------------------------------------------------------------------ the whole head


def spec_of(kw: dict) -> str:
    return "jat(" + ", ".join(f"{a}={b!r}" for a, b in kw.items()) + ")"


def assert_naive_values_and_grads(out, q, k, v, key_mask, kw):
    """out and its gradients in q, k, v equal the naive n^3 form's (test_jat.naive_jat)."""
    ref = naive_jat(q, k, v, key_mask=key_mask, **kw)
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(ref, (q, k, v), grad), strict=True):
        torch.testing.assert_close(a, r, **TOL)


@pytest.mark.parametrize("kw", [
    {"rho": 0.3}, {"rho": 0.3, "order": 2, "coef": 0.3}, {"rho": 0.3, "mode": "replace"},
    {"rho": 0.3, "mask_pads": True}, {"rho": 0.3, "sign": True, "coef": 1.5},
])
@pytest.mark.parametrize("sparse", [False, True])
def test_factored_head_matches_naive_forward_and_grads(monkeypatch, kw, sparse):
    """Linked and unlinked heads, padding; A_hat sparse or dense: outputs and gradients."""
    monkeypatch.setattr(jat_module, "_SPARSE_MIN_N", 1 if sparse else 10_000)
    monkeypatch.setattr(jat_module, "_SPARSE_FRACTION", 1.0)
    q, k, v = (t.requires_grad_() for t in mixed_heads(3, 3, 20, 8, seed=4))
    key_mask = lengths_mask([20, 15, 6], 20)
    out = build(spec_of(kw))(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    assert_naive_values_and_grads(out, q, k, v, key_mask, kw)


@pytest.mark.parametrize("kw", [{"rho": 0.3}, {"rho": 0.3, "order": 2, "mode": "replace"}])
def test_chunked_rows_with_dropout_match_naive(monkeypatch, kw):
    """Dropout on J in training takes the row chunks (chunks that do not divide n). A rate
    of 1e-9 keeps every entry (scaled by 1 / (1 - 1e-9)), so the chunks must give the
    formula's outputs and gradients; the path is checked to run."""
    monkeypatch.setattr(_rowchunks, "CHUNK_ELEMS", 3 * 3 * 7 * 20)
    chunks = []
    rows = _rowchunks.in_row_chunks
    monkeypatch.setattr(jat_module, "in_row_chunks",
                        lambda *a, **k: chunks.append(1) or rows(*a, **k))
    q, k, v = (t.requires_grad_() for t in mixed_heads(3, 3, 20, 8, seed=6))
    key_mask = lengths_mask([20, 15, 6], 20)
    mech = build(spec_of(kw)).train()
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, dropout=1e-9)).out
    assert chunks
    assert_naive_values_and_grads(out, q, k, v, key_mask, kw)


def test_chunked_rows_redraw_the_same_dropout_in_the_backward(monkeypatch):
    """Real dropout: the checkpoints' recomputation redraws each chunk's masks, so the
    gradients equal those of the same chunks run without checkpoints (same seed)."""
    monkeypatch.setattr(_rowchunks, "CHUNK_ELEMS", 2 * 3 * 5 * 16)
    q, k, v = qkv(2, 3, 16, 8, seed=8, scale=1.5)
    mech = build("jat(rho=0.3)").train()
    ctx = attnlab.AttnContext(dropout=0.3)
    results = []
    for grad_mode in (True, False):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        monkeypatch.setattr(_rowchunks, "checkpoint",
                            _rowchunks.checkpoint if grad_mode else
                            lambda fn, *a, **kw: fn(*a))
        torch.manual_seed(3)
        out = mech(qq, kk, vv, ctx).out
        results.append((out, torch.autograd.grad(out.square().sum(), (qq, kk, vv))))
    (out_a, g_a), (out_b, g_b) = results
    assert torch.equal(out_a, out_b)
    for a, b in zip(g_a, g_b, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scale, budget", [(0.05, 0.2), (1.5, 1.2)])
def test_training_keeps_no_score_tensor(scale, budget):
    """What autograd keeps (unique storages) at n = 512, as a fraction of one [b, h, n, n]
    float32 tensor: without links (A_hat = I, sparse) under 0.2; with links (A_hat dense)
    A_hat and little more. The dense form kept several."""
    n = 512
    q, k, v = (t.requires_grad_() for t in qkv(2, 3, n, 8, seed=9, scale=scale))

    mech = build("jat(rho=0.3)").train()
    with kept_for_backward() as kept:
        out = mech(q, k, v, attnlab.AttnContext()).out
    assert kept.bytes < budget * 2 * 3 * n * n * 4
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_a_dense_adjacency(monkeypatch, dtype):
    """torch has no sparse x dense bmm for 16-bit floats on the CPU: A_hat stays dense there
    and the head runs, forward and backward, close to its float32 result (5e-2: 16-bit
    rounding of scores up to about 10 moves the softmax by a few of its ulps, 2^-8)."""
    monkeypatch.setattr(jat_module, "_SPARSE_MIN_N", 1)
    q, k, v = mixed_heads(2, 3, 20, 8, seed=11)
    assert not head_adjacency(q.to(dtype), k.to(dtype), JATConfig(rho=0.3)).is_sparse
    q16 = q.to(dtype).requires_grad_()
    out = build("jat(rho=0.3)")(q16, k.to(dtype), v.to(dtype), attnlab.AttnContext()).out
    out.float().sum().backward()
    assert q16.grad is not None and torch.isfinite(q16.grad.float()).all()
    ref = build("jat(rho=0.3)")(q, k, v, attnlab.AttnContext()).out
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)
