"""collaborative and adaptive_span against loop references and in their degenerate cases
(collaborative at full rank reproduces a layer's heads; adaptive_span with z >= n is
softmax), the collaborative conversion (CP decomposition, error against rank), surgery of
the query/key projections, training, seeding, save/load, capture and the HTML report.

Tolerances: fp32 1e-5 (same products, different order); the converted full-rank layer vs
the original model 1e-4 (the acceptance bound; measured ~4e-7); CP recovery of an exact
rank-3 tensor 1e-6 (float64 ALS).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from plan_step import train_one_step
from saved import kept_for_backward
from test_lowrank import mechanism_parameters, round_trip, train_mechanisms

import attnlab
from attnlab import apply_plan
from attnlab.core import RegistryError
from attnlab.hf import SurgeryError
from attnlab.mechanisms.heads_span import collaborative_error_curve, cp_als

B, H, D = 3, 4, 8


def build(spec, h=H):
    torch.manual_seed(0)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, 64)).eval()


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def softmax_rows(scores, allowed):
    """Row softmax over allowed entries by hand; rows with nothing allowed -> zeros."""
    out = torch.zeros_like(scores)
    for idx in torch.nonzero(allowed.any(-1)).tolist():
        keep = allowed[tuple(idx)]
        out[tuple(idx)][keep] = torch.softmax(scores[tuple(idx)][keep], 0)
    return out


# ---------------------------------------------------------------------------- collaborative


def naive_collaborative(qs, ks, v, mixing, content, key_mask=None, causal=False):
    """Per example and head: s = ((q~ * m_h + u_h) k~^T) / sqrt(d), softmax, times V_h.
    qs [b,n,Dk], ks [b,m,Dk], v [b,h,m,d]."""
    b, n, _ = qs.shape
    m = ks.shape[1]
    out = torch.zeros(b, mixing.shape[0], n, v.shape[-1])
    for bi in range(b):
        for h in range(mixing.shape[0]):
            s = (qs[bi] * mixing[h] + content[h]) @ ks[bi].T * D**-0.5  # [n,m]
            allowed = torch.ones(n, m, dtype=torch.bool)
            if key_mask is not None:
                allowed &= key_mask[bi][None, :]
            if causal:
                allowed &= torch.arange(m)[None, :] <= torch.arange(n)[:, None]
            out[bi, h] = softmax_rows(s, allowed) @ v[bi, h]
    return out


def heads_view(x, d=D):
    """[b, L, Dk] -> the host's view [b, Dk/d, L, d]."""
    b, L, dk = x.shape
    return x.view(b, L, dk // d, d).transpose(1, 2)


@pytest.mark.parametrize("dk", [16, 32])
@pytest.mark.parametrize("lengths,causal", [(None, False), ([11, 6, 1], False),
                                            ([11, 4, 9], True)])
def test_collaborative_equals_loop_reference(dk, lengths, causal):
    mech = build(f"collaborative(dk_shared={dk})")
    with torch.no_grad():
        mech.content.normal_()  # u_h off its 0 init
    g = torch.Generator().manual_seed(dk)
    qs, ks = torch.randn(B, 11, dk, generator=g), torch.randn(B, 11, dk, generator=g)
    v = torch.randn(B, H, 11, D, generator=g)
    key_mask = None if lengths is None else lengths_mask(11, lengths)
    ctx = attnlab.AttnContext(key_mask=key_mask, causal=causal)
    res = mech(heads_view(qs), heads_view(ks), v, ctx)
    ref = naive_collaborative(qs, ks, v, mech.mixing.detach(), mech.content.detach(),
                              key_mask, causal)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    with_probs = mech(heads_view(qs), heads_view(ks), v,
                      attnlab.AttnContext(key_mask=key_mask, causal=causal, need_weights=True))
    torch.testing.assert_close(with_probs.out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_probs.probs @ v, ref, atol=1e-5, rtol=1e-5)


def _pretrained_like(bert_factory):
    """A tiny BERT whose scores are far from uniform and whose Q/K biases are non-zero."""
    model = bert_factory()
    with torch.no_grad():
        for layer in model.encoder.layer:
            att = layer.attention.self
            for lin in (att.query, att.key):
                lin.weight.mul_(8.0)
                lin.bias.normal_(std=0.5)
    return model


@pytest.mark.parametrize("spec", ["collaborative", "collaborative(dk_shared=40)"])
def test_full_rank_conversion_reproduces_the_pretrained_heads(spec, bert_factory, padded_batch):
    """Degenerate case: at Dk >= h*d the converted layer computes what the heads did."""
    ref_model, model = _pretrained_like(bert_factory), _pretrained_like(bert_factory)
    with torch.no_grad():
        ref = ref_model(**padded_batch).last_hidden_state
    report = apply_plan(model, f"all:all:{spec}")
    with torch.no_grad():
        out = model(**padded_batch).last_hidden_state
    real = padded_batch["attention_mask"].bool()
    assert (out - ref)[real].abs().max() < 1e-4
    for layer in model.encoder.layer:
        assert layer.attention.self.attnlab.mechanisms[0].conversion_error == (0.0, 0.0)
    dk = 32 if spec == "collaborative" else 40
    q = model.encoder.layer[0].attention.self.query
    assert type(q) is torch.nn.Linear and q.weight.shape == (dk, 32) and q.bias is None
    assert report.params_removed == 3 * 2 * (32 * 32 + 32)
    assert report.params_added == 3 * (2 * dk * 32 + 2 * H * dk)


def test_low_rank_conversion_reports_the_error_of_what_it_installed(bert_factory,
                                                                    padded_batch):
    """Below h*d: T^ rebuilt from the installed W~_Q, M, W~_K has exactly the reported
    error against the layer's T[:, h, :] = W_Q^h^T W_K^h, and so has the content bias."""
    model = _pretrained_like(bert_factory)
    att = model.encoder.layer[1].attention.self
    wq, wk, bq = (x.detach().clone() for x in (att.query.weight, att.key.weight,
                                               att.query.bias))
    torch.manual_seed(0)
    apply_plan(model, "all:all:collaborative(dk_shared=16)")
    mech = att.attnlab.mechanisms[0]
    t = torch.einsum("hdq,hdk->qhk", wq.view(H, D, 32), wk.view(H, D, 32)).double()
    with torch.no_grad():
        t_hat = torch.einsum("rq,hr,rk->qhk", att.query.weight, mech.mixing, att.key.weight)
        c_hat = (mech.content @ att.key.weight).double()
    err = float((t - t_hat.double()).norm() / t.norm())
    assert 0 < mech.conversion_error[0] < 1
    assert err == pytest.approx(mech.conversion_error[0], rel=1e-5)
    c = torch.einsum("hd,hdk->hk", bq.view(H, D), wk.view(H, D, 32)).double()
    assert float((c - c_hat).norm() / c.norm()) == pytest.approx(mech.conversion_error[1],
                                                                 rel=1e-5)
    with torch.no_grad():
        assert torch.isfinite(model(**padded_batch).last_hidden_state).all()


def test_error_against_rank_falls_to_zero_at_full_rank(bert_factory):
    att = _pretrained_like(bert_factory).encoder.layer[0].attention.self
    torch.manual_seed(0)
    curve = collaborative_error_curve(att.query.weight, att.key.weight, H, [4, 8, 16, 24, 32],
                                      b_q=att.query.bias)
    errors = [e for _, e, _ in curve]
    assert [r for r, _, _ in curve] == [4, 8, 16, 24, 32]
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert curve[-1][1:] == (0.0, 0.0) and errors[0] > 0.5


def test_cp_als_recovers_an_exact_low_rank_tensor():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(s, 3, generator=g, dtype=torch.float64) for s in (10, 5, 7))
    t = torch.einsum("ir,jr,kr->ijk", a, b, c)
    fa, fb, fc, err = cp_als(t, 3, iters=500, tol=1e-14, generator=g)
    assert err < 1e-6
    torch.testing.assert_close(torch.einsum("ir,jr,kr->ijk", fa, fb, fc), t, atol=1e-5,
                               rtol=0)


def test_collaborative_spec_errors_name_the_fix():
    for spec, match in [("collaborative(dk_shared=0)", "must be >= 1"),
                        ("collaborative(als_iters=0)", "als_iters must be >= 1"),
                        ("collaborative(mixing_init='random')", "must be one of")]:
        with pytest.raises(RegistryError, match=match):
            build(spec)
    with pytest.raises(ValueError, match=r"multiple of the head dim d=8.*dk_shared=8 or 16"):
        build("collaborative(dk_shared=12)")
    with pytest.raises(ValueError, match=r"Dk = dk_shared = 16"):
        build("collaborative(dk_shared=16)")(*(torch.randn(1, H, 5, D) for _ in range(3)),
                                             attnlab.AttnContext())


def test_surgery_refuses_fused_hosts_and_reapplying(bert_factory):
    from transformers import ModernBertConfig

    from attnlab.hf import check_model_config

    cfg = ModernBertConfig(vocab_size=100, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64, pad_token_id=0)
    with pytest.raises(SurgeryError, match="fused Q/K/V projection"):
        check_model_config(cfg, "all:all:collaborative")
    model = bert_factory()
    apply_plan(model, "all:all:collaborative")
    with pytest.raises(SurgeryError, match="projections were replaced by 'collaborative'"):
        apply_plan(model, "0:0:softmax")
    with pytest.raises(SurgeryError, match="scope 'module'"):
        apply_plan(bert_factory(), "0:0,1:collaborative")


def test_collaborative_trains_seeds_and_round_trips(bert_factory, padded_batch, tmp_path,
                                                    monkeypatch):
    plan = ["all:all:collaborative(dk_shared=16, als_iters=20)"]
    train_one_step(_pretrained_like(bert_factory), plan, padded_batch)
    params = []
    for _ in range(2):  # the conversion's ALS starts from the global RNG
        model = _pretrained_like(bert_factory)
        torch.manual_seed(5)
        apply_plan(model, plan)
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params, strict=True))

    def no_conversion(*args, **kwargs):
        raise AssertionError("load_pretrained converted a layer it then overwrites")

    # reloading rebuilds the plan without converting: the saved weights replace it all
    monkeypatch.setattr("attnlab.mechanisms.heads_span.collaborative_from_heads",
                        no_conversion)
    ref, out, _ = round_trip(model, padded_batch, tmp_path)
    assert torch.equal(ref, out)


def test_collaborative_loss_decreases_on_a_toy_task(bert_factory, padded_batch):
    model = bert_factory()
    torch.manual_seed(0)
    apply_plan(model, ["all:all:collaborative(dk_shared=16, convert=False)"])
    assert len(mechanism_parameters(model)) == 6  # M and U of 3 layers
    losses = train_mechanisms(model, padded_batch, steps=4, lr=0.1)
    assert losses[-1] < losses[0], losses


# --------------------------------------------------------------------------- adaptive span


def naive_adaptive_span(q, k, v, z, ramp, max_span, key_mask=None, causal=False):
    """Loops: softmax over the keys within L = min(S, ceil(max z) + R), times
    m_z(|i - j|) = clamp((R + z - |i - j|) / R, 0, 1), renormalised (+1e-8)."""
    import math

    b, h, n, _ = q.shape
    span = min(max_span, math.ceil(float(z.max())) + ramp)
    out = torch.zeros(b, h, n, v.shape[-1])
    probs = torch.zeros(b, h, n, k.shape[2])
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                keys = [j for j in range(k.shape[2]) if abs(i - j) < span
                        and (key_mask is None or key_mask[bi, j]) and (not causal or j <= i)]
                if not keys:
                    continue
                s = torch.stack([q[bi, hi, i] @ k[bi, hi, j] for j in keys]) * D**-0.5
                e = torch.softmax(s, 0)
                mask = torch.stack([((ramp + z[hi] - abs(i - j)) / ramp).clamp(0, 1)
                                    for j in keys])
                a = e * mask
                a = a / (a.sum() + 1e-8)
                probs[bi, hi, i, keys] = a
                out[bi, hi, i] = a @ v[bi, hi, keys]
    return out, probs


def span_mech(vals, spec="adaptive_span(max_span=16, ramp=4)"):
    mech = build(spec)
    with torch.no_grad():
        mech.current_val.copy_(torch.tensor(vals))
    return mech


@pytest.mark.parametrize("n", [9, 40])  # 40: the band path (keys within the span only)
@pytest.mark.parametrize("lengths,causal", [(None, False), ("pad", False), ("pad", True)])
def test_adaptive_span_equals_loop_reference(n, lengths, causal):
    mech = span_mech([0.0, 0.2, 0.45, 0.31])  # z = 0, 3.2, 7.2, 4.96 -> L = 12
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    key_mask = None if lengths is None else lengths_mask(n, [n, n - 3, 2])
    z = mech.spans().detach()
    ref, pref = naive_adaptive_span(q, k, v, z, 4, 16, key_mask, causal)
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal))
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    full = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                             need_weights=True))
    torch.testing.assert_close(full.out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.probs, pref, atol=1e-5, rtol=1e-5)
    assert res.aux_loss.item() == pytest.approx(2e-6 * float(z.mean()), rel=1e-6)


@pytest.mark.parametrize("lengths,causal", [(None, False), ("pad", False), ("pad", True)])
def test_band_path_in_chunks_equals_the_dense_path_with_gradients(lengths, causal):
    """n = 150 in chunks of 64 queries (64, 64, 22): outputs and the gradients of q, k, v
    and the span parameter equal the dense path's (itself tested against the loops) to
    1e-5; padding in the last chunk's keys, and keys masked in every chunk."""
    n = 150
    mech = span_mech([0.0, 0.2, 0.45, 0.31])  # L = 12: the band is 23 of 150 keys
    g = torch.Generator().manual_seed(7)
    key_mask = None if lengths is None else lengths_mask(n, [n, n - 70, 5])
    ctx = attnlab.AttnContext(key_mask=key_mask, causal=causal)
    span, scale = mech.current_max_span(), D**-0.5
    w = torch.randn(B, H, n, D, generator=g)  # the loss sum(w * out)
    grads = []
    for path in (mech._band, lambda *a: mech._dense(*a)[0]):
        q, k, v = (torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(i))
                   .requires_grad_() for i in range(3))
        mech.current_val.grad = None
        out = path(q, k, v, ctx, span, scale, 0.0)
        (out * w).sum().backward()
        grads.append((out.detach(), q.grad, k.grad, v.grad, mech.current_val.grad.clone()))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert n > 2 * 64 and (grads[0][4] != 0).any()  # three chunks; the span learns


def test_band_chunks_are_recomputed_with_their_dropout_masks(monkeypatch):
    """The band path's chunks run under checkpoints: with attention dropout the backward
    equals that of the same chunks without checkpoints (same seed, same masks), and
    autograd keeps no chunk's scores (under half of the [b,h,n,c+2w] scores; without the
    checkpoints it keeps over twice as much)."""
    from attnlab.mechanisms import heads_span

    n = 150
    mech = span_mech([0.0, 0.2, 0.45, 0.31])  # L = 12: chunks of 64 queries, 86 key slots
    span, scale = mech.current_max_span(), D**-0.5
    ctx = attnlab.AttnContext()
    results = []
    for plain in (False, True):
        if plain:
            monkeypatch.setattr(heads_span, "checkpoint", lambda fn, *a, **kw: fn(*a))
        q, k, v = (torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(i))
                   .requires_grad_() for i in range(3))
        mech.current_val.grad = None
        torch.manual_seed(3)

        with kept_for_backward() as kept:
            out = mech._band(q, k, v, ctx, span, scale, 0.3)
        out.sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad, mech.current_val.grad.clone(),
                        kept.bytes))
    for a, b in zip(results[0][:5], results[1][:5], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    scores = B * H * n * (64 + 2 * (span - 1)) * 4  # bytes of every chunk's scores
    assert results[0][5] < scores / 2 and results[1][5] > 2 * scores


@pytest.mark.parametrize("causal", [False, True])
def test_span_at_least_n_equals_softmax(causal):
    """Degenerate case: z >= n (S = 64 >= n, current_val = 1) -> every mask value is 1."""
    mech = build("adaptive_span(max_span=64, ramp=8, init=1.0)")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, 19, D, generator=g) for _ in range(3))
    key_mask = lengths_mask(19, [19, 10, 3])
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref, pref = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.probs, pref, atol=1e-5, rtol=1e-5)


def test_keys_beyond_the_current_span_are_not_read():
    mech = span_mech([0.1, 0.25, 0.0, 0.2])  # L = min(16, ceil(4) + 4) = 8
    assert mech.current_max_span() == 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, 48, D, generator=g) for _ in range(3))
    far = (torch.arange(48) - 20).abs() >= 8  # keys out of query 20's span
    k2, v2 = k.clone(), v.clone()
    k2[:, :, far], v2[:, :, far] = 100.0, 100.0
    a = mech(q, k, v, attnlab.AttnContext()).out[:, :, 20]
    b = mech(q, k2, v2, attnlab.AttnContext()).out[:, :, 20]
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_span_parameters_learn_and_stay_in_range():
    mech = span_mech([0.3, 0.3, -0.5, 1.5], "adaptive_span(max_span=16, ramp=4, weight=0.1)")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, H, 30, D, generator=g) for _ in range(3))
    mech(q, k, v, attnlab.AttnContext())  # eval: reads the clamped value, changes nothing
    assert mech.current_val[2] == -0.5 and mech.spans()[2] == 0 and mech.spans()[3] == 16
    mech.train()
    res = mech(q, k, v, attnlab.AttnContext())
    assert mech.current_val.tolist() == pytest.approx([0.3, 0.3, 0.0, 1.0])  # projected
    grad_aux = torch.autograd.grad(res.aux_loss, mech.current_val)[0]
    torch.testing.assert_close(grad_aux, torch.full((H,), 0.1 * 16 / H))
    grad_out = torch.autograd.grad(res.out.square().sum(), mech.current_val)[0]
    assert (grad_out[:2] != 0).all()  # heads inside the ramp get a task gradient


def test_adaptive_span_spec_errors_name_the_fix():
    for spec, match in [("adaptive_span(max_span=0)", "max_span"),
                        ("adaptive_span(ramp=0)", "ramp"),
                        ("adaptive_span(init=1.5)", r"must lie in \[0, 1\]"),
                        ("adaptive_span(weight=-1)", "weight")]:
        with pytest.raises(RegistryError, match=match):
            build(spec)


def test_adaptive_span_trains_and_round_trips(bert_factory, padded_batch, tmp_path):
    plan = ["all:all:adaptive_span(max_span=8, ramp=2, init=0.5, weight=0.01)"]
    train_one_step(bert_factory(), plan, padded_batch)
    model = bert_factory()
    apply_plan(model, plan)
    model(**padded_batch)  # the model's aux loss: 3 layers x lambda x mean z (z = 4)
    assert attnlab.aux_loss(model).item() == pytest.approx(3 * 0.01 * 4.0, rel=1e-6)
    losses = train_mechanisms(model, padded_batch, steps=4, lr=0.05)
    assert losses[-1] < losses[0], losses
    ref, out, loaded = round_trip(model, padded_batch, tmp_path)
    assert torch.equal(ref, out)


# ------------------------------------------------------------------- capture and report

PLANS = {
    "collaborative": "all:all:collaborative(dk_shared=16)",
    "adaptive_span": "all:0,2:adaptive_span(max_span=6, ramp=2, init=0.5)",
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_maps_reach_capture_and_the_report(name, bert_factory, padded_batch, tmp_path):
    from attnlab.analysis import TokenInfo, build_report, example_maps, score_heads

    model = bert_factory()
    apply_plan(model, PLANS[name])
    cache = attnlab.capture_attention(model, padded_batch)
    mask = padded_batch["attention_mask"].bool()
    for layer in cache:
        p = cache[layer]  # [b,h,n,m]
        assert name in cache.mechanisms[layer]
        rows = p.sum(-1)[mask[:, None, :].expand(-1, H, -1)]
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=1e-5)
        out = model.encoder.layer[layer].attention.self
        assert out.attnlab is not None
    if name == "adaptive_span":  # keys at distance >= L = ceil(3) + 2 = 5 get nothing
        i = torch.arange(12)
        assert (cache[0][:, [0, 2]][..., (i[:, None] - i[None, :]).abs() >= 5] == 0).all()
    infos = [TokenInfo.from_length(int(n)) for n in padded_batch["attention_mask"].sum(1)]
    maps = cache.stack()
    path = build_report(tmp_path / "report.html", title=name, plan=[PLANS[name]],
                        scores=score_heads(maps, infos), examples=example_maps(maps, infos))
    text = path.read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="attnlab-data">(.*?)</script>', text, re.S).group(1))
    assert '"maps"' in json.dumps(data) and name in text
