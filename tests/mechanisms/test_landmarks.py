"""nystrom and csalr: naive per-(batch, head) references, the landmarks = n limits,
transformers' NystromformerSelfAttention parity, bad specs, a plan on a tiny BERT.

Tolerances: fp32 at 1e-5 against the naive references and transformers (same operations,
different order and grouping); the landmarks = n limits are stated where measured.
"""

from __future__ import annotations

import math

import pytest
import torch
from plan_step import train_one_step

import attnlab
from attnlab import load_pretrained, save_pretrained
from attnlab.core import RegistryError, resolve_config
from attnlab.mechanisms.landmarks import nystrom_attention

H, D = 3, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}


# ------------------------------------------------------------------------ naive references


def naive_segments(n, num):
    """Position lists of the L segments: i is in segment j iff j*n <= i*L < (j+1)*n."""
    return [[i for i in range(n) if j * n <= i * num < (j + 1) * n] for j in range(num)]


def naive_kernels(q, k, num, key_mask, scale):
    """Per (batch, head) lists of (k1 [n,L], M [L,L], k3 [L,m]), the official code's order:
    Q, K masked and scaled by sqrt(scale) each, segment means, three softmaxes."""
    b, h, n, d = q.shape
    segs = naive_segments(n, num)
    out = {}
    for bi in range(b):
        keep = torch.ones(n) if key_mask is None else key_mask[bi].float()
        for hi in range(h):
            qs = q[bi, hi] * keep[:, None] * math.sqrt(scale)
            ks = k[bi, hi] * keep[:, None] * math.sqrt(scale)
            ql = torch.stack([qs[s].mean(0) for s in segs])  # [L,d]
            kl = torch.stack([ks[s].mean(0) for s in segs])
            s3 = ql @ ks.T
            s3 = s3.masked_fill(keep[None, :] == 0, float("-inf"))
            k3 = torch.softmax(s3, -1) if keep.any() else torch.zeros_like(s3)
            out[bi, hi] = (torch.softmax(qs @ kl.T, -1), torch.softmax(ql @ kl.T, -1), k3)
    return out


def naive_pinv(mats, iterations, init):
    """The Nyströmformer iteration on each [L, L] matrix; "original" scales every Z_0 by
    the largest column sum over all of them."""
    glob = max(m.sum(0).max() for m in mats.values())
    res = {}
    for key, a in mats.items():
        c = glob if init == "original" else a.sum(0).max()
        z = a.T / c
        eye = torch.eye(a.shape[0])
        for _ in range(iterations):
            az = a @ z
            z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
        res[key] = z
    return res


def naive_conv(v, weight, key_mask):
    """out[i] = sum_t w[t] v[i + t - K//2] per head, v zeroed at padded positions."""
    b, h, n, _ = v.shape
    ksize = weight.shape[2]
    out = torch.zeros_like(v)
    for bi in range(b):
        keep = torch.ones(n) if key_mask is None else key_mask[bi].float()
        for hi in range(h):
            for i in range(n):
                for t in range(ksize):
                    j = i + t - ksize // 2
                    if 0 <= j < n:
                        out[bi, hi, i] += weight[hi, 0, t, 0] * v[bi, hi, j] * keep[j]
    return out


def naive_nystrom(q, k, v, num, iterations, key_mask=None, init="original", conv=None):
    kern = naive_kernels(q, k, num, key_mask, q.shape[-1] ** -0.5)
    pinv = naive_pinv({key: m for key, (_, m, _) in kern.items()}, iterations, init)
    out = torch.zeros_like(v)
    for (bi, hi), (k1, _, k3) in kern.items():
        out[bi, hi] = (k1 @ pinv[bi, hi]) @ (k3 @ v[bi, hi])
    return out if conv is None else out + naive_conv(v, conv, key_mask)


def naive_csalr(q, k, v, num, eps, key_mask=None):
    """With a key mask: each row on its real tokens alone (num capped at their count), its
    padded query rows 0."""
    if key_mask is not None:
        out = torch.zeros_like(v)
        for bi in range(q.shape[0]):
            idx = key_mask[bi].nonzero()[:, 0]
            if len(idx):
                row = [t[bi:bi + 1, :, idx] for t in (q, k, v)]
                out[bi:bi + 1, :, idx] = naive_csalr(*row, min(num, len(idx)), eps)
        return out
    kern = naive_kernels(q, k, num, None, q.shape[-1] ** -0.5)
    out = torch.zeros_like(v)
    for (bi, hi), (k1, m, k3) in kern.items():
        inv = torch.linalg.inv(m.double() + eps * torch.eye(m.shape[0], dtype=torch.float64))
        out[bi, hi] = (k1.double() @ inv @ k3.double() @ v[bi, hi].double()).to(v.dtype)
    return out


# ----------------------------------------------------------------------------------- helpers


def build(spec, h=H, max_len=64):
    torch.manual_seed(0)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, max_len)).eval()


def rand(b, n, seed=0, h=H, d=D, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) * scale for _ in range(3))


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


# ----------------------------------------------------------------------------------- nystrom


@pytest.mark.parametrize("n", [16, 19])  # L divides n / uneven segments
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("init", ["original", "exact"])
@pytest.mark.parametrize("conv", [0, 3])
def test_nystrom_matches_naive_reference(n, padded, init, conv):
    mech = build(f"nystrom(num_landmarks=4, pinv_iterations=6, pinv_init={init!r}, "
                 f"conv_kernel={conv})")
    q, k, v = rand(3, n, seed=n)
    key_mask = lengths_mask(n, [n, n - 6, 2]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, need_weights=True))
    weight = mech.conv.weight.detach() if conv else None
    ref = naive_nystrom(q, k, v, 4, 6, key_mask, init, weight)
    torch.testing.assert_close(res.out, ref, **TOL)
    # the effective weights reproduce the output (conv band included), padding gets none
    torch.testing.assert_close(res.probs @ v, res.out, **TOL)
    if padded:
        assert (res.probs[1, :, :, n - 6:] == 0).all()
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    torch.testing.assert_close(out, res.out, **TOL)


def test_nystrom_original_init_uses_the_whole_batch():
    """The official default scales Z_0 by the largest column sum of the call: a sequence's
    output then depends (slightly) on its batch mates; "exact" does not."""
    q, k, v = rand(2, 16, seed=3)
    q[1] *= 4  # a batch mate with peakier landmark kernels
    for init, same in (("original", False), ("exact", True)):
        mech = build(f"nystrom(num_landmarks=4, pinv_init={init!r})")
        both = mech(q, k, v, attnlab.AttnContext()).out[0]
        alone = mech(q[:1], k[:1], v[:1], attnlab.AttnContext()).out[0]
        assert torch.allclose(both, alone, atol=1e-6) == same, init


def test_nystrom_with_landmarks_n_converges_to_softmax():
    """Every token its own landmark: the kernels all equal softmax(QK^T) = A and
    A pinv(A) A = A. Measured max error on this input: 1.6e-2 with the default 6
    iterations, 6.6e-4 with 10, 5e-6 with 20, 2.6e-6 (original init) / 2.9e-6 (exact) with
    30."""
    n = 8
    q, k, v = rand(2, n, seed=5, scale=0.5)
    ref, _ = attnlab.reference_attention(q, k, v)
    few, _ = nystrom_attention(q, k, v, n, 6, D**-0.5)
    many, _ = nystrom_attention(q, k, v, n, 30, D**-0.5, pinv_init="exact")
    assert (few - ref).abs().max() > 1e-3  # 6 iterations are not converged here
    torch.testing.assert_close(many, ref, **TOL)


@pytest.mark.parametrize("n", [4, 3, 1])  # L == n (transformers' own shortcut) and L > n
def test_nystrom_landmarks_at_least_n_is_softmax(n):
    mech = build("nystrom(num_landmarks=4)")
    q, k, v = rand(2, n, seed=n)
    key_mask = lengths_mask(n, [n, 1])
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, need_weights=True))
    ref, pref = attnlab.reference_attention(q, k, v, key_mask=key_mask)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)


def _hf_attention(num_landmarks, n, conv):
    from transformers import NystromformerConfig
    from transformers.models.nystromformer.modeling_nystromformer import (
        NystromformerSelfAttention,
    )

    cfg = NystromformerConfig(hidden_size=H * D, num_attention_heads=H,
                              num_landmarks=num_landmarks, segment_means_seq_len=n,
                              conv_kernel_size=conv or 1, attention_probs_dropout_prob=0.0)
    torch.manual_seed(1)
    att = NystromformerSelfAttention(cfg).eval()
    if not conv:  # the module skips its conv when conv_kernel_size is None
        att.conv_kernel_size = None
        del att.conv
    return att


@pytest.mark.parametrize("num_landmarks,n,conv", [(4, 16, 0), (4, 16, 3), (8, 32, 65),
                                                  (16, 16, 5)])
def test_nystrom_equals_transformers(num_landmarks, n, conv):
    """q, k, v from transformers' own Linear layers, its conv weight copied across."""
    att = _hf_attention(num_landmarks, n, conv)
    x = torch.randn(2, n, H * D, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        ref = att(x)[0]  # [b,n,h*d]
        q, k, v = (lin(x).view(2, n, H, D).transpose(1, 2)
                   for lin in (att.query, att.key, att.value))
        mech = build(f"nystrom(num_landmarks={num_landmarks}, conv_kernel={conv})")
        if conv:
            mech.conv.weight.copy_(att.conv.weight)
        out = mech(q, k, v, attnlab.AttnContext()).out  # [b,h,n,d]
    torch.testing.assert_close(out.transpose(1, 2).reshape(2, n, H * D), ref, **TOL)


def test_nystrom_conv_init_is_seeded_and_trains():
    a, b = build("nystrom(num_landmarks=4, conv_kernel=5)"), build(
        "nystrom(num_landmarks=4, conv_kernel=5)")
    assert a.conv.weight.shape == (H, 1, 5, 1) and torch.equal(a.conv.weight, b.conv.weight)
    q, k, v = rand(2, 12)
    a.train()(q, k, v, attnlab.AttnContext()).out.square().sum().backward()
    assert a.conv.weight.grad.abs().sum() > 0
    assert [n for n, _ in build("nystrom").named_parameters()] == []  # no conv, no params


@pytest.mark.parametrize("spec", ["nystrom(num_landmarks=4, pinv_init='exact')",
                                  "csalr(num_landmarks=4, eps=0.3)"])
def test_float64_inputs_stay_float64(spec):
    """Only 16-bit inputs are widened (to fp32) for the pseudo-inverse and the solve: float64
    inputs keep their precision and match the float64 references to 1e-12."""
    q, k, v = (t.double() for t in rand(2, 19, seed=5))
    out = build(spec).double()(q, k, v, attnlab.AttnContext()).out
    ref = (naive_nystrom(q, k, v, 4, 6, None, "exact") if spec.startswith("nystrom")
           else naive_csalr(q, k, v, 4, 0.3))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------- csalr


@pytest.mark.parametrize("n", [16, 19])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("eps", [1.0, 0.3])
def test_csalr_matches_naive_reference(n, padded, eps):
    mech = build(f"csalr(num_landmarks=4, eps={eps})")
    q, k, v = rand(3, n, seed=n)
    key_mask = lengths_mask(n, [n, n - 6, 2]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, need_weights=True))
    torch.testing.assert_close(res.out, naive_csalr(q, k, v, 4, eps, key_mask), **TOL)
    torch.testing.assert_close(res.probs @ v, res.out, **TOL)
    if padded:
        assert (res.probs[1, :, :, n - 6:] == 0).all()


def test_csalr_with_landmarks_n_and_tiny_eps_is_softmax():
    """landmarks = n, eps = 1e-6: A (A + eps I)^{-1} A = A up to eps * ||A^{-1}||
    (measured max error 1.5e-6 on this input; 1.6e-4 at eps = 1e-4); eps = 1 is far from
    it (0.25: the identity term)."""
    n = 8
    q, k, v = rand(2, n, seed=6, scale=0.5)
    ref, _ = attnlab.reference_attention(q, k, v)
    out = build("csalr(num_landmarks=8, eps=1e-6)")(q, k, v, attnlab.AttnContext()).out
    torch.testing.assert_close(out, ref, **TOL)
    far = build("csalr(num_landmarks=8, eps=1.0)")(q, k, v, attnlab.AttnContext()).out
    assert (far - ref).abs().max() > 1e-2


def test_csalr_more_landmarks_than_tokens_uses_every_token():
    q, k, v = rand(2, 5, seed=2)
    a = build("csalr(num_landmarks=64, eps=0.5)")(q, k, v, attnlab.AttnContext()).out
    b = build("csalr(num_landmarks=5, eps=0.5)")(q, k, v, attnlab.AttnContext()).out
    assert torch.equal(a, b)


# ------------------------------------------------------------------------ errors and plans


@pytest.mark.parametrize("spec,match", [
    ("nystrom(num_landmarks=0)", "num_landmarks must be >= 1"),
    ("nystrom(pinv_iterations=-1)", "pinv_iterations must be >= 0"),
    ("nystrom(conv_kernel=4)", r"odd .*use 5"),
    ("nystrom(pinv_init='fast')", "pinv_init must be one of"),
    ("csalr(num_landmarks=0)", "num_landmarks must be >= 1"),
    ("csalr(eps=0)", "eps must be a positive finite number"),
])
def test_bad_specs_name_the_fix(spec, match):
    with pytest.raises(RegistryError, match=match):
        resolve_config(spec)
    with pytest.raises(RegistryError, match=match):
        attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, 64))


@pytest.mark.parametrize("name", ["nystrom", "csalr"])
def test_not_causal_and_self_attention_only(name):
    mech = build(f"{name}(num_landmarks=2)")
    assert attnlab.core.mechanism_class(name).caps.causal_ok is False
    q, k, v = rand(1, 6)
    with pytest.raises(ValueError, match="cannot be causal.*encoders"):
        mech(q, k, v, attnlab.AttnContext(causal=True))
    with pytest.raises(ValueError, match="as many queries as keys.*n=3, m=6"):
        mech(q[:, :, :3], k, v, attnlab.AttnContext())


def test_spec_round_trip():
    cfg = resolve_config("nystrom(num_landmarks=32, conv_kernel=33, pinv_init='exact')")
    assert resolve_config(cfg.spec()) == cfg
    assert resolve_config("nystrom") == resolve_config(
        "nystrom(num_landmarks=64, pinv_iterations=6, conv_kernel=0, pinv_init='original')")
    assert resolve_config("csalr") == resolve_config("csalr(num_landmarks=64, eps=1.0)")


@pytest.mark.parametrize("spec", ["nystrom(num_landmarks=4, conv_kernel=3)",
                                  "csalr(num_landmarks=4, eps=0.5)"])
def test_plan_on_tiny_bert_trains_one_step(bert_factory, padded_batch, spec):
    model = bert_factory()
    report, before, after = train_one_step(model, [f"all:0,2:{spec}"], padded_batch)
    assert report.counts_by_name[spec.split("(")[0]] == 3 * 2
    assert not torch.equal(before, after)


def test_nystrom_conv_round_trips_through_save_pretrained(bert_factory, padded_batch,
                                                          tmp_path):
    model = bert_factory()
    attnlab.apply_plan(model, ["all:all:nystrom(num_landmarks=4, conv_kernel=3)"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attnlab." in name:
                p.add_(0.1 * torch.randn_like(p))  # not the init: a reload must restore it
        ref = model(**padded_batch).last_hidden_state
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(**padded_batch).last_hidden_state, ref)
