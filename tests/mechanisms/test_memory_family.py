"""The compressed key-value memory family: mca, isab, luna (memory.py), poolingformer
(pooling.py). Each fast path is compared with a naive reference written here with per-(batch, head,
query) loops over explicit key lists (no masked_softmax, no einsum). Tolerances: fp32
outputs at atol = rtol = 1e-5; equalities that hold by construction (save/load, seeds)
are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plan_step import train_one_step

import attnlab
from attnlab.core import HeadDims, RegistryError, resolve_config
from attnlab.hf import SurgeryError
from attnlab.mechanisms.memory import (
    LUNA_STATE_KEY,
    ISABConfig,
    Luna,
    LunaConfig,
    MCAConfig,
)
from attnlab.mechanisms.pooling import PoolingformerConfig

D = 8
TOL = {"atol": 1e-5, "rtol": 1e-5}


def build(spec: str, h: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    return attnlab.build_mechanism(spec, HeadDims(h, D, 64)).eval()


def rand(b, h, n, m=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    return (torch.randn(b, h, n, D, generator=g), torch.randn(b, h, m, D, generator=g),
            torch.randn(b, h, m, D, generator=g))


def lengths_mask(lengths, m):
    return torch.arange(m)[None, :] < torch.tensor(lengths)[:, None]


def ctx(**kw):
    kw.setdefault("state", {})
    return attnlab.AttnContext(**kw)


def softmax_over(q_i, keys, vals, scale):
    """One query against an explicit key list [K,d] (empty -> zeros)."""
    if keys.shape[0] == 0:
        return torch.zeros(vals.shape[-1])
    w = torch.softmax(keys @ q_i * scale, dim=0)
    return w @ vals


# ------------------------------------------------------------------------------------- mca


def naive_mca(q, k, v, mech, key_mask, causal):
    b, h, n, d = q.shape
    m = k.shape[2]
    c, B = mech.cfg.compression, mech.cfg.local_block
    keep = torch.ones(b, m, dtype=torch.bool) if key_mask is None else key_mask
    S = -(-m // c)
    out = torch.zeros(b, h, n, d)
    for bi in range(b):
        for hi in range(h):
            kz = torch.where(keep[bi][:, None], k[bi, hi], 0.0)  # padded keys zeroed
            vz = torch.where(keep[bi][:, None], v[bi, hi], 0.0)
            kz, vz = F.pad(kz, (0, 0, 0, S * c - m)), F.pad(vz, (0, 0, 0, S * c - m))
            kc = F.conv1d(kz.T[None], mech.key_weight[hi], mech.key_bias[hi], stride=c)[0].T
            vc = F.conv1d(vz.T[None], mech.value_weight[hi], mech.value_bias[hi],
                          stride=c)[0].T  # [S,d]
            has_key = [bool(keep[bi, s * c:s * c + c].any()) for s in range(S)]
            for i in range(n):
                pos = i + m - n
                slots = [s for s in range(S) if has_key[s] and (not causal or s * c + c - 1 <= pos)]
                local = [j for j in range(m) if B and j // B == i // B and keep[bi, j]
                         and (not causal or j <= i)]
                keys = torch.cat([k[bi, hi, local], kc[slots]])
                vals = torch.cat([v[bi, hi, local], vc[slots]])
                out[bi, hi, i] = softmax_over(q[bi, hi, i], keys, vals, d**-0.5)
    return out


@pytest.mark.parametrize("c,block", [(3, 0), (4, 0), (3, 4), (2, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_mca_matches_naive(c, block, causal):
    mech = build(f"mca(compression={c}, local_block={block}, init='random')")
    q, k, v = rand(2, 2, 13, seed=c)
    for key_mask in (None, lengths_mask([13, 8], 13)):
        out = mech(q, k, v, ctx(key_mask=key_mask, causal=causal)).out
        torch.testing.assert_close(out, naive_mca(q, k, v, mech, key_mask, causal), **TOL)


def test_mca_takes_strided_heads_of_a_length_the_compression_divides():
    mech, qkv = build("mca(compression=3, init='random')"), rand(2, 2, 12, seed=9)  # m = 4 c
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv)  # a model's heads
    for mask in (None, lengths_mask([12, 7], 12)):
        out = mech(q, k, v, ctx(key_mask=mask)).out
        torch.testing.assert_close(out, naive_mca(*qkv, mech, mask, False), **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_mca_sdpa_path_equals_the_explicit_path_with_gradients(causal):
    """Without weights and dropout the slots run on SDPA (``_maskedsdpa``): outputs and the
    gradients of q, k, v and the convolutions equal the explicit path's to 1e-5, with
    padding (a slot of padding only) and causal queries that see no slot (rows of 0)."""
    mech = build("mca(compression=3, init='random')")
    key_mask = lengths_mask([13, 5], 13)
    got = []
    for weights in (False, True):
        q, k, v = (x.requires_grad_() for x in rand(2, 2, 13, seed=6))
        mech.zero_grad()
        out = mech(q, k, v, ctx(key_mask=key_mask, causal=causal, need_weights=weights)).out
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        got.append([out.detach(), q.grad, k.grad, v.grad]
                   + [p.grad.clone() for p in mech.parameters()])
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_mca_cross_lengths_causal_aligns_queries_to_the_last_keys():
    mech = build("mca(compression=3, init='random')")
    q, k, v = rand(2, 2, 5, 11, seed=4)
    key_mask = lengths_mask([11, 7], 11)
    out = mech(q, k, v, ctx(key_mask=key_mask, causal=True)).out
    torch.testing.assert_close(out, naive_mca(q, k, v, mech, key_mask, True), **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_mca_compression_one_is_softmax(causal):
    """init='mean' with c = 1: identity taps, zero bias, every key its own slot."""
    mech = build("mca(compression=1)")
    q, k, v = rand(3, 2, 9, seed=1)
    key_mask = lengths_mask([9, 5, 1], 9)
    res = mech(q, k, v, ctx(key_mask=key_mask, causal=causal, need_weights=True))
    ref, pref = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)


def test_mca_attribution_rows_and_padding():
    mech = build("mca(compression=3, local_block=4)")
    q, k, v = rand(2, 2, 13, seed=2)
    key_mask = lengths_mask([13, 7], 13)
    probs = mech(q, k, v, ctx(key_mask=key_mask, need_weights=True)).probs
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 13), **TOL)
    assert (probs[1, :, :, 7:] == 0).all()


def test_mca_causal_queries_before_the_first_full_slot_give_zeros():
    mech = build("mca(compression=3)")
    q, k, v = rand(1, 2, 8, seed=3)
    out = mech(q, k, v, ctx(causal=True)).out
    assert (out[:, :, :2] == 0).all() and (out[:, :, 2:].abs().sum(-1) > 0).all()
    # with local blocks every query sees at least itself
    out = build("mca(compression=3, local_block=2)")(q, k, v, ctx(causal=True)).out
    assert (out.abs().sum(-1) > 0).all()


def test_mca_init_modes():
    mean = build("mca(compression=2)", seed=0)
    eye = torch.eye(D).div(2)[None, :, :, None].expand(2, D, D, 2)
    assert torch.equal(mean.key_weight, eye) and torch.equal(mean.value_bias, torch.zeros(2, D))
    a, b = (build("mca(compression=2, init='random')", seed=s) for s in (0, 0))
    c = build("mca(compression=2, init='random')", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.key_weight, c.key_weight)
    assert a.key_weight.abs().max() <= (D * 2) ** -0.5


def test_mca_local_block_needs_self_attention():
    q, k, v = rand(1, 2, 4, 6)
    with pytest.raises(ValueError, match="local_block needs as many queries as keys"):
        build("mca(local_block=2)")(q, k, v, ctx())


# ------------------------------------------------------------------------------ isab, luna


def naive_nested(q, k, v, slots, key_mask):
    """slots [h,l,d] or [b,h,l,d] -> (out, packed values A V per (b, h))."""
    b, h, n, d = q.shape
    m = k.shape[2]
    keep = torch.ones(b, m, dtype=torch.bool) if key_mask is None else key_mask
    slots = slots.expand(b, *slots.shape[-3:])
    out, packed = torch.zeros(b, h, n, d), torch.zeros(b, h, slots.shape[2], d)
    for bi in range(b):
        for hi in range(h):
            kk, vv = k[bi, hi, keep[bi]], v[bi, hi, keep[bi]]  # kept keys only
            hk = torch.stack([softmax_over(s, kk, kk, d**-0.5) for s in slots[bi, hi]])
            hv = torch.stack([softmax_over(s, kk, vv, d**-0.5) for s in slots[bi, hi]])
            packed[bi, hi] = hv
            for i in range(n):
                out[bi, hi, i] = softmax_over(q[bi, hi, i], hk, hv, d**-0.5)
    return out, packed


def layer_norm(x, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps)


@pytest.mark.parametrize("n,m", [(9, 9), (5, 11)])
def test_isab_matches_naive(n, m):
    mech = build("isab(num_inducing=3)")
    q, k, v = rand(3, 2, n, m, seed=n)
    for key_mask in (None, lengths_mask([m, 4, 1], m)):
        res = mech(q, k, v, ctx(key_mask=key_mask, need_weights=True))
        ref, _ = naive_nested(q, k, v, mech.inducing.detach(), key_mask)
        torch.testing.assert_close(res.out, ref, **TOL)
        torch.testing.assert_close(res.probs @ v, res.out, **TOL)  # effective weights exact
        assert res.probs.shape == (3, 2, n, m)
        if key_mask is not None:
            assert (res.probs[~key_mask[:, None, None, :].expand_as(res.probs)] == 0).all()


@pytest.mark.parametrize("spec", ["isab(num_inducing=3)", "luna(num_memory=3)"])
def test_padded_keys_are_invisible_and_empty_rows_are_zero(spec):
    mech = build(spec)
    q, k, v = rand(3, 2, 10, seed=5)
    key_mask = lengths_mask([10, 6, 0], 10)
    s1, s2 = {}, {}
    out1 = mech(q, k, v, ctx(key_mask=key_mask, state=s1)).out
    pad = ~key_mask[:, None, :, None]
    k2, v2 = torch.where(pad, 50 * torch.randn_like(k), k), torch.where(pad, -7.0, v)
    out2 = mech(q, k2, v2, ctx(key_mask=key_mask, state=s2)).out
    torch.testing.assert_close(out1, out2, atol=1e-6, rtol=1e-6)  # every row (query) real
    assert (out1[2] == 0).all()
    if spec.startswith("luna"):  # the memory passed up ignores padding too
        torch.testing.assert_close(s1[LUNA_STATE_KEY].memory, s2[LUNA_STATE_KEY].memory,
                                   atol=1e-6, rtol=1e-6)


def test_luna_first_layer_matches_naive_and_state_none_is_plain():
    mech = build("luna(num_memory=4)")
    q, k, v = rand(2, 2, 7, seed=6)
    key_mask = lengths_mask([7, 3], 7)
    ref, packed = naive_nested(q, k, v, mech.memory.detach(), key_mask)
    state: dict = {}
    res = mech(q, k, v, ctx(key_mask=key_mask, state=state, need_weights=True))
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs @ v, res.out, **TOL)
    entry = state[LUNA_STATE_KEY]
    assert entry.layer_idx == 0
    torch.testing.assert_close(entry.memory, layer_norm(mech.memory.detach() + packed), **TOL)
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, state=None)).out
    torch.testing.assert_close(out, ref, **TOL)


def test_luna_stack_passes_the_packed_memory_up():
    layers = [build("luna(num_memory=4)", seed=s) for s in range(3)]
    key_mask = lengths_mask([9, 5], 9)
    inputs = [rand(2, 2, 9, seed=10 + s) for s in range(3)]
    state: dict = {}
    outs = [mech(*x, ctx(key_mask=key_mask, layer_idx=li, state=state)).out
            for mech, x, li in zip(layers, inputs, (0, 1, 3), strict=True)]
    memory = layers[0].memory.detach()  # only the first layer's own P is read
    for out, x in zip(outs, inputs, strict=True):
        ref, packed = naive_nested(*x, memory, key_mask)
        torch.testing.assert_close(out, ref, **TOL)
        memory = layer_norm(memory + packed)
    assert state[LUNA_STATE_KEY].layer_idx == 3
    torch.testing.assert_close(state[LUNA_STATE_KEY].memory, memory, **TOL)


def test_luna_gradients_flow_through_the_memory():
    first, second = build("luna(num_memory=3)", seed=0), build("luna(num_memory=3)", seed=1)
    state: dict = {}
    first(*rand(2, 2, 6, seed=0), ctx(layer_idx=0, state=state))
    out = second(*rand(2, 2, 6, seed=1), ctx(layer_idx=1, state=state)).out
    out.square().sum().backward()
    assert first.memory.grad is not None and first.memory.grad.abs().sum() > 0
    assert second.memory.grad is None  # its own P is not read when a memory comes up


def test_luna_state_errors():
    state: dict = {}
    build("luna(num_memory=3)")(*rand(2, 2, 5), ctx(layer_idx=0, state=state))
    with pytest.raises(ValueError, match=r"layer 1 needs a packed memory.*same head count, "
                       r"head dim and num_memory"):
        build("luna(num_memory=4)")(*rand(2, 2, 5), ctx(layer_idx=1, state=state))
    with pytest.raises(ValueError, match="fresh dict for each forward pass"):
        build("luna(num_memory=3)")(*rand(2, 2, 5), ctx(layer_idx=0, state=state))


@pytest.mark.parametrize("spec", ["isab", "luna"])
def test_not_causal(spec):
    assert attnlab.core.mechanism_class(spec).caps.causal_ok is False
    with pytest.raises(ValueError, match="cannot be causal"):
        build(spec)(*rand(1, 2, 4), ctx(causal=True))


# ---------------------------------------------------------------------------- poolingformer


def naive_poolingformer(q, k, v, mech, key_mask, causal):
    cfg = mech.cfg
    b, h, n, d = q.shape
    kappa, xi, w1, w2 = cfg.pool_size, mech.stride, cfg.window, cfg.window2
    keep = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask
    starts = [0]
    while starts[-1] + kappa < n:
        starts.append(starts[-1] + xi)
    out = torch.zeros(b, h, n, d)
    for bi in range(b):
        for hi in range(h):
            y = torch.stack([softmax_over(
                q[bi, hi, i],
                k[bi, hi, [j for j in range(n) if abs(i - j) <= w1 and keep[bi, j]
                           and (not causal or j <= i)]],
                v[bi, hi, [j for j in range(n) if abs(i - j) <= w1 and keep[bi, j]
                           and (not causal or j <= i)]], d**-0.5) for i in range(n)])
            q2, k2, v2 = (y, y, y) if cfg.stacked else (q[bi, hi], k[bi, hi], v[bi, hi])
            ks, vs, spans = [], [], []
            extent = max((j + 1 for j in range(n) if keep[bi, j]), default=0)
            for s0 in starts:  # the row's slots: up to the first reaching its extent
                needed = s0 == 0 or s0 - xi + kappa < extent
                toks = [j for j in range(s0, min(s0 + kappa, n)) if keep[bi, j] and needed]
                spans.append((s0, max(toks, default=s0), bool(toks)))  # ends at a kept token
                for src, dst in ((k2, ks), (v2, vs)):
                    if cfg.pool == "mean":
                        dst.append(src[toks].mean(0) if toks else torch.zeros(d))
                    elif cfg.pool == "max":
                        dst.append(src[toks].amax(0) if toks else torch.zeros(d))
                    else:
                        w = mech.pool_weight[hi]  # [d,kappa]
                        dst.append(sum((w[:, t] * src[s0 + t] for t in range(kappa)
                                        if s0 + t < n and keep[bi, s0 + t]), torch.zeros(d)))
            ks, vs = torch.stack(ks), torch.stack(vs)
            for i in range(n):
                vis = [s for s, (st, en, has) in enumerate(spans)
                       if has and st >= i - w2 and en <= i + w2 and (not causal or en <= i)]
                out[bi, hi, i] = y[i] + softmax_over(q2[i], ks[vis], vs[vis], d**-0.5)
    return out


@pytest.mark.parametrize("pool", ["mean", "max", "conv"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_poolingformer_matches_naive(pool, stacked, causal):
    mech = build(f"poolingformer(window=2, window2=7, pool={pool!r}, pool_size=3, "
                 f"stacked={stacked})")
    if mech.pool_weight is not None:
        with torch.no_grad():
            mech.pool_weight.normal_()  # not the mean init, so conv differs from mean
    q, k, v = rand(2, 2, 19, seed=7)
    for key_mask in (None, lengths_mask([19, 11], 19)):
        out = mech(q, k, v, ctx(key_mask=key_mask, causal=causal)).out
        ref = naive_poolingformer(q, k, v, mech, key_mask, causal)
        torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("n", [150, 260])  # several query blocks; 260: blocked band level 1
def test_poolingformer_long_inputs_match_naive(n):
    mech = build("poolingformer(window=5, window2=40, pool_size=5, stride=3)", h=1)
    q, k, v = rand(1, 1, n, seed=n)
    key_mask = lengths_mask([n - 17], n)
    out = mech(q, k, v, ctx(key_mask=key_mask)).out
    torch.testing.assert_close(out, naive_poolingformer(q, k, v, mech, key_mask, False), **TOL)


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_poolingformer_gradients_match_naive(stacked, causal):
    """Level 2 without weights runs on SDPA (``pooling._slot_sdpa``, blocks as the batch):
    gradients of q, k, v against autograd through the loops, several query blocks, padded
    (slots of padding only, causal rows that see no slot)."""
    mech = build(f"poolingformer(window=3, window2=20, pool_size=4, stride=3, "
                 f"stacked={stacked})", h=2)
    n = 150
    q, k, v = (t.requires_grad_() for t in rand(2, 2, n, seed=4))
    key_mask = lengths_mask([n, n - 40], n)
    out = mech(q, k, v, ctx(key_mask=key_mask, causal=causal)).out
    ref = naive_poolingformer(q, k, v, mech, key_mask, causal)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g, allow_unused=True),
                    torch.autograd.grad(ref, (q, k, v), g, allow_unused=True), strict=True):
        assert (a is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(a, r, **TOL)


@pytest.mark.parametrize("stacked", [True, False])
def test_poolingformer_weights_are_exact_for_mean_pooling(stacked):
    mech = build(f"poolingformer(window=1, window2=6, pool_size=2, stacked={stacked})")
    q, k, v = rand(2, 2, 15, seed=8)
    key_mask = lengths_mask([15, 9], 15)
    res = mech(q, k, v, ctx(key_mask=key_mask, need_weights=True))
    torch.testing.assert_close(res.probs @ v, res.out, **TOL)
    assert (res.probs[1, :, :, 9:] == 0).all()


def test_poolingformer_conv_starts_as_mean_pooling():
    q, k, v = rand(2, 2, 12, seed=9)  # 12 = 4 full slots of 3: no padding in any slot
    outs = [build(f"poolingformer(window=1, window2=6, pool={p!r}, pool_size=3)")(
        q, k, v, ctx()).out for p in ("conv", "mean")]
    torch.testing.assert_close(outs[0], outs[1], **TOL)


def test_poolingformer_needs_self_attention():
    with pytest.raises(ValueError, match="needs n == m"):
        build("poolingformer")(*rand(1, 2, 4, 6), ctx())


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("spec,match", [
    ("mca(compression=0)", "compression must be >= 1"),
    ("mca(local_block=-1)", "local_block must be >= 0"),
    ("mca(init='zeros')", "init must be"),
    ("isab(num_inducing=0)", "num_inducing must be >= 1"),
    ("luna(num_memory=0)", "num_memory must be >= 1"),
    ("poolingformer(window=8, window2=4)", "set window2 >= 8"),
    ("poolingformer(pool='avg')", "pool"),
    ("poolingformer(pool_size=0)", "pool_size .* must be >= 1"),
    ("poolingformer(pool_size=2, stride=3)", "stride .* between 1 and pool_size=2"),
    ("poolingformer(window=-1)", "window .* must be >= 0"),
])
def test_bad_specs_name_the_fix(spec, match):
    with pytest.raises(RegistryError, match=match):
        resolve_config(spec)
    with pytest.raises(RegistryError, match=match):
        attnlab.build_mechanism(spec, HeadDims(2, D, 64))


def test_config_classes_raise_value_errors():
    for cls, kw in ((MCAConfig, {"compression": 0}), (ISABConfig, {"num_inducing": -1}),
                    (LunaConfig, {"num_memory": 0}),
                    (PoolingformerConfig, {"window": 3, "window2": 2})):
        with pytest.raises(ValueError):
            cls(**kw)


def test_caps():
    cls = attnlab.core.mechanism_class
    assert {cls(nm).caps.family for nm in ("mca", "isab", "luna", "poolingformer")} == {"memory"}
    assert cls("luna").caps.scope == "layer"
    assert cls("mca").caps.causal_ok and cls("poolingformer").caps.causal_ok


# ------------------------------------------------------------------- in a model (surgery)

PLANS = {
    "mca": ["all:0,2:mca(compression=2, init='random')"],
    "isab": ["all:1,3:isab(num_inducing=3)"],
    "luna": ["all:all:luna(num_memory=3)"],
    "poolingformer": ["all:0,1:poolingformer(window=1, window2=4, pool='conv', pool_size=2)"],
}


def mechanism_parameters(model):
    return {n: p for n, p in model.named_parameters() if ".attnlab." in n}


@pytest.mark.parametrize("name", PLANS)
def test_plan_on_tiny_bert_trains_one_step(name, bert_factory, padded_batch):
    report, _, after = train_one_step(bert_factory(), PLANS[name], padded_batch)
    assert any(spec.startswith(name) for row in report.table for spec in row)
    assert after.shape == (3, 12, 32)


@pytest.mark.parametrize("name", PLANS)
def test_mechanism_parameters_learn_a_toy_task(name, bert_factory, padded_batch):
    """Teacher-student: the targets come from the same planned model with perturbed
    mechanism parameters; training only the student's mechanism parameters (Adam, 8
    steps) must at least halve the loss."""
    # initializer_range 0.2 (not 0.02): scores large enough for attention not to be uniform
    student = bert_factory(initializer_range=0.2)
    torch.manual_seed(0)
    attnlab.apply_plan(student, PLANS[name])
    teacher = bert_factory(initializer_range=0.2)
    torch.manual_seed(0)
    attnlab.apply_plan(teacher, PLANS[name])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mechanism_parameters(teacher).values():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
        target = teacher(**padded_batch).last_hidden_state
    params = mechanism_parameters(student)
    assert params, f"{name} has no learned parameters in the plan"
    student.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.Adam(params.values(), lr=0.05)
    real = padded_batch["attention_mask"].bool()
    losses = []
    for _ in range(8):
        out = student(**padded_batch).last_hidden_state
        loss = (out - target)[real].square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name", PLANS)
def test_save_and_load_reproduce_outputs(name, bert_factory, padded_batch, tmp_path):
    model = bert_factory("BertForSequenceClassification", num_labels=2)
    attnlab.apply_plan(model, PLANS[name])
    with torch.no_grad():  # away from the init, so a reload from init would not match
        for p in mechanism_parameters(model).values():
            p.add_(0.01 * torch.randn_like(p))
        ref = model(**padded_batch).logits
    attnlab.save_pretrained(model, tmp_path)
    loaded = attnlab.load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(**padded_batch).logits, ref)
    assert mechanism_parameters(loaded).keys() == mechanism_parameters(model).keys()


@pytest.mark.parametrize("plan", ["all:all:mca(compression=2, init='random')",
                                  "all:all:isab(num_inducing=3)", "all:all:luna(num_memory=3)"])
def test_init_follows_the_global_seed(plan, bert_factory):
    def params(seed):
        model = bert_factory()
        torch.manual_seed(seed)
        attnlab.apply_plan(model, plan)
        return list(mechanism_parameters(model).values())

    a, b, c = params(0), params(0), params(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def record_luna_reads(model):
    """(layer_idx, layer of the memory it found or None) for every luna call, in order."""
    reads = []

    def hook(module, args):
        c = args[3]
        entry = None if c.state is None else c.state.get(LUNA_STATE_KEY)
        reads.append((c.layer_idx, None if entry is None else entry.layer_idx))

    for mod in model.modules():
        if isinstance(mod, Luna):
            mod.register_forward_pre_hook(hook)
    return reads


def luna_modules(model):
    return [mod for mod in model.modules() if isinstance(mod, Luna)]


def test_luna_chains_the_layers_of_a_pretrained_encoder(bert_factory, padded_batch):
    model = bert_factory()
    attnlab.apply_plan(model, "0-2:all:luna(num_memory=3)")
    reads = record_luna_reads(model)
    out = model(**padded_batch).last_hidden_state
    assert reads == [(0, None), (1, 0), (2, 1)]
    out.square().mean().backward()
    first, *later = luna_modules(model)
    assert all(m.memory is first.memory for m in later)  # one P per model (Luna.tie)
    assert len(mechanism_parameters(model)) == 1
    assert first.memory.grad is not None and first.memory.grad.abs().sum() > 0
    reads.clear()
    model(**padded_batch)  # the next forward starts from the learned P again
    assert reads == [(0, None), (1, 0), (2, 1)]


def test_luna_beside_softmax_layers_reads_the_last_luna_memory(bert_factory, padded_batch):
    model = bert_factory()
    report = attnlab.apply_plan(model, "0,2:all:luna(num_memory=3)")
    assert report.table[1] == ["softmax"] * 4
    reads = record_luna_reads(model)
    out = model(**padded_batch).last_hidden_state
    assert reads == [(0, None), (2, 0)]
    assert torch.isfinite(out).all()


def test_luna_needs_whole_layers(bert_factory):
    with pytest.raises(SurgeryError, match="luna"):
        attnlab.apply_plan(bert_factory(), "0:0,1:luna")


def test_luna_in_a_from_scratch_encoder(padded_batch):
    import transformers

    from attnlab.models import encoder_config

    torch.manual_seed(0)
    model = transformers.BertModel(encoder_config("tiny", vocab_size=100,
                                                  max_position_embeddings=64)).train()
    attnlab.apply_plan(model, "all:all:luna(num_memory=4)")
    reads = record_luna_reads(model)
    out = model(**padded_batch).last_hidden_state
    assert reads == [(0, None), (1, 0)]
    (out * padded_batch["attention_mask"][..., None]).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert luna_modules(model)[0].memory.grad.abs().sum() > 0
    assert model.encoder.layer[1].attention.self.query.weight.grad.abs().sum() > 0
