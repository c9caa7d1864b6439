"""linformer: the sliced projections against a naive reference that zero-pads to max_len,
layerwise sharing through surgery (one parameter for every layer, saved once, reloaded
tied); lowrank_band against a naive loop; both trained and round-tripped in a tiny BERT.

Tolerances: fp32 at 1e-5 (same products, different order).
"""

from __future__ import annotations

import math

import pytest
import torch
from plan_step import train_one_step
from safetensors.torch import load_file

import attnlab
from attnlab import apply_plan, load_pretrained, save_pretrained
from attnlab.core import RegistryError, resolve_config

H, D, MAXLEN, K = 3, 8, 32, 6


def naive_linformer(q, k, v, E, Fm, key_mask=None, scale=None):
    """The paper's form: pad K, V with zeros to max_len rows, project with the full E, F.

    E, Fm: [k, N] (shared) or [h, k, N] (per head). Padded keys are zeroed first.
    Per-head, per-batch loops keep it obviously correct.
    """
    b, h, m, d = k.shape
    N = E.shape[-1]
    scale = d**-0.5 if scale is None else scale
    if key_mask is not None:
        k = k * key_mask[:, None, :, None]
        v = v * key_mask[:, None, :, None]
    kpad = torch.cat([k, k.new_zeros(b, h, N - m, d)], dim=2)  # [b,h,N,d]
    vpad = torch.cat([v, v.new_zeros(b, h, N - m, v.shape[-1])], dim=2)
    out = torch.empty(b, h, q.shape[2], v.shape[-1])
    for bi in range(b):
        for hi in range(h):
            e = E if E.dim() == 2 else E[hi]
            f = Fm if Fm.dim() == 2 else Fm[hi]
            kp, vp = e @ kpad[bi, hi], f @ vpad[bi, hi]  # [k,d]
            p = torch.softmax(q[bi, hi] @ kp.T * scale, dim=-1)
            out[bi, hi] = p @ vp
    return out


def build(spec="linformer(k=6)", h=H, max_len=MAXLEN):
    torch.manual_seed(0)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, max_len)).eval()


def rand(b, n, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, H, x, D, generator=g) for x in (n, m, m))


@pytest.mark.parametrize("share", ["headwise", "kv", "none", "layerwise"])
@pytest.mark.parametrize("m", [1, 20, MAXLEN])
def test_slicing_equals_zero_padding_reference(share, m):
    mech = build(f"linformer(k={K}, share={share!r})")
    q, k, v = rand(3, 11, m, seed=m)
    key_mask = torch.arange(m)[None, :] < torch.tensor([m, max(1, m - 7), 1])[:, None]
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    ref = naive_linformer(q, k, v, mech.E.detach(), mech.value_proj.detach(), key_mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sharing_modes_own_the_right_parameters():
    hw, kv, none, lw = (build(f"linformer(k={K}, share={s!r})")
                        for s in ("headwise", "kv", "none", "layerwise"))
    assert hw.E.shape == hw.F.shape == (K, MAXLEN) and hw.E is not hw.F
    for one in (kv, lw):  # E = F: one [k, N] matrix for keys and values
        assert [n for n, _ in one.named_parameters()] == ["E"] and one.value_proj is one.E
        assert one.E.shape == (K, MAXLEN)
    assert none.E.shape == none.F.shape == (H, K, MAXLEN)
    # per-head matrices really differ across heads
    assert not torch.allclose(none.E[0], none.E[1])


@pytest.mark.parametrize("share", ["headwise", "kv", "none", "layerwise"])
def test_gradients_reach_projections(share):
    mech = build(f"linformer(k={K}, share={share!r})").train()
    q, k, v = rand(2, 9, 9)
    mech(q, k, v, attnlab.AttnContext()).out.square().sum().backward()
    for name, p in mech.named_parameters():
        assert p.grad is not None and p.grad[..., :9].abs().sum() > 0, name
        # columns beyond the sequence length take no part and get no gradient
        assert (p.grad[..., 9:] == 0).all(), name


def test_init_follows_fairseq_xavier_gain():
    mech = build("linformer(k=64)", max_len=512)
    bound = math.sqrt(6.0 / (64 + 512)) / math.sqrt(2.0)
    for p in (mech.E, mech.F):
        assert p.abs().max() <= bound
        # uniform(-a, a) has std a / sqrt(3); 32k samples put it within 2%
        assert abs(p.std().item() - bound / math.sqrt(3)) < 0.02 * bound


def test_too_long_sequence_names_both_lengths_and_the_fix():
    mech = build(max_len=16)
    q, k, v = rand(1, 17, 17)
    with pytest.raises(ValueError, match=r"17 keys.*max_len=16.*larger max_len.*truncate"):
        mech(q, k, v, attnlab.AttnContext())


def test_not_causal():
    assert attnlab.core.mechanism_class("linformer").caps.causal_ok is False
    q, k, v = rand(1, 5, 5)
    with pytest.raises(ValueError, match="cannot be causal"):
        build()(q, k, v, attnlab.AttnContext(causal=True))


def test_needs_max_len():
    caps = attnlab.core.mechanism_class("linformer").caps
    assert caps.needs_max_len and caps.family == "lowrank"
    with pytest.raises(ValueError, match="max_len"):
        attnlab.build_mechanism("linformer", attnlab.HeadDims(H, D, None))


def test_effective_weights_reproduce_the_output():
    mech = build()
    q, k, v = rand(2, 10, 10, seed=4)
    key_mask = torch.arange(10)[None, :] < torch.tensor([10, 4])[:, None]
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, need_weights=True))
    assert res.probs.shape == (2, H, 10, 10)
    assert (res.probs[1, :, :, 4:] == 0).all()
    torch.testing.assert_close(res.probs @ v, res.out, atol=1e-5, rtol=1e-5)


def test_dropout_only_in_training():
    mech = build()
    q, k, v = rand(1, 10, 10, seed=2)
    c = attnlab.AttnContext(dropout=0.5)
    assert torch.equal(mech(q, k, v, c).out, mech(q, k, v, c).out)
    mech.train()
    torch.manual_seed(1)
    a = mech(q, k, v, c).out
    assert not torch.allclose(a, mech.eval()(q, k, v, c).out)


def test_spec_strings_parse_and_validate():
    cfg = resolve_config("linformer(k=16, share='kv')")
    assert (cfg.k, cfg.share) == (16, "kv")
    assert resolve_config(cfg.spec()) == cfg
    assert resolve_config("linformer") == resolve_config("linformer(k=64, share='headwise')")
    assert resolve_config("linformer(share='layerwise')").share == "layerwise"
    with pytest.raises(RegistryError, match="share must be one of"):
        resolve_config("linformer(share='layer')")
    with pytest.raises(RegistryError, match="k .*must be >= 1"):
        resolve_config("linformer(k=0)")


def test_k_not_below_max_len_warns():
    """k >= max_len does not shorten the keys: say so, with the bound to use."""
    with pytest.warns(UserWarning, match=f"use k < {MAXLEN}"):
        build(f"linformer(k={MAXLEN})")


# --------------------------------------------------------- shared helpers for the BERT tests


def mechanism_parameters(model):
    """Distinct parameters of the installed mechanisms (shared ones once)."""
    return [p for name, p in model.named_parameters() if ".attnlab." in name]


def train_mechanisms(model, batch, steps=6, lr=0.05):
    """Toy task: fit the last hidden states to a fixed random target, training only the
    mechanisms' parameters (the encoder frozen). Returns the loss before each step."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = mechanism_parameters(model)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    mask = batch["attention_mask"][..., None].float()
    target = None
    losses = []
    model.train()
    for _ in range(steps):
        out = model(**batch).last_hidden_state  # [b,n,hidden]
        if target is None:
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
        loss = ((out - target).square() * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def round_trip(model, batch, path):
    """save_pretrained / load_pretrained after moving the mechanism parameters off their
    init; returns (output before, output of the reloaded model, the reloaded model)."""
    with torch.no_grad():
        for p in mechanism_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
    save_pretrained(model, path)
    loaded = load_pretrained(path)
    with torch.no_grad():
        return ref, loaded(**batch).last_hidden_state, loaded


# ------------------------------------------------------------------- linformer: layerwise

LAYERWISE = {"layers": "all", "heads": "all", "mechanism": "linformer(k=8, share='layerwise')"}


def installed(model, layer):
    return model.encoder.layer[layer].attention.self.attnlab.mechanisms[0]


def test_layerwise_shares_one_parameter_across_layers(bert_factory):
    model = bert_factory()
    report = apply_plan(model, [LAYERWISE])
    mechs = [installed(model, i) for i in range(3)]
    assert all(m.E is mechs[0].E and m.F is None for m in mechs)
    assert len(mechanism_parameters(model)) == 1
    assert report.params_added == 8 * 64  # counted once, not once per layer
    # other sharing modes and other configs are not tied
    model2 = bert_factory()
    apply_plan(model2, ["0,1:all:linformer(k=8, share='kv')",
                        {**LAYERWISE, "layers": [2]}])
    assert installed(model2, 0).E is not installed(model2, 1).E


def test_layerwise_ties_per_config(bert_factory):
    model = bert_factory()
    other = "linformer(k=4, share='layerwise')"
    apply_plan(model, [{**LAYERWISE, "layers": [0, 2]},
                       {**LAYERWISE, "layers": [1], "mechanism": other}])
    a, b, c = (installed(model, i) for i in range(3))
    assert a.E is c.E and b.E is not a.E and b.E.shape == (4, 64)


def test_layerwise_init_is_seeded(bert_factory):
    es = []
    for _ in range(2):
        model = bert_factory()
        torch.manual_seed(3)
        apply_plan(model, [LAYERWISE])
        es.append(installed(model, 0).E.detach().clone())
    assert torch.equal(es[0], es[1])


def test_layerwise_gradient_sums_every_layer(bert_factory, padded_batch):
    """The shared E's gradient equals the sum of the gradients of untied per-layer copies
    ("kv" sharing: the same E = F use in each layer) holding the same values."""
    tied, untied = bert_factory(), bert_factory()
    apply_plan(tied, [LAYERWISE])
    apply_plan(untied, ["all:all:linformer(k=8, share='kv')"])
    with torch.no_grad():
        for i in range(3):
            installed(untied, i).E.copy_(installed(tied, 0).E)
    for model in (tied, untied):
        model(**padded_batch).last_hidden_state.square().sum().backward()
    total = sum(installed(untied, i).E.grad for i in range(3))
    assert all(installed(untied, i).E.grad.abs().sum() > 0 for i in range(3))
    torch.testing.assert_close(installed(tied, 0).E.grad, total, atol=1e-5, rtol=1e-5)


def test_layerwise_round_trips_tied(bert_factory, padded_batch, tmp_path):
    model = bert_factory()
    apply_plan(model, [LAYERWISE])
    ref, out, loaded = round_trip(model, padded_batch, tmp_path)
    assert torch.equal(out, ref)
    mechs = [installed(loaded, i) for i in range(3)]
    assert all(m.E is mechs[0].E for m in mechs)  # still one parameter after the reload
    saved = [k for k in load_file(tmp_path / "model.safetensors") if ".attnlab." in k]
    assert saved == ["encoder.layer.0.attention.self.attnlab.mechanisms.0.E"]  # stored once


@pytest.mark.parametrize("share", ["layerwise", "headwise"])
def test_linformer_trains_in_a_plan(bert_factory, padded_batch, share):
    model = bert_factory()
    torch.manual_seed(0)
    apply_plan(model, [{**LAYERWISE, "mechanism": f"linformer(k=8, share={share!r})"}])
    losses = train_mechanisms(model, padded_batch)
    assert losses[-1] < losses[0] - 1e-3, losses


# --------------------------------------------------------------------------- lowrank_band

R, W = 3, 2


def naive_lowrank_band(q, k, v, wq, wk, window, key_mask=None, causal=False):
    """Per (batch, head): (softmax_lowrank + softmax_band) / 2 @ v, dense masked scores."""
    b, h, n, d = q.shape
    r = wq.shape[-1]
    out = torch.zeros_like(v)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    for bi in range(b):
        keep = torch.ones(n, dtype=torch.bool) if key_mask is None else key_mask[bi]
        allowed = keep[None, :].expand(n, n) & ((j <= i) if causal else True)
        for hi in range(h):
            parts = []
            for scores, ok in (((q[bi, hi] @ wq[hi]) @ (k[bi, hi] @ wk[hi]).T / math.sqrt(r),
                                allowed),
                               (q[bi, hi] @ k[bi, hi].T / math.sqrt(d),
                                allowed & ((i - j).abs() <= window))):
                p = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1)
                parts.append(torch.nan_to_num(p, nan=0.0))  # rows without keys: zeros
            out[bi, hi] = (parts[0] + parts[1]) / 2 @ v[bi, hi]
    return out


def build_lrb(spec=f"lowrank_band(rank={R}, window={W})", h=H):
    torch.manual_seed(0)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, None)).eval()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_lowrank_band_matches_naive_reference(padded, causal):
    mech = build_lrb()
    q, k, v = rand(3, 13, 13, seed=7)
    key_mask = (torch.arange(13)[None, :] < torch.tensor([13, 6, 1])[:, None]) if padded else None
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                            need_weights=True))
    ref = naive_lowrank_band(q, k, v, mech.wq.detach(), mech.wk.detach(), W, key_mask, causal)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.probs @ v, res.out, atol=1e-5, rtol=1e-5)
    live = res.probs.sum(-1)[0]  # batch 0 is unpadded: rows sum to 1
    torch.testing.assert_close(live, torch.ones_like(live), atol=1e-6, rtol=0)


def test_lowrank_band_long_input_uses_the_blocked_band_and_matches_gradients():
    """n = 300 >= 256: the band part runs on the blocked engine (hand-written backward);
    outputs and gradients (q, k, v, W^Q_r, W^K_r) equal the naive loop's."""
    mech = build_lrb(f"lowrank_band(rank={R}, window=5)", h=2).train()
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 300, D, generator=g).requires_grad_() for _ in range(3))
    key_mask = torch.arange(300)[None, :] < 290
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    wq, wk = (p.detach().clone().requires_grad_() for p in (mech.wq, mech.wk))
    ref = naive_lowrank_band(q, k, v, wq, wk, 5, key_mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    ours = torch.autograd.grad(out, (q, k, v, mech.wq, mech.wk), grad)
    theirs = torch.autograd.grad(ref, (q, k, v, wq, wk), grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_lowrank_band_parameters_and_init():
    mech = build_lrb()
    assert mech.wq.shape == mech.wk.shape == (H, D, R)
    assert sorted(n for n, _ in mech.named_parameters()) == ["wk", "wq"]
    bound = math.sqrt(6.0 / (D + R))
    assert mech.wq.abs().max() <= bound and not torch.equal(mech.wq, mech.wk)
    assert torch.equal(build_lrb().wq, mech.wq)  # seeded by the global RNG


@pytest.mark.parametrize("spec,match", [
    ("lowrank_band(rank=0)", "rank must be >= 1"),
    ("lowrank_band(window=-1)", "window must be >= 0"),
])
def test_lowrank_band_bad_specs(spec, match):
    with pytest.raises(RegistryError, match=match):
        attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, None))


def test_lowrank_band_rank_not_below_head_dim_warns():
    with pytest.warns(UserWarning, match=f"use rank < {D}"):
        build_lrb(f"lowrank_band(rank={D})")


def test_lowrank_band_trains_and_round_trips(bert_factory, padded_batch, tmp_path):
    spec = f"lowrank_band(rank=2, window={W})"
    report, before, after = train_one_step(bert_factory(), [f"all:1,3:{spec}"], padded_batch)
    assert report.counts_by_name["lowrank_band"] == 6 and not torch.equal(before, after)
    model = bert_factory()
    apply_plan(model, [f"all:all:{spec}"])
    losses = train_mechanisms(model, padded_batch)
    assert losses[-1] < losses[0] - 1e-3, losses
    ref, out, _ = round_trip(model, padded_batch, tmp_path)
    assert torch.equal(out, ref)
