"""multiscale, capsule_routing, gqa and head_size against naive references, in plans.

Tolerances: fp32 1e-5 against the naive references (same products, other summation order);
exact equality (torch.equal) where the degenerate case runs the very same operations
(gqa with g = h vs softmax, g = 1 vs mqa) and for reloaded models.
"""

from __future__ import annotations

import pytest
import torch
from plan_step import train_one_step

import attnlab
from attnlab import apply_plan, load_pretrained, save_pretrained
from attnlab.analysis import TokenInfo, build_report, example_maps, score_heads
from attnlab.core import RegistryError, masked_softmax
from attnlab.hf import SurgeryError
from attnlab.mechanisms.heads_structure import layer_windows, squash

B, H, D = 2, 4, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def build(spec, h=H, d=D, seed=0):
    torch.manual_seed(seed)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, d, 64)).eval()


def rand(n, h=H, kv_heads=None, dk=D, dv=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    hk = h if kv_heads is None else kv_heads
    return (torch.randn(B, h, n, dk, generator=g), torch.randn(B, hk, n, dk, generator=g),
            torch.randn(B, hk, n, dv, generator=g))


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [b,n]


def naive_softmax(q, k, v, allowed, scale):
    """Per head: softmax over the allowed keys (allowed [b,h,n,m] bool), explicit masks."""
    scores = (q @ k.transpose(-1, -2)) * scale  # [b,h,n,m]
    p = masked_softmax(scores, allowed)
    return p @ v, p


def allowed_keys(b, h, n, m, key_mask=None, causal=False, windows=None):
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    allowed = torch.ones(b, h, n, m, dtype=torch.bool)
    if windows is not None:
        for head, w in enumerate(windows):
            if w >= 0:
                allowed[:, head] &= (i - j).abs() <= w
    if causal:
        allowed &= j <= i
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    return allowed


# ------------------------------------------------------------------------------ multiscale


def naive_multiscale(q, k, v, windows, key_mask=None, causal=False):
    b, h, n, d = q.shape
    allowed = allowed_keys(b, h, n, k.shape[2], key_mask, causal, windows)
    return naive_softmax(q, k, v, allowed, d**-0.5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_multiscale_listed_windows_match_naive(causal, padded):
    windows = (0, 2, 5, -1)
    mech = build(f"multiscale(windows={list(windows)})")
    q, k, v = (t.requires_grad_() for t in rand(11, seed=1))
    key_mask = lengths_mask(11, [11, 6]) if padded else None
    ctx = attnlab.AttnContext(key_mask=key_mask, causal=causal, need_weights=True)
    res = mech(q, k, v, ctx)
    ref, pref = naive_multiscale(q, k, v, windows, key_mask, causal)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)
    fast = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal)).out
    torch.testing.assert_close(fast, ref, **TOL)
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(fast, (q, k, v), g, retain_graph=True),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, **TOL)
    bias = mech.bias(11, 11)  # [h,n,m]: each head's band
    assert bias.shape == (H, 11, 11)
    assert torch.equal(bias == 0, allowed_keys(1, H, 11, 11, windows=windows)[0])


def test_multiscale_long_input_runs_the_blocked_band_per_window_group():
    mech = build("multiscale(windows=[3, 3, 17, -1])")
    n = 300  # >= the blocked engine's threshold (256)
    q, k, v = (t.requires_grad_() for t in rand(n, seed=2))
    key_mask = lengths_mask(n, [300, 211])
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    ref, _ = naive_multiscale(q, k, v, (3, 3, 17, -1), key_mask)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, **TOL)


def test_multiscale_by_layer_schedule():
    omega = (1, 2, 4, 8, 16, -1)
    assert layer_windows(omega, 2, 4, 0) == (1, 1, 2, 2)  # layer 0: the two smallest scales
    assert layer_windows(omega, 2, 4, 1) == (1, 2, 2, 4)  # each layer adds the next scale
    assert layer_windows(omega, 2, 4, 4) == (1, 4, 8, -1)  # all six, both ends kept
    assert layer_windows(omega, 2, 12, 9) == tuple(s for s in omega for _ in range(2))
    assert layer_windows(omega, 2, 1, 0) == (2,)  # one head: the layer's largest scale
    for h in (1, 4, 12):  # small windows low, large high: per head never shrinking
        rows = [layer_windows(omega, 2, h, layer) for layer in range(8)]
        span = [[float("inf") if w < 0 else w for w in row] for row in rows]
        for lo, hi in zip(span, span[1:], strict=False):
            assert all(a <= b for a, b in zip(lo, hi, strict=True))
        assert sum(span[0]) < sum(span[-1])


@pytest.mark.parametrize("layer", [0, 1, 4])
def test_multiscale_by_layer_forward_reads_ctx_layer_idx(layer):
    mech = build("multiscale")
    q, k, v = rand(13, seed=3)
    key_mask = lengths_mask(13, [13, 8])
    windows = layer_windows((1, 2, 4, 8, 16, -1), 2, H, layer)
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, layer_idx=layer,
                                            need_weights=True))
    ref, pref = naive_multiscale(q, k, v, windows, key_mask)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)
    assert torch.equal(mech.bias(13, 13, layer_idx=layer) == 0,
                       allowed_keys(1, H, 13, 13, windows=windows)[0])


def test_multiscale_by_layer_in_a_model_follows_each_layers_index(bert_factory, padded_batch):
    model = bert_factory()
    apply_plan(model, "all:all:multiscale(scales=[0, 1, 3, -1], spread=1)")
    cache = attnlab.capture_attention(model, padded_batch)
    key_mask = padded_batch["attention_mask"].bool()
    real = key_mask[:, None, :, None] & key_mask[:, None, None, :]  # [b,1,n,m]
    assert layer_windows((0, 1, 3, -1), 1, H, 2) == (0, 1, 1, 3)
    for layer in range(3):
        windows = layer_windows((0, 1, 3, -1), 1, H, layer)  # (0,0,0,0), (0,0,1,1), ...
        banded = allowed_keys(1, H, 12, 12, windows=windows)  # [1,h,n,m]
        p = cache[layer]  # [b,h,n,m]
        assert (p[(~banded).expand_as(p)] == 0).all()
        assert (p[(banded & real).expand_as(p)] > 0).all()  # every in-window real key


def test_multiscale_bad_specs():
    with pytest.raises(ValueError, match="one window per head"):
        build("multiscale(windows=[1, 2, 3])")
    for spec, match in [("multiscale(windows=[1, -2, 3, 4])", "windows must be >= 0"),
                        ("multiscale(scales=[4, 2, -1])", "ascending order"),
                        ("multiscale(scales=[1, -1, 4])", "ascending order"),
                        ("multiscale(scales=[])", "at least one scale"),
                        ("multiscale(spread=0)", "spread must be >= 1"),
                        ("multiscale(windows=[1, 2, 3, 4], spread=3)", "not both")]:
        with pytest.raises(RegistryError, match=match):
            attnlab.core.resolve_config(spec)


# ------------------------------------------------------------------------ capsule routing


def naive_capsules(u, W, iterations):
    """Dynamic routing token by token with explicit loops over capsules: u [b,h,n,d]."""
    b, h, n, d = u.shape
    out = torch.zeros_like(u)
    for bi in range(b):
        for t in range(n):
            votes = [[W[i, j].T @ u[bi, i, t] for j in range(h)] for i in range(h)]
            logits = torch.zeros(h, h)
            for r in range(iterations):
                c = torch.softmax(logits, dim=1)  # over output capsules j
                caps = []
                for j in range(h):
                    s = sum(c[i, j] * votes[i][j] for i in range(h))
                    norm2 = (s * s).sum()
                    caps.append(norm2 / (1 + norm2) * s / norm2.sqrt().clamp_min(1e-30))
                if r + 1 < iterations:
                    logits = logits + torch.stack([torch.stack(
                        [votes[i][j] @ caps[j] for j in range(h)]) for i in range(h)])
            for j in range(h):
                out[bi, j, t] = caps[j]
    return out


@pytest.mark.parametrize("iterations,causal,padded", [(3, False, True), (3, True, False),
                                                      (1, False, False), (2, True, True)])
def test_capsule_routing_matches_naive(iterations, causal, padded):
    h, d, n = 3, 4, 6
    mech = build(f"capsule_routing(iterations={iterations})", h=h, d=d)
    q, k, v = (t.requires_grad_() for t in rand(n, h=h, dk=d, dv=d, seed=4))
    key_mask = lengths_mask(n, [6, 4]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    heads, pref = naive_softmax(q, k, v, allowed_keys(B, h, n, n, key_mask, causal), d**-0.5)
    ref = naive_capsules(heads, mech.W, iterations)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)  # the input heads' maps
    g = torch.randn_like(ref)
    params = (q, k, v, mech.W)
    for a, r in zip(torch.autograd.grad(res.out, params, g),
                    torch.autograd.grad(ref, params, g), strict=True):
        torch.testing.assert_close(a, r, **TOL)


def test_capsule_routing_one_head_is_squashed_vote():
    """Degenerate case h = 1: one input and one output capsule, c = 1 at every iteration."""
    mech = build("capsule_routing", h=1, d=D)
    q, k, v = rand(5, h=1, seed=5)
    out = mech(q, k, v, attnlab.AttnContext()).out
    heads, _ = naive_softmax(q, k, v, allowed_keys(B, 1, 5, 5), D**-0.5)
    torch.testing.assert_close(out, squash(heads @ mech.W[0, 0]), **TOL)


def test_capsule_routing_mixes_heads_and_init_is_seeded():
    mech = build("capsule_routing", seed=3)
    assert mech.W.shape == (H, H, D, D)
    assert torch.equal(mech.W, build("capsule_routing", seed=3).W)
    assert not torch.equal(mech.W, build("capsule_routing", seed=4).W)
    assert abs(mech.W.std().item() - D**-0.5) < 0.05  # N(0, 1/d)
    q, k, v = rand(6, seed=6)
    v2 = v.clone()
    v2[:, 1] = torch.randn_like(v2[:, 1])
    a = mech(q, k, v, attnlab.AttnContext()).out
    b = mech(q, k, v2, attnlab.AttnContext()).out
    assert not torch.allclose(a[:, 0], b[:, 0])  # head 1's values reach output capsule 0


def test_squash_is_zero_with_finite_gradient_at_zero():
    s = torch.zeros(3, 4, requires_grad=True)
    out = squash(s)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(3, 4)) and torch.isfinite(s.grad).all()
    x = torch.randn(5, 4)
    norm = x.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(squash(x), norm**2 / (1 + norm**2) * x / norm, **TOL)


def test_capsule_routing_bad_spec():
    with pytest.raises(RegistryError, match="iterations must be >= 1"):
        attnlab.build_mechanism("capsule_routing(iterations=0)", attnlab.HeadDims(H, D))


# ------------------------------------------------------------------------------------ gqa


def naive_gqa(q, k, v, g, key_mask=None, causal=False):
    """Query head i reads K/V head i // (h/g): the mean of the group's heads when k, v
    have h heads."""
    b, h, n, d = q.shape
    if k.shape[1] == h:
        k = torch.stack([k[:, j * h // g:(j + 1) * h // g].mean(1) for j in range(g)], 1)
        v = torch.stack([v[:, j * h // g:(j + 1) * h // g].mean(1) for j in range(g)], 1)
    k = torch.stack([k[:, i // (h // g)] for i in range(h)], 1)
    v = torch.stack([v[:, i // (h // g)] for i in range(h)], 1)
    return naive_softmax(q, k, v, allowed_keys(b, h, n, k.shape[2], key_mask, causal), d**-0.5)


@pytest.mark.parametrize("kv_in", [2, H])
@pytest.mark.parametrize("causal,padded", [(False, True), (True, False)])
def test_gqa_matches_naive(kv_in, causal, padded):
    mech = build("gqa(kv_heads=2)")
    assert mech.caps.kv_heads == 2 and type(mech).caps.kv_heads is None
    q, k, v = (t.requires_grad_() for t in rand(9, kv_heads=kv_in, seed=7))
    key_mask = lengths_mask(9, [9, 3]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, pref = naive_gqa(q, k, v, 2, key_mask, causal)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(res.out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, **TOL)


def test_gqa_degenerate_cases_equal_mha_and_mqa():
    q, k, v = rand(8, seed=8)
    key_mask = lengths_mask(8, [8, 5])
    for causal in (False, True):
        ctx = attnlab.AttnContext(key_mask=key_mask, causal=causal)
        mha = build("softmax")(q, k, v, ctx).out
        assert torch.equal(build(f"gqa(kv_heads={H})")(q, k, v, ctx).out, mha)
        mqa = build("mqa")(q, k, v, ctx).out
        assert torch.equal(build("gqa(kv_heads=1)")(q, k, v, ctx).out, mqa)
        one = (k.mean(1, keepdim=True), v.mean(1, keepdim=True))
        assert torch.equal(build("gqa(kv_heads=1)")(q, *one, ctx).out, mqa)


def test_gqa_bad_specs():
    with pytest.raises(ValueError, match=r"divide the 4 query heads; use one of \[1, 2, 4\]"):
        build("gqa(kv_heads=3)")
    with pytest.raises(RegistryError, match="kv_heads must be >= 1"):
        attnlab.core.resolve_config("gqa(kv_heads=0)")
    with pytest.raises(ValueError, match="accepted K/V head counts"):
        build("gqa(kv_heads=2)")(*rand(5, kv_heads=1), attnlab.AttnContext())


def test_gqa_surgery_mean_pools_each_group(bert_factory, padded_batch):
    model = bert_factory()
    attn = model.encoder.layer[1].attention.self
    w, bias = attn.key.weight.detach().clone(), attn.key.bias.detach().clone()
    report = apply_plan(model, "1:all:gqa(kv_heads=2)")
    assert attn.key.weight.shape == (16, 32) and attn.value.weight.shape == (16, 32)
    pooled = w.view(2, 2, 8, 32).mean(1).reshape(16, 32)  # heads (0,1) -> 0, (2,3) -> 1
    torch.testing.assert_close(attn.key.weight, pooled, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(attn.key.bias, bias.view(2, 2, 8).mean(1).reshape(16),
                               atol=1e-6, rtol=1e-6)
    assert report.kv_heads == {1: 2} and report.params_removed == 2 * 2 * (8 * 32 + 8)
    with pytest.raises(SurgeryError, match="cannot be undone"):
        apply_plan(model, "softmax")
    same = bert_factory()
    ref = same(**padded_batch).last_hidden_state
    report = apply_plan(same, f"1:all:gqa(kv_heads={H})")  # g = h: nothing to shrink
    assert report.kv_heads == {} and same.encoder.layer[1].attention.self.key.out_features == 32
    torch.testing.assert_close(same(**padded_batch).last_hidden_state, ref, **TOL)


# ------------------------------------------------------------------------------ head_size


@pytest.mark.parametrize("causal,padded", [(False, True), (True, False)])
def test_head_size_standalone_is_softmax_at_dk_scale(causal, padded):
    mech = build("head_size(dk=16, dv=12)")
    q, k, v = (t.requires_grad_() for t in rand(7, dk=16, dv=12, seed=9))
    key_mask = lengths_mask(7, [7, 4]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, pref = naive_softmax(q, k, v, allowed_keys(B, H, 7, 7, key_mask, causal), 16**-0.5)
    assert res.out.shape == (B, H, 7, 12)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, pref, **TOL)


def test_head_size_bad_specs_and_inputs(bert_factory):
    with pytest.raises(RegistryError, match="dk must be >= 1"):
        attnlab.core.resolve_config("head_size(dk=0)")
    with pytest.raises(ValueError, match="install it with attnlab.apply_plan"):
        build("head_size(dk=16)")(*rand(5), attnlab.AttnContext())
    model = bert_factory()
    with pytest.raises(SurgeryError, match="choose dk and dv as multiples of 2"):
        apply_plan(model, "0:all:head_size(dk=3)")  # h*dk = 12 is no multiple of d = 8
    with pytest.raises(SurgeryError, match="scope 'module'"):
        apply_plan(model, "0:0:head_size(dk=16)")
    assert model.encoder.layer[0].attention.self.query.out_features == 32  # untouched


def self_attention_reference(attn, hidden, key_mask, dk, dv):
    """BertSelfAttention recomputed by hand from its (re-sized) projection weights:
    [b,n,hidden] -> [b,n,h*dv]."""
    b, n, _ = hidden.shape
    q = (hidden @ attn.query.weight.T + attn.query.bias).view(b, n, H, dk).transpose(1, 2)
    k = (hidden @ attn.key.weight.T + attn.key.bias).view(b, n, H, dk).transpose(1, 2)
    v = (hidden @ attn.value.weight.T + attn.value.bias).view(b, n, H, dv).transpose(1, 2)
    out, _ = naive_softmax(q, k, v, allowed_keys(b, H, n, n, key_mask), dk**-0.5)
    return out.transpose(1, 2).reshape(b, n, H * dv)


@pytest.mark.parametrize("dk,dv", [(16, 12), (4, 6)])
def test_head_size_surgery_resizes_projections(bert_factory, padded_batch, dk, dv):
    model = bert_factory()
    ref = model(**padded_batch).last_hidden_state
    torch.manual_seed(0)
    report = apply_plan(model, f"1:all:head_size(dk={dk}, dv={dv})")
    attn = model.encoder.layer[1].attention.self
    dense = model.encoder.layer[1].attention.output.dense
    assert attn.query.weight.shape == attn.key.weight.shape == (H * dk, 32)
    assert attn.value.weight.shape == (H * dv, 32) and dense.weight.shape == (32, H * dv)
    assert attn.scaling == dk**-0.5 and report.head_dims == {1: (dk, dv)}
    grown = 2 * H * (dk - 8) * 33 + H * (dv - 8) * 33 + H * (dv - 8) * 32
    assert report.params_added - report.params_removed == grown
    assert f"[head dims: dk={dk}, dv={dv}]" in str(report)
    seen = {}

    def grab(module, args, kwargs, out):  # the layer's input and its [b,n,h*dv] output
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["y"] = out[0]

    attn.register_forward_hook(grab, with_kwargs=True)
    out = model(**padded_batch).last_hidden_state
    key_mask = padded_batch["attention_mask"].bool()
    expect = self_attention_reference(attn, seen["x"], key_mask, dk, dv)
    live = key_mask[:, :, None].expand_as(expect)
    torch.testing.assert_close(seen["y"][live], expect[live], **TOL)
    if dk >= 8 and dv >= 8:  # the conversion keeps the pretrained function
        torch.testing.assert_close(out, ref, **TOL)
    else:
        assert not torch.allclose(out, ref, atol=1e-3)
    with pytest.raises(SurgeryError, match="re-sized .* cannot be undone"):
        apply_plan(model, "softmax")


def test_head_size_at_the_host_size_changes_nothing(bert_factory, padded_batch):
    model = bert_factory()
    ref = model(**padded_batch).last_hidden_state
    key = model.encoder.layer[0].attention.self.key
    report = apply_plan(model, "0:all:head_size(dk=8, dv=8)")
    assert model.encoder.layer[0].attention.self.key is key and report.head_dims == {}
    torch.testing.assert_close(model(**padded_batch).last_hidden_state, ref, **TOL)


def test_head_size_on_distilbert_resizes_out_lin():
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    model = DistilBertModel(DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=H, hidden_dim=64,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)).eval()
    ids = torch.randint(5, 100, (2, 9))
    mask = lengths_mask(9, [9, 6]).long()
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    report = apply_plan(model, "1:all:head_size(dk=16, dv=12)")
    attn = model.transformer.layer[1].attention
    assert attn.q_lin.out_features == 64 and attn.v_lin.out_features == 48
    assert attn.out_lin.in_features == 48 and report.head_dims == {1: (16, 12)}
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], **TOL)  # dk, dv >= d: same function


def test_prefix_tuning_refuses_resized_heads(bert_factory):
    from attnlab.tuning import TaskInfo, resolve_tuning

    model = bert_factory("BertForSequenceClassification", num_labels=2)
    apply_plan(model, "2:all:head_size(dk=16)")
    tuner, cfg = resolve_tuning("prefix(num_virtual_tokens=2)")
    with pytest.raises(ValueError, match=r"re-sized the heads of layers \[2\]"):
        tuner.apply(model, cfg, task=TaskInfo(kind="single"))


# ------------------------------------------------------------------- all four in one plan

PLAN = ["0:all:multiscale(windows=[1, 1, 2, -1])", "1:all:capsule_routing",
        "2:all:gqa(kv_heads=2)", "3:all:head_size(dk=16, dv=12)"]


def planned(bert_factory, seed=0):
    model = bert_factory(num_hidden_layers=4)
    torch.manual_seed(seed)
    return model, apply_plan(model, PLAN)


def test_plan_trains_one_step(bert_factory, padded_batch):
    model = bert_factory(num_hidden_layers=4)
    report, before, after = train_one_step(model, PLAN, padded_batch)
    assert report.counts_by_name == {"multiscale": 4, "capsule_routing": 4, "gqa": 4,
                                     "head_size": 4}
    assert not torch.equal(before, after)
    W = model.encoder.layer[1].attention.self.attnlab.mechanisms[0].W
    assert W.grad is not None and W.grad.abs().sum() > 0


def test_learned_parameters_lower_a_toy_loss(bert_factory, padded_batch):
    """Only what the plan learns is trained: capsule votes W, gqa's shrunk K/V projections,
    head_size's re-sized Q/K/V and output projections; everything else is frozen."""
    model, _ = planned(bert_factory)
    layers = model.encoder.layer
    learned = [layers[1].attention.self.attnlab.mechanisms[0].W,
               *layers[2].attention.self.key.parameters(),
               *layers[2].attention.self.value.parameters(),
               *(p for name in ("query", "key", "value")
                 for p in getattr(layers[3].attention.self, name).parameters()),
               *layers[3].attention.output.dense.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in learned:
        p.requires_grad_(True)
    opt = torch.optim.Adam(learned, lr=1e-2)
    mask = padded_batch["attention_mask"][..., None].float()
    target = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(0))
    losses = []
    model.train()
    for _ in range(4):
        out = model(**padded_batch).last_hidden_state  # [b,n,hidden]
        loss = ((out - target).square() * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_init_is_seeded_and_round_trips(bert_factory, padded_batch, tmp_path):
    a, _ = planned(bert_factory, seed=3)
    b, _ = planned(bert_factory, seed=3)
    c, _ = planned(bert_factory, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[key], sb[key]) for key in sa)
    for key in ("encoder.layer.1.attention.self.attnlab.mechanisms.0.W",  # capsule votes
                "encoder.layer.3.attention.self.key.weight"):  # head_size's new K rows
        assert not torch.equal(sa[key], sc[key])
    with torch.no_grad():
        a.encoder.layer[1].attention.self.attnlab.mechanisms[0].W.add_(0.05)
        ref = a(**padded_batch).last_hidden_state
    save_pretrained(a, tmp_path)
    loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(**padded_batch).last_hidden_state, ref)
    attn = loaded.encoder.layer[3].attention.self
    assert attn.key.out_features == H * 16 and attn.scaling == 16**-0.5


def test_maps_reach_capture_and_the_html_report(bert_factory, padded_batch, tmp_path):
    model, report = planned(bert_factory)
    cache = attnlab.capture_attention(model, padded_batch)
    key_mask = padded_batch["attention_mask"].bool()
    for layer in range(4):
        p = cache[layer]  # [b,h,n,m]
        assert p.shape == (3, H, 12, 12)
        rows = p.sum(-1)[key_mask[:, None, :].expand(-1, H, -1)]
        torch.testing.assert_close(rows, torch.ones_like(rows), **TOL)
        assert (p[~key_mask[:, None, None, :].expand_as(p)] == 0).all()
    banded = allowed_keys(1, H, 12, 12, windows=(1, 1, 2, -1))[0]
    assert (cache[0][:, ~banded] == 0).all()  # multiscale: each head in its own window
    infos = [TokenInfo.from_length(int(n)) for n in key_mask.sum(1)]
    out = build_report(tmp_path / "report.html", title="heads structure",
                       scores=score_heads(cache, infos), examples=example_maps(cache, infos),
                       surgery=report.to_dict())
    text = out.read_text(encoding="utf-8")
    for name in ("multiscale", "capsule_routing", "gqa", "head_size"):
        assert name in text
