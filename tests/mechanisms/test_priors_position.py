"""gaussian_prior, gaussian_transformer, hardcoded_gaussian: Gaussian position priors.

Each is checked against a naive per-row loop written here (fp32, tolerance 1e-5), padded and
unpadded, causal and not; plus a degenerate case per mechanism (tolerance 1e-6: the same
operations up to float reordering), bad specs, a training step in a tiny BERT, a toy task
whose loss falls, the save/load round trip (exact) and init determinism.
"""

from __future__ import annotations

import math

import pytest
import torch
from plan_step import train_one_step

import attnlab
from attnlab import load_pretrained, save_pretrained
from attnlab.core import RegistryError
from attnlab.hf import apply_plan, capture_attention

B, H, D = 2, 3, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}
TIGHT = {"atol": 1e-6, "rtol": 1e-6}
PLANS = {  # plans on the tiny BERT (4 heads); hardcoded heads read no q/k, so half the heads
    "gaussian_prior": ["all:all:gaussian_prior"],
    "gaussian_transformer": ["all:all:gaussian_transformer"],
    "hardcoded_gaussian": ["all:0,1:hardcoded_gaussian"],
}


def build(spec: str, h: int = H, seed: int = 0):
    torch.manual_seed(seed)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, 64)).eval()


def rand(n, m=None, seed=0, b=B, h=H):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    return tuple(torch.randn(b, h, x, D, generator=g) for x in (n, m, m))


def lengths_mask(m, lengths):
    return torch.arange(m)[None, :] < torch.tensor(lengths)[:, None]


def visible(bi, i, n, m, key_mask, causal):
    """Keys query i of example bi may see (queries aligned to the last n keys)."""
    return [j for j in range(m)
            if (key_mask is None or bool(key_mask[bi, j])) and (not causal or j <= i + m - n)]


def naive(q, k, v, key_mask, causal, logit):
    """out [b,h,n,dv], probs [b,h,n,m] by a loop: softmax_j(logit(bi, hi, i, j)) over the
    visible keys, rows without any visible key left 0."""
    b, h, n, _ = q.shape
    m = k.shape[2]
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    probs = torch.zeros(b, h, n, m, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                js = visible(bi, i, n, m, key_mask, causal)
                if not js:
                    continue
                e = torch.tensor([float(logit(bi, hi, i, j)) for j in js], dtype=torch.float64)
                w = torch.softmax(e, 0)
                for wj, j in zip(w, js, strict=True):
                    probs[bi, hi, i, j] = wj
                    out[bi, hi, i] += wj * v[bi, hi, j].double()
    return out.float(), probs.float()


def dot(q, k, bi, hi, i, j):
    return float(q[bi, hi, i].double() @ k[bi, hi, j].double()) / math.sqrt(D)


# ---------------------------------------------------------------------------- gaussian_prior


def naive_gaussian_prior(mech, q, k, v, key_mask=None, causal=False):
    W, vp, vd = (p.detach().double() for p in (mech.w_p, mech.v_p, mech.v_d))
    m = k.shape[2]

    def logit(bi, hi, i, j):
        length = m if key_mask is None else int(key_mask[bi].sum())  # I
        t = torch.tanh(W[hi] @ q[bi, hi, i].double())  # tanh(W_p q_i)
        centre = length * torch.sigmoid(vp[hi] @ t)  # P_i
        sigma = length * torch.sigmoid(vd[hi] @ t) / 2  # D_i / 2
        return dot(q, k, bi, hi, i, j) - (j - centre) ** 2 / (2 * sigma**2)

    return naive(q, k, v, key_mask, causal, logit)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_gaussian_prior_matches_naive_loop(causal, padded):
    mech = build("gaussian_prior")
    q, k, v = rand(9)
    key_mask = lengths_mask(9, [9, 5]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, pref = naive_gaussian_prior(mech, q, k, v, key_mask, causal)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)


def test_gaussian_prior_padded_row_equals_unpadded_sequence():
    """I is the sequence's own length: padding does not move the centre or the window."""
    mech = build("gaussian_prior")
    q, k, v = rand(10)
    key_mask = lengths_mask(10, [10, 6])
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    alone = mech(q[1:, :, :6], k[1:, :, :6], v[1:, :, :6], attnlab.AttnContext()).out
    torch.testing.assert_close(out[1:, :, :6], alone, **TIGHT)


def test_gaussian_prior_with_zero_v_is_the_fixed_centre_gaussian():
    """Degenerate case: v_p = v_d = 0 gives P_i = D_i = I/2 for every query, i.e. the fixed
    bias -2 (j - I/2)^2 / (I/2)^2, compared with core.reference."""
    mech = build("gaussian_prior")
    with torch.no_grad():
        mech.v_p.zero_()
        mech.v_d.zero_()
    q, k, v = rand(8)
    out = mech(q, k, v, attnlab.AttnContext()).out
    j = torch.arange(8.0)
    bias = (-2 * (j - 4.0) ** 2 / 4.0**2).expand(8, 8)  # [n,m], I = 8
    ref, _ = attnlab.reference_attention(q, k, v, bias=bias)
    torch.testing.assert_close(out, ref, **TIGHT)


def test_gaussian_prior_centre_and_window_lie_in_the_length():
    mech = build("gaussian_prior")
    q, _, _ = rand(7)
    key_mask = lengths_mask(7, [7, 3])
    centre, window = mech.centre_and_window(q * 50, attnlab.AttnContext(key_mask=key_mask), 7)
    top = torch.tensor([7.0, 3.0])[:, None, None]
    for x in (centre, window):
        assert x.shape == (B, H, 7) and (x >= 0).all() and (x <= top).all()


# ----------------------------------------------------------------------- gaussian_transformer


def naive_gaussian_transformer(mech, q, k, v, key_mask=None, causal=False):
    w = torch.nn.functional.softplus(mech.w_raw.detach().double())
    b = -torch.nn.functional.softplus(mech.b_raw.detach().double())
    n, m = q.shape[2], k.shape[2]

    def logit(bi, hi, i, j):
        dist = (i + m - n) - j
        return dot(q, k, bi, hi, i, j) - abs(float(w[hi]) * dist**2 + float(b[hi]))

    return naive(q, k, v, key_mask, causal, logit)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_gaussian_transformer_matches_naive_loop(causal, padded):
    mech = build("gaussian_transformer(w_init=0.3, b_init=-2.0)")
    with torch.no_grad():  # per-head values, so that a head mix-up would show
        mech.w_raw.add_(torch.tensor([0.0, 0.5, -0.5]))
        mech.b_raw.add_(torch.tensor([0.3, 0.0, -0.3]))
    q, k, v = rand(9)
    key_mask = lengths_mask(9, [9, 4]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, pref = naive_gaussian_transformer(mech, q, k, v, key_mask, causal)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)


def test_gaussian_transformer_unequal_lengths_align_queries_to_the_last_keys():
    mech = build("gaussian_transformer")
    q, k, v = rand(4, 7)
    res = mech(q, k, v, attnlab.AttnContext(causal=True, need_weights=True))
    ref, pref = naive_gaussian_transformer(mech, q, k, v, None, True)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)


def test_gaussian_transformer_init_and_constraints():
    mech = build("gaussian_transformer(w_init=0.7, b_init=-0.2)")
    torch.testing.assert_close(mech.w, torch.full((H,), 0.7), **TIGHT)
    torch.testing.assert_close(mech.b, torch.full((H,), -0.2), **TIGHT)
    # whatever the raw values become (here: big steps both ways), w >= 0 and b <= 0
    for raw in (-50.0, 50.0):
        with torch.no_grad():
            mech.w_raw.fill_(raw)
            mech.b_raw.fill_(-raw)
        assert (mech.w >= 0).all() and (mech.b <= 0).all()


def test_gaussian_transformer_with_a_vanishing_prior_is_softmax():
    """Degenerate case: w = softplus(-1e4) = 0 and b = -softplus(-1e4) = 0 give G = 0."""
    mech = build("gaussian_transformer")
    with torch.no_grad():
        mech.w_raw.fill_(-1e4)
        mech.b_raw.fill_(-1e4)
    q, k, v = rand(11)
    key_mask = lengths_mask(11, [11, 7])
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    ref, _ = attnlab.reference_attention(q, k, v, key_mask=key_mask)
    torch.testing.assert_close(out, ref, **TIGHT)


# ------------------------------------------------------------------------ hardcoded_gaussian


def naive_hardcoded(offsets, sigma, q, k, v, key_mask=None, causal=False):
    n, m = q.shape[2], k.shape[2]

    def logit(bi, hi, i, j):
        mu = i + m - n + offsets[hi % len(offsets)]
        # log N(j; mu, sigma^2) up to a constant, which softmax drops
        return -((j - mu) ** 2) / (2 * sigma**2)

    return naive(q, k, v, key_mask, causal, logit)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_hardcoded_gaussian_matches_naive_loop(causal, padded):
    mech = build("hardcoded_gaussian(offsets=[-1, 2], sigma=1.5)")
    q, k, v = rand(9)
    key_mask = lengths_mask(9, [9, 5]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, pref = naive_hardcoded((-1, 2), 1.5, q, k, v, key_mask, causal)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)
    assert torch.allclose(res.probs.sum(-1), pref.sum(-1))  # rows sum to 1 (0 if empty)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, m", [(40, 40), (6, 40)])
def test_hardcoded_gaussian_on_sdpa_equals_the_weights_path(causal, n, m):
    """Without need_weights the prior runs as SDPA's mask (zero q and k): outputs and the
    gradient of v equal the explicit path's (the one the loop test checks) to 1e-5, with
    padding, queries aligned to the last keys (n < m) and a sequence of padding only."""
    mech = build("hardcoded_gaussian(offsets=[-1, 2, 0], sigma=1.5)")
    keep = torch.ones(B, m, dtype=torch.bool)
    keep[0, m - 7 :] = False
    keep[1] = False  # no key at all: its rows give 0
    got = []
    for weights in (False, True):
        q, k, v = (x.requires_grad_() for x in rand(n, m, seed=3))
        ctx = attnlab.AttnContext(key_mask=keep, causal=causal, need_weights=weights)
        out = mech(q, k, v, ctx).out
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        got.append((out.detach(), v.grad))
        assert q.grad is None and k.grad is None  # neither is read
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert got[0][0][1].abs().max() == 0  # the sequence of padding only


def test_hardcoded_gaussian_ignores_queries_and_keys():
    mech = build("hardcoded_gaussian")
    q, k, v = rand(7)
    a = mech(q, k, v, attnlab.AttnContext()).out
    b = mech(torch.randn_like(q), torch.randn_like(k), v, attnlab.AttnContext()).out
    assert torch.equal(a, b)


def test_hardcoded_gaussian_with_tiny_sigma_copies_the_offset_token():
    """Degenerate case: sigma -> 0 puts all mass on key i + o_t (clamped into the sequence:
    the nearest key), so out_i = v_{i + o_t} exactly."""
    offsets = (-1, 0, 2)
    mech = build("hardcoded_gaussian(offsets=[-1, 0, 2], sigma=0.05)")
    q, k, v = rand(8)
    out = mech(q, k, v, attnlab.AttnContext()).out
    for t, o in enumerate(offsets):
        src = (torch.arange(8) + o).clamp(0, 7)
        torch.testing.assert_close(out[:, t], v[:, t, src], **TIGHT)


# ----------------------------------------------------------------------------- shared checks


@pytest.mark.parametrize("spec, fix", [
    ("gaussian_transformer(w_init=-1)", r"w_init must be > 0.*w_init=1.0"),
    ("gaussian_transformer(w_init=0)", r"w_init must be > 0"),
    ("gaussian_transformer(b_init=0.5)", r"b_init must be < 0.*b_init=-1.0"),
    ("hardcoded_gaussian(sigma=0)", r"sigma must be > 0.*sigma=1"),
    ("hardcoded_gaussian(sigma=-2.0)", r"sigma must be > 0"),
    ("hardcoded_gaussian(offsets=[])", r"at least one offset.*offsets=\[-1, 1\]"),
])
def test_bad_specs_are_clear_errors(spec, fix):
    with pytest.raises(RegistryError, match=fix):
        attnlab.build_mechanism(spec, attnlab.HeadDims(4, 8, 64))


@pytest.mark.parametrize("name", ["gaussian_prior", "gaussian_transformer"])
def test_init_is_deterministic_from_the_global_seed(name):
    a, b, c = build(name, seed=0), build(name, seed=0), build(name, seed=1)
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb)
        if name == "gaussian_prior":  # random init; gaussian_transformer's is constant
            assert not torch.equal(pa, pc)


@pytest.mark.parametrize("key", list(PLANS))
def test_trains_one_step_in_a_tiny_bert(bert_factory, padded_batch, key):
    report, _, _ = train_one_step(bert_factory(), PLANS[key], padded_batch)
    assert report.counts_by_name[key] == (12 if key != "hardcoded_gaussian" else 6)


def _fit(student, teacher, steps, lr):
    """Adam on the student's parameters towards the teacher's outputs; the losses."""
    q, k, v = rand(12, seed=3, b=4)
    key_mask = lengths_mask(12, [12, 9, 6, 12])
    ctx = attnlab.AttnContext(key_mask=key_mask)
    with torch.no_grad():
        target = teacher(q, k, v, ctx).out
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = (student(q, k, v, ctx).out - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_gaussian_transformer_learns_a_teacher_prior():
    teacher = build("gaussian_transformer(w_init=0.05, b_init=-3.0)")
    student = build("gaussian_transformer(w_init=1.0, b_init=-0.5)").train()
    losses = _fit(student, teacher, steps=15, lr=0.3)
    assert losses[-1] < 0.25 * losses[0], losses


def test_gaussian_prior_learns_a_teacher_prior():
    teacher, student = build("gaussian_prior", seed=1), build("gaussian_prior", seed=0).train()
    losses = _fit(student, teacher, steps=10, lr=0.05)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("key", list(PLANS))
def test_save_load_round_trip(bert_factory, padded_batch, tmp_path, key):
    model = bert_factory()
    apply_plan(model, PLANS[key])
    with torch.no_grad():  # move the parameters off their init, so a re-init cannot match
        for name, p in model.named_parameters():
            if ".attnlab." in name:
                p.add_(0.1 * torch.randn_like(p))
        ref = model(**padded_batch).last_hidden_state
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(**padded_batch).last_hidden_state, ref)


@pytest.mark.parametrize("key", list(PLANS))
def test_capture_attention_returns_probabilities(bert_factory, padded_batch, key):
    model = bert_factory()
    apply_plan(model, PLANS[key])
    cache = capture_attention(model, padded_batch)
    real = padded_batch["attention_mask"].bool()  # [b,n]
    for layer in range(3):
        probs = cache[layer]
        assert probs.shape == (3, 4, 12, 12)
        assert (probs[~real[:, None, None, :].expand_as(probs)] == 0).all()  # padded keys
        sums = probs.sum(-1)  # [b,h,n]
        torch.testing.assert_close(sums, torch.ones_like(sums), **TOL)


def _dense_hardcoded(mech, v, n, ctx):
    """The weights path (``attend_rows`` over the [h, n, m] prior), which the loop test
    checks."""
    from attnlab.mechanisms._rowchunks import attend_rows

    logits = mech.logits(n, v.shape[2], v.device, v.dtype).to(v.dtype)[None]
    return attend_rows(logits, v, ctx, False)[0]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec, n, m", [
    ("hardcoded_gaussian", 200, 200),
    ("hardcoded_gaussian(offsets=[-1, 2, 0], sigma=1.5)", 260, 260),
    ("hardcoded_gaussian(offsets=[-3, 0], sigma=0.4)", 90, 300),
    ("hardcoded_gaussian(offsets=[1], sigma=2.5)", 420, 420),
])
def test_hardcoded_gaussian_window_equals_the_dense_prior(spec, n, m, causal, dtype, tol):
    """At length the mechanism runs as a depthwise convolution over the lags that reach the
    sum (``_gaussian_window``), rows far from every visible key around their nearest one:
    outputs and v's gradient equal the dense prior's, with right padding (queries deep in
    it), a hole in the middle, a sequence with one key, one of padding only, n < m."""
    mech = build(spec)
    assert mech.windowed(n, m, dtype, causal)
    keep = torch.ones(4, m, dtype=torch.bool)
    keep[0, m - 90:] = False  # right padding: queries up to 90 keys from a visible one
    keep[1, 40:120] = False  # a hole
    keep[2] = False
    keep[2, m // 3] = True  # one key
    keep[3] = False  # padding only: its rows give 0
    ctx = attnlab.AttnContext(key_mask=keep, causal=causal)
    got = []
    for dense in (False, True):
        g = torch.Generator().manual_seed(5)
        v = torch.randn(4, H, m, D, generator=g, dtype=dtype).requires_grad_()
        q = torch.randn(4, H, n, D, generator=g, dtype=dtype)
        out = _dense_hardcoded(mech, v, n, ctx) if dense else mech(q, v, v, ctx).out
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view(out.shape)).sum().backward()
        got.append((out.detach(), v.grad))
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert got[0][0][3].abs().max() == 0


def test_hardcoded_gaussian_window_only_at_length():
    """Short inputs, other dtypes and n > m keep the dense prior."""
    mech = build("hardcoded_gaussian")
    assert mech.windowed(64, 64, torch.float32, False) is False  # 33 lags: over half of 64
    assert mech.windowed(66, 66, torch.float32, False)
    assert not mech.windowed(512, 512, torch.bfloat16, False)
    assert not mech.windowed(600, 512, torch.float32, False)
