"""Contract tests: every registered mechanism, looped from the registry.

Tolerances: fp32 comparisons at 1e-5 (outputs/gradients vs the reference) and 1e-6
(invariances that should hold up to float reordering); bf16 runs only checked finite.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.core import mechanism_class

NAMES = attnlab.list_mechanisms()

B, H, D, MAXLEN = 3, 4, 8, 64


def spec(name: str) -> str:
    """The mechanism's own small setting (``example`` on its class: a pattern genuinely
    sparse at the test lengths), so a new mechanism joins these tests with no edit here."""
    return mechanism_class(name).example


@pytest.mark.parametrize("name", NAMES)
def test_declares_an_example(name):
    cls = mechanism_class(name)
    example = getattr(cls, "example", None)
    assert isinstance(example, str) and example, (
        f"{cls.__name__} ({name!r}) must declare example: ClassVar[str], a small spec such "
        f"as {name + '(...)'!r} that the contract tests build it from"
    )
    assert attnlab.core.parse_spec(example)[0] == name, f"{name}'s example names another mechanism"


def build(name: str, h: int = H):
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(spec(name), attnlab.HeadDims(h, D, MAXLEN))
    return mech.eval()


def qkv(n: int, m: int | None = None, dtype=torch.float32, seed: int = 0, b: int = B):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.randn(b, H, n, D, generator=g).to(dtype)
    k = torch.randn(b, H, m, D, generator=g).to(dtype)
    v = torch.randn(b, H, m, D, generator=g).to(dtype)
    return q, k, v


def ctx(**kw):
    kw.setdefault("state", {})
    return attnlab.AttnContext(**kw)


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_caps_and_config(name):
    cls = mechanism_class(name)
    assert cls.caps.scope in ("head", "layer", "module")
    assert cls.config_cls.name == name
    assert cls.__doc__ and len(cls.__doc__) > 40, "docstring must cite the paper and formula"
    # the spec round-trips through the config
    cfg = attnlab.core.resolve_config(spec(name))
    assert attnlab.core.resolve_config(cfg.spec()) == cfg


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 19])
def test_shapes(name, n):
    mech = build(name)
    q, k, v = qkv(n)
    res = mech(q, k, v, ctx(need_weights=True))
    assert res.out.shape == (B, H, n, D)
    assert torch.isfinite(res.out).all()
    if res.probs is not None:
        assert res.probs.shape == (B, H, n, n)
    res2 = mech(q, k, v, ctx(need_weights=False))
    torch.testing.assert_close(res2.out, res.out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_key_mask_padding_is_invisible(name):
    mech = build(name)
    if not mech.caps.key_mask_ok:
        pytest.skip(f"{name} declares key_mask_ok=False")
    n = 19
    q, k, v = qkv(n)
    lengths = torch.tensor([19, 12, 5])
    key_mask = torch.arange(n)[None, :] < lengths[:, None]
    out1 = mech(q, k, v, ctx(key_mask=key_mask)).out
    pad = ~key_mask[:, None, :, None]
    k2 = torch.where(pad, torch.randn_like(k) * 10, k)
    v2 = torch.where(pad, torch.randn_like(v) * 10, v)
    out2 = mech(q, k2, v2, ctx(key_mask=key_mask)).out
    real = key_mask[:, None, :, None].expand_as(out1)
    torch.testing.assert_close(out1[real], out2[real], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_batch_order_invariance(name):
    mech = build(name)
    n = 17
    q, k, v = qkv(n)
    key_mask = torch.arange(n)[None, :] < torch.tensor([17, 9, 4])[:, None]
    perm = torch.tensor([2, 0, 1])
    out = mech(q, k, v, ctx(key_mask=key_mask)).out
    outp = mech(q[perm], k[perm], v[perm], ctx(key_mask=key_mask[perm])).out
    torch.testing.assert_close(outp, out[perm], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_causal_no_leak(name):
    mech = build(name)
    if not mech.caps.causal_ok:
        pytest.skip(f"{name} declares causal_ok=False")
    n, t = 19, 9
    q, k, v = qkv(n)
    out1 = mech(q, k, v, ctx(causal=True)).out
    fut = (torch.arange(n) > t)[None, None, :, None]
    q2 = torch.where(fut, torch.randn_like(q), q)
    k2 = torch.where(fut, torch.randn_like(k), k)
    v2 = torch.where(fut, torch.randn_like(v), v)
    out2 = mech(q2, k2, v2, ctx(causal=True)).out
    torch.testing.assert_close(out1[:, :, : t + 1], out2[:, :, : t + 1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_finite_gradients(name):
    mech = build(name).train()
    q, k, v = (t.requires_grad_() for t in qkv(19))
    key_mask = torch.arange(19)[None, :] < torch.tensor([19, 10, 3])[:, None]
    res = mech(q, k, v, ctx(key_mask=key_mask))
    loss = res.out.square().sum() + (res.aux_loss if res.aux_loss is not None else 0.0)
    loss.backward()
    _check_reads(mech, q, k, v)
    for p in mech.parameters():
        if p.requires_grad and p.grad is not None:
            assert torch.isfinite(p.grad).all()


def _check_reads(mech, q, k, v) -> None:
    """What ``caps.reads()`` declares read has a finite gradient; the rest none (the host's
    projections of what is not read get no gradient: the runner warns a tuner about it)."""
    read_q, read_k = mech.caps.reads()
    for t, read in ((q, read_q), (k, read_k), (v, True)):
        if read:
            assert t.grad is not None and torch.isfinite(t.grad).all()
        else:
            assert t.grad is None


@pytest.mark.parametrize("spec_, reads", [
    ("synthesizer", (True, False)),  # dense F(q_i) alone: no k
    ("synthesizer(kind='random')", (False, False)),  # the table alone: neither
    ("synthesizer(kind='random', mix=0.5)", (True, True)),
    ("synthesizer(kind='random', learn_mix=True)", (True, True)),  # alpha may leave 1
    # (it starts at 1: q and k get gradient 0, not None)
])
def test_reads_follow_the_config(spec_, reads):
    mech = attnlab.build_mechanism(spec_, attnlab.HeadDims(H, D, MAXLEN)).train()
    assert mech.caps.reads() == reads
    q, k, v = (t.requires_grad_() for t in qkv(19))
    mech(q, k, v, ctx()).out.square().sum().backward()
    _check_reads(mech, q, k, v)


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_rows_give_zeros(name):
    mech = build(name)
    if not mech.caps.key_mask_ok:
        pytest.skip(f"{name} declares key_mask_ok=False")
    q, k, v = qkv(13)
    key_mask = torch.ones(B, 13, dtype=torch.bool)
    key_mask[1] = False
    res = mech(q, k, v, ctx(key_mask=key_mask, need_weights=True))
    assert torch.isfinite(res.out).all()
    assert (res.out[1] == 0).all()
    if res.probs is not None:
        assert (res.probs[1] == 0).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_run(name, dtype):
    mech = build(name).to(dtype)
    q, k, v = qkv(19, dtype=dtype)
    out = mech(q, k, v, ctx()).out
    assert out.dtype == dtype and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name", NAMES)
def test_eval_is_deterministic(name):
    mech = build(name)
    q, k, v = qkv(19)
    a = mech(q, k, v, ctx()).out
    b = mech(q, k, v, ctx()).out
    assert torch.equal(a, b)


# ------------------------------------------------------------------ exact mechanisms vs oracle

EXACT = [nm for nm in NAMES if mechanism_class(nm).caps.exact]


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("n", [1, 7, 19, 33, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_exact_matches_reference(name, n, causal):
    mech = build(name)
    if causal and not mech.caps.causal_ok:
        pytest.skip("not causal_ok")
    q, k, v = (t.requires_grad_() for t in qkv(n, seed=n))
    lengths = torch.tensor([n, max(1, n - 5), max(1, n // 3)])
    key_mask = torch.arange(n)[None, :] < lengths[:, None]
    c = ctx(key_mask=key_mask, causal=causal, need_weights=False)
    out = mech(q, k, v, c).out
    bias = mech.bias(n, n)
    ref, _ = attnlab.reference_attention(q, k, v, bias=bias, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # probabilities, when materialised, equal the reference's too
    res = mech(q.detach(), k.detach(), v.detach(), ctx(key_mask=key_mask, causal=causal,
                                                        need_weights=True))
    if res.probs is not None:
        _, pref = attnlab.reference_attention(q.detach(), k.detach(), v.detach(), bias=bias,
                                              key_mask=key_mask, causal=causal)
        torch.testing.assert_close(res.probs, pref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,m", [(5, 3), (3, 5), (6, 6)])
def test_softmax_causal_with_key_mask_at_unequal_lengths(n, m):
    """Queries aligned to the last n keys (core.reference); n > m leaves the first rows
    without keys (zeros). Was a crash at n > m with a key mask."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, n, D, generator=g)
    k, v = (torch.randn(2, 2, m, D, generator=g) for _ in range(2))
    key_mask = torch.ones(2, m, dtype=torch.bool)
    key_mask[1, 0] = False
    for spec in ("softmax", "mqa"):
        mech = attnlab.build_mechanism(spec, attnlab.HeadDims(2, D)).eval()
        out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=True)).out
        kk, vv = (k.mean(1, keepdim=True).expand_as(k), v.mean(1, keepdim=True).expand_as(v)
                  ) if spec == "mqa" else (k, v)
        ref, _ = attnlab.reference_attention(q, kk, vv, key_mask=key_mask, causal=True)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
