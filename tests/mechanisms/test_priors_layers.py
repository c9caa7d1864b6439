"""predictive, lazyformer (maps from lower layers) and the cross-layer contract they share
with realformer: Hugging Face surgery, from-scratch encoders, gradient checkpointing,
capture_attention and the HTML report.

Stacks are checked against a manual computation written here (a naive loop convolution for
predictive) in fp32 at 1e-5; degenerate cases (alpha = 1, share = 1: plain softmax in
every layer) at 1e-6; gradients with gradient checkpointing against gradients without at
1e-6 (the recomputation repeats the same operations).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from conftest import make_tiny_bert
from plan_step import train_one_step
from saved import kept_for_backward

import attnlab
from attnlab import load_pretrained, save_pretrained
from attnlab.analysis import TokenInfo, build_report, example_maps, score_heads
from attnlab.core import RegistryError
from attnlab.hf import apply_plan, capture_attention
from attnlab.mechanisms.priors import ResidualScores
from attnlab.mechanisms.priors_layers import LAZYFORMER_STATE_KEY, PREDICTIVE_STATE_KEY
from attnlab.models import encoder_config

B, H, D = 2, 3, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}
TIGHT = {"atol": 1e-6, "rtol": 1e-6}
CROSS = {  # the cross-layer mechanisms, as whole-model plans
    "realformer": "all:all:realformer",
    "predictive": "all:all:predictive",
    "lazyformer": "all:all:lazyformer(share=2)",
    "lazyformer_values": "all:all:lazyformer(share=2, share_values=True)",
}
gc_warnings = pytest.mark.filterwarnings("ignore::FutureWarning")  # HF's deprecated alias


def build(spec: str, h: int = H, seed: int = 0):
    torch.manual_seed(seed)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, 64)).eval()


def rand(n, seed=0, b=B, h=H):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, D, generator=g) for _ in range(3))


def lengths_mask(m, lengths):
    return torch.arange(m)[None, :] < torch.tensor(lengths)[:, None]


def run_stack(mechs, inputs, **ctx_kw):
    """Run mechanisms as consecutive layers sharing one state dict; outputs and the state."""
    state: dict = {}
    outs = []
    for idx, (mech, (q, k, v)) in enumerate(zip(mechs, inputs, strict=True)):
        ctx = attnlab.AttnContext(layer_idx=ctx_kw.pop("first", 0) + idx, state=state,
                                  **ctx_kw)
        outs.append(mech(q, k, v, ctx))
    return outs, state


# -------------------------------------------------------------------------------- predictive


def keep_pairs(n, key_mask, causal):
    """[b|1,1,n,n] bool: pairs the stored map keeps (others are zeroed)."""
    keep = torch.ones(1, 1, n, n, dtype=torch.bool)
    if causal:
        keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, :] & key_mask[:, None, :, None]
    return keep


def naive_conv(x, weight, bias, causal):
    """Loop 2-D convolution with zero padding: x [b,c,n,m], weight [o,c,k,k] -> [b,o,n,m].
    Not causal: centred kernel; causal: kernel rows cover queries i-k+1..i."""
    b, c, n, m = x.shape
    o, _, k, _ = weight.shape
    half = k // 2
    row0 = -(k - 1) if causal else -half
    out = bias.double()[None, :, None, None].repeat(b, 1, n, m)
    xd, wd = x.double(), weight.double()
    for a in range(k):
        for e in range(k):
            for i in range(n):
                r = i + row0 + a
                if not 0 <= r < n:
                    continue
                for j in range(m):
                    col = j - half + e
                    if 0 <= col < m:
                        out[:, :, i, j] += xd[:, :, r, col] @ wd[:, :, a, e].T
    return out.float()


def manual_predictive(mechs, inputs, alpha, key_mask, causal):
    """Outputs of a predictive stack from the formula, via core.reference."""
    n = inputs[0][0].shape[2]
    keep = keep_pairs(n, key_mask, causal)
    outs, lower = [], None
    for idx, (mech, (q, k, v)) in enumerate(zip(mechs, inputs, strict=True)):
        s = q @ k.transpose(-1, -2) * D**-0.5  # [b,h,n,n]
        if idx:
            pred = naive_conv(lower * keep, mech.conv.weight.detach(), mech.conv.bias.detach(),
                              causal)
            s = alpha * s + (1 - alpha) * pred
        lower = s
        # reference over the bias s - QK^T/sqrt(d): softmax(s + mask) V
        bias = s - q @ k.transpose(-1, -2) * D**-0.5
        outs.append(attnlab.reference_attention(q, k, v, bias=bias, key_mask=key_mask,
                                                causal=causal))
    return outs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_predictive_stack_matches_manual_computation(causal, padded):
    mechs = [build("predictive(alpha=0.3, kernel=3)", seed=s) for s in range(3)]
    inputs = [rand(7, seed=s) for s in range(3)]
    key_mask = lengths_mask(7, [7, 4]) if padded else None
    outs, state = run_stack(mechs, inputs, key_mask=key_mask, causal=causal,
                            need_weights=True)
    refs = manual_predictive(mechs, inputs, 0.3, key_mask, causal)
    for res, (ref, pref) in zip(outs, refs, strict=True):
        torch.testing.assert_close(res.out, ref, **TOL)
        torch.testing.assert_close(res.probs, pref, **TOL)
    assert state[PREDICTIVE_STATE_KEY].layer_idx == 2


def test_predictive_kernel_5_matches_manual_computation():
    mechs = [build("predictive(alpha=0.6, kernel=5)", seed=s) for s in range(2)]
    inputs = [rand(8, seed=s) for s in range(2)]
    key_mask = lengths_mask(8, [8, 6])
    outs, _ = run_stack(mechs, inputs, key_mask=key_mask)
    refs = manual_predictive(mechs, inputs, 0.6, key_mask, False)
    for res, (ref, _) in zip(outs, refs, strict=True):
        torch.testing.assert_close(res.out, ref, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_predictive_alpha_1_is_softmax(causal):
    """The degenerate case of the task: alpha = 1 equals softmax in every layer."""
    mechs = [build("predictive(alpha=1.0)", seed=s) for s in range(3)]
    inputs = [rand(9, seed=s) for s in range(3)]
    key_mask = lengths_mask(9, [9, 5])
    outs, _ = run_stack(mechs, inputs, key_mask=key_mask, causal=causal)
    for res, (q, k, v) in zip(outs, inputs, strict=True):
        ref, _ = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
        torch.testing.assert_close(res.out, ref, **TIGHT)


def test_predictive_causal_stack_does_not_leak_the_future():
    mechs = [build("predictive(alpha=0.2, kernel=3)", seed=s) for s in range(2)]
    inputs = [rand(10, seed=s) for s in range(2)]
    t = 4
    fut = (torch.arange(10) > t)[None, None, :, None]
    changed = [tuple(torch.where(fut, torch.randn_like(x), x) for x in qkv) for qkv in inputs]
    a, _ = run_stack(mechs, inputs, causal=True)
    b, _ = run_stack(mechs, changed, causal=True)
    torch.testing.assert_close(a[1].out[:, :, : t + 1], b[1].out[:, :, : t + 1], **TIGHT)


def test_predictive_padded_stack_equals_the_unpadded_sequence():
    mechs = [build("predictive(alpha=0.3)", seed=s) for s in range(2)]
    inputs = [rand(9, seed=s) for s in range(2)]
    key_mask = lengths_mask(9, [9, 6])
    padded, _ = run_stack(mechs, inputs, key_mask=key_mask)
    alone, _ = run_stack(mechs, [tuple(x[1:, :, :6] for x in qkv) for qkv in inputs])
    torch.testing.assert_close(padded[1].out[1:, :, :6], alone[1].out, **TIGHT)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", [3, 5])
def test_predictive_row_chunks_match_the_whole_map(monkeypatch, causal, kernel):
    """Without weights the rows run in checkpointed chunks (2 rows per chunk of 13, so the
    kernel's neighbouring rows cross chunk borders): outputs, the map passed up and the
    gradients of q, k, v and the convolutions equal the whole-map form's (1e-5)."""
    from attnlab.mechanisms import _rowchunks

    mechs = [build(f"predictive(alpha=0.3, kernel={kernel})", seed=s).train()
             for s in range(3)]
    key_mask = lengths_mask(13, [13, 8])
    results = []
    for weights in (True, False):
        monkeypatch.setattr(_rowchunks, "CHUNK_ELEMS", B * H * 2 * 13 if not weights
                            else 1 << 21)
        inputs = [tuple(x.requires_grad_() for x in rand(13, seed=s)) for s in range(3)]
        outs, state = run_stack(mechs, inputs, key_mask=key_mask, causal=causal,
                                need_weights=weights)
        passed_up = state[PREDICTIVE_STATE_KEY].scores
        g = torch.Generator().manual_seed(4)
        loss = sum((o.out * torch.randn(o.out.shape, generator=g)).sum() for o in outs)
        loss = loss + passed_up.square().sum()
        leaves = [x for qkv in inputs for x in qkv] + [m.conv.weight for m in mechs[1:]]
        results.append(([o.out for o in outs], passed_up,
                        torch.autograd.grad(loss, leaves)))
    (outs_a, up_a, grads_a), (outs_b, up_b, grads_b) = results
    for a, b in zip(outs_a + [up_a] + list(grads_a), outs_b + [up_b] + list(grads_b),
                    strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_predictive_keeps_the_map_it_passes_up_and_no_more():
    """A second predictive layer in training at n = 1024 keeps S_{l-1} (its input) and
    under half of one more [b, h, n, m]; the whole-map form kept several."""
    n = 1024
    layer = attnlab.build_mechanism("predictive", attnlab.HeadDims(2, 8, n)).train()
    q, k, v = (torch.randn(2, 2, n, 8, requires_grad=True) for _ in range(3))
    prev = torch.randn(2, 2, n, n, requires_grad=True)
    state = {PREDICTIVE_STATE_KEY: ResidualScores(prev, 0)}

    with kept_for_backward() as kept:
        out = layer(q, k, v, attnlab.AttnContext(layer_idx=1, state=state)).out
    assert kept.bytes < 1.5 * 2 * 2 * n * n * 4  # prev and a little more
    out.sum().backward()
    assert prev.grad is not None and prev.grad.abs().sum() > 0


# -------------------------------------------------------------------------------- lazyformer


@pytest.mark.parametrize("share_values", [False, True])
def test_lazyformer_stack_matches_manual_computation(share_values):
    layers = [0, 1, 2, 3, 5, 6]  # a gap: layer 4 is not lazyformer
    mech = build(f"lazyformer(share=2, share_values={share_values})")
    inputs = [rand(8, seed=s) for s in range(len(layers))]
    key_mask = lengths_mask(8, [8, 5])
    state: dict = {}
    outs = [mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, layer_idx=li, state=state,
                                              need_weights=True))
            for li, (q, k, v) in zip(layers, inputs, strict=True)]
    # computing layers: 0, 2, 5 (5 - 2 >= 2); lazy: 1 <- 0, 3 <- 2, 6 <- 5
    source = {0: 0, 1: 0, 2: 2, 3: 2, 5: 5, 6: 5}
    pos = {li: t for t, li in enumerate(layers)}
    for t, li in enumerate(layers):
        qc, kc, vc = inputs[pos[source[li]]]
        _, probs = attnlab.reference_attention(qc, kc, vc, key_mask=key_mask)
        values = vc if share_values else inputs[t][2]
        torch.testing.assert_close(outs[t].probs, probs, **TIGHT)
        torch.testing.assert_close(outs[t].out, probs @ values, **TOL)
    assert state[LAZYFORMER_STATE_KEY].layer_idx == 5


def test_lazyformer_share_1_is_softmax():
    """Degenerate case: a block of one layer computes its map in every layer."""
    mech = build("lazyformer(share=1)")
    inputs = [rand(9, seed=s) for s in range(3)]
    key_mask = lengths_mask(9, [9, 3])
    outs, _ = run_stack([mech] * 3, inputs, key_mask=key_mask, causal=True)
    for res, (q, k, v) in zip(outs, inputs, strict=True):
        ref, _ = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=True)
        torch.testing.assert_close(res.out, ref, **TIGHT)


def test_lazy_layers_do_not_read_their_queries_and_keys():
    mech = build("lazyformer(share=3)")
    (q0, k0, v0), (q1, k1, v1) = rand(6, seed=0), rand(6, seed=1)
    q1.requires_grad_()
    k1.requires_grad_()
    q0.requires_grad_()
    state: dict = {}
    mech(q0, k0, v0, attnlab.AttnContext(layer_idx=0, state=state))
    out = mech(q1, k1, v1, attnlab.AttnContext(layer_idx=2, state=state)).out
    out.square().sum().backward()
    assert q1.grad is None and k1.grad is None  # lazy: P_0 reused
    assert q0.grad is not None and q0.grad.abs().sum() > 0  # its gradient reaches layer 0


@pytest.mark.parametrize("share_values", [False, True])
def test_lazyformer_training_keeps_no_map(share_values):
    """Two lazyformer layers in training (layer 1 lazy) at n = 512: autograd keeps under a
    tenth of one [b, h, n, m] float32 tensor (unique storages), as the flash softmax does;
    the outputs and gradients still equal the formula's with the map kept (1e-5)."""
    n = 512
    mech = build(f"lazyformer(share=2, share_values={share_values})").train()
    inputs = [tuple(x.requires_grad_() for x in rand(n, seed=s)) for s in range(2)]

    with kept_for_backward() as kept:
        outs, _ = run_stack([mech, mech], inputs)
    assert kept.bytes < B * H * n * n * 4 / 10
    (q0, k0, v0), (_, _, v1) = inputs
    probs = torch.softmax(q0 @ k0.transpose(-1, -2) * D**-0.5, -1)  # P_0 [b,h,n,n]
    want = [probs @ v0, probs @ (v0 if share_values else v1)]
    g = torch.Generator().manual_seed(3)
    readouts = [torch.randn(o.shape, generator=g) for o in want]
    leaves = [q0, k0, v0, v1]
    got_loss = sum((o.out * r).sum() for o, r in zip(outs, readouts, strict=True))
    want_loss = sum((o * r).sum() for o, r in zip(want, readouts, strict=True))
    got_grads = torch.autograd.grad(got_loss, leaves, allow_unused=True)
    want_grads = torch.autograd.grad(want_loss, leaves, allow_unused=True)
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(got.out, ref, **TOL)
    for got, ref in zip(got_grads, want_grads, strict=True):
        assert (got is None) == (ref is None)
        if ref is not None:
            torch.testing.assert_close(got, ref, **TOL)


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize("spec, fix", [
    ("predictive(alpha=1.5)", r"alpha must be in \[0, 1\].*alpha=1 is plain softmax"),
    ("predictive(alpha=-0.1)", r"alpha must be in \[0, 1\]"),
    ("predictive(kernel=2)", r"kernel must be an odd size.*kernel=3"),
    ("predictive(kernel=0)", r"kernel must be an odd size"),
    ("lazyformer(share=0)", r"share must be >= 1.*share=2"),
])
def test_bad_specs_are_clear_errors(spec, fix):
    with pytest.raises(RegistryError, match=fix):
        attnlab.build_mechanism(spec, attnlab.HeadDims(4, 8, 64))


@pytest.mark.parametrize("spec", ["predictive", "lazyformer(share=4)"])
def test_misuse_of_the_state_is_a_clear_error(spec):
    name = spec.split("(")[0]
    state: dict = {}
    build(spec, h=3)(*rand(5, h=3), attnlab.AttnContext(layer_idx=0, state=state))
    with pytest.raises(ValueError, match=rf"{name} at layer 1 needs .*layer 0 passed up"):
        build(spec, h=2)(*rand(5, h=2), attnlab.AttnContext(layer_idx=1, state=state))
    with pytest.raises(ValueError, match="fresh dict for each forward pass"):
        build(spec)(*rand(5), attnlab.AttnContext(layer_idx=0, state=state))


# ------------------------------------------------------------------------ learned parameters


def test_predictive_init_is_deterministic_from_the_global_seed():
    a, b, c = (build("predictive", seed=s) for s in (0, 0, 1))
    assert torch.equal(a.conv.weight, b.conv.weight) and torch.equal(a.conv.bias, b.conv.bias)
    assert not torch.equal(a.conv.weight, c.conv.weight)


def test_predictive_learns_a_teacher_convolution():
    """Toy task: a two-layer stack whose second layer fits a teacher's convolution."""
    inputs = [rand(10, seed=s, b=4) for s in range(2)]
    key_mask = lengths_mask(10, [10, 8, 5, 10])
    teacher = [build("predictive(alpha=0.2)", seed=s) for s in (1, 2)]
    student = [teacher[0], build("predictive(alpha=0.2)", seed=3).train()]
    with torch.no_grad():
        target = run_stack(teacher, inputs, key_mask=key_mask)[0][1].out
    opt = torch.optim.Adam(student[1].parameters(), lr=0.05)
    losses = []
    for _ in range(15):
        loss = (run_stack(student, inputs, key_mask=key_mask)[0][1].out - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses


# ----------------------------------------------------------------- Hugging Face: the stack


def scratch_encoder(seed=0):
    """A from-scratch encoder (models.encoder_config, 2 layers x 2 heads, dropout 0.1)."""
    torch.manual_seed(seed)
    return transformers.BertModel(encoder_config("tiny", vocab_size=100,
                                                 max_position_embeddings=64))


HOSTS = {"tiny_bert": lambda: make_tiny_bert(), "scratch": scratch_encoder}


def grads(host, plan, batch, checkpointing=False, reentrant=False, forwards=1):
    """Parameter gradients of a fixed read-out after ``forwards`` training forwards (one
    backward), seeded so that dropout draws the same masks in every call."""
    model = HOSTS[host]()
    apply_plan(model, plan)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    torch.manual_seed(123)
    loss = 0.0
    for t in range(forwards):
        ids = batch["input_ids"].roll(t, dims=1) if t else batch["input_ids"]
        out = model(input_ids=ids, attention_mask=batch["attention_mask"]).last_hidden_state
        readout = torch.randn(out.shape, generator=torch.Generator().manual_seed(t))
        loss = loss + (out * readout * batch["attention_mask"][..., None]).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@gc_warnings
def test_a_training_step_frees_the_map_predictive_passes_up(padded_batch, monkeypatch):
    """S_l dies with its step. The checkpointed row chunks once closed over a context with
    the state: a cycle through autograd's nodes (state -> S_l -> checkpoint -> closure ->
    state) that no collector frees, so every training step's graph stayed alive."""
    import gc
    import weakref

    import attnlab.mechanisms.priors_layers as pl

    refs, real = [], pl.ResidualScores

    def recorded(scores, layer_idx):
        refs.append(weakref.ref(scores))
        return real(scores, layer_idx)

    monkeypatch.setattr(pl, "ResidualScores", recorded)
    from attnlab.mechanisms import _rowchunks

    monkeypatch.setattr(_rowchunks, "CHUNK_ELEMS", 64)  # several checkpointed row chunks
    model = scratch_encoder()
    apply_plan(model, CROSS["predictive"])
    out = model.train()(input_ids=padded_batch["input_ids"],
                        attention_mask=padded_batch["attention_mask"]).last_hidden_state
    out.sum().backward()
    del out
    gc.collect()
    assert len(refs) == 2 and all(r() is None for r in refs)


@gc_warnings
@pytest.mark.parametrize("host", list(HOSTS))
@pytest.mark.parametrize("key", list(CROSS))
def test_gradient_checkpointing_gives_the_same_gradients(padded_batch, host, key):
    plain = grads(host, CROSS[key], padded_batch)
    ckpt = grads(host, CROSS[key], padded_batch, checkpointing=True)
    assert plain.keys() == ckpt.keys() and plain
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], **TIGHT, msg=name)


@gc_warnings
@pytest.mark.parametrize("key", ["realformer", "predictive"])
def test_gradient_checkpointing_with_two_forwards_before_backward(padded_batch, key):
    """Each recomputation replays the state of its own forward, not the last one's."""
    plain = grads("tiny_bert", CROSS[key], padded_batch, forwards=2)
    ckpt = grads("tiny_bert", CROSS[key], padded_batch, checkpointing=True, forwards=2)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], **TIGHT, msg=name)


@gc_warnings
@pytest.mark.parametrize("key", ["realformer", "lazyformer"])
def test_reentrant_checkpointing_is_refused(padded_batch, key):
    with pytest.raises(ValueError, match=r"layer 0 \(.*\) passes state .*reentrant.*"
                                         r"'use_reentrant': False"):
        grads("tiny_bert", CROSS[key], padded_batch, checkpointing=True, reentrant=True)


@gc_warnings
def test_checkpointing_a_model_that_drops_keywords_is_refused(padded_batch, monkeypatch):
    """A host whose forward takes no **kwargs cannot carry the Replay to its layers."""
    from attnlab.hf import backend

    monkeypatch.setattr(backend, "_takes_var_kwargs", lambda cls: False)
    with pytest.raises(ValueError, match=r"layer 0 \(predictive\) passes state .*cannot "
                                         r"replay.*gradient_checkpointing_disable"):
        grads("tiny_bert", CROSS["predictive"], padded_batch, checkpointing=True)


@gc_warnings
def test_gradient_checkpointing_leaves_plain_layers_alone(padded_batch):
    """Layers without cross-layer state (softmax, band) run under reentrant checkpointing."""
    plain = grads("tiny_bert", "all:all:band(window=2)", padded_batch)
    ckpt = grads("tiny_bert", "all:all:band(window=2)", padded_batch, checkpointing=True,
                 reentrant=True)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], **TIGHT, msg=name)


@pytest.mark.parametrize("key", ["predictive", "lazyformer_values"])
def test_cross_layer_plan_trains_one_step_in_a_tiny_bert(bert_factory, padded_batch, key):
    plan = CROSS[key] if key == "predictive" else "all:all:lazyformer(share=1)"
    report, _, _ = train_one_step(bert_factory(), plan, padded_batch)
    assert report.counts_by_name[key.split("_")[0]] == 12


@pytest.mark.parametrize("key", list(CROSS))
def test_from_scratch_encoder_trains(padded_batch, key):
    """The lazy layers (1 of 0..1) get no query gradient, by design; the others do."""
    model = scratch_encoder().train()
    apply_plan(model, CROSS[key])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = model(**padded_batch).last_hidden_state
    readout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * readout * padded_batch["attention_mask"][..., None]).sum().backward()
    lazy = {1} if key.startswith("lazyformer") else set()
    for li in range(2):
        grad = model.encoder.layer[li].attention.self.query.weight.grad
        assert (grad is None) == (li in lazy)
        assert grad is None or (torch.isfinite(grad).all() and grad.abs().sum() > 0)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any(".attnlab." in n for n in moved) == (key == "predictive")
    model.eval()
    with torch.no_grad():
        a, b = model(**padded_batch).last_hidden_state, model(**padded_batch).last_hidden_state
    assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("key", list(CROSS))
def test_padded_batch_equals_unpadded_sequence(bert_factory, padded_batch, key):
    model = bert_factory()
    apply_plan(model, CROSS[key])
    with torch.no_grad():
        out = model(**padded_batch).last_hidden_state  # [3,12,32]
        alone = model(input_ids=padded_batch["input_ids"][1:2, :7]).last_hidden_state
    torch.testing.assert_close(out[1:2, :7], alone, **TOL)


@pytest.mark.parametrize("key", ["predictive", "lazyformer"])
def test_save_load_round_trip(bert_factory, padded_batch, tmp_path, key):
    model = bert_factory()
    apply_plan(model, CROSS[key])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attnlab." in name:
                p.add_(0.1 * torch.randn_like(p))
        ref = model(**padded_batch).last_hidden_state
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(**padded_batch).last_hidden_state, ref)


# ----------------------------------------------------------------- capture and the report

REPORT_PLANS = {
    "position": ["0:0,1:gaussian_prior", "0:2,3:hardcoded_gaussian",
                 "1:all:gaussian_transformer"],
    "predictive_realformer": ["0,1:all:predictive", "2:all:realformer"],
    "lazyformer": [CROSS["lazyformer"]],
}


@pytest.mark.parametrize("key", list(REPORT_PLANS))
def test_maps_reach_capture_and_the_html_report(bert_factory, padded_batch, tmp_path, key):
    model = bert_factory()
    apply_plan(model, REPORT_PLANS[key])
    cache = capture_attention(model, padded_batch)
    real = padded_batch["attention_mask"].bool()  # [b,n]
    for layer in range(3):
        probs = cache[layer]
        assert probs.shape == (3, 4, 12, 12)
        sums = probs.sum(-1)  # every row is a probability distribution over the keys
        torch.testing.assert_close(sums, torch.ones_like(sums), **TOL)
        assert (probs[~real[:, None, None, :].expand_as(probs)] == 0).all()
    if key == "lazyformer":  # layer 1 shows the map it reused
        assert torch.equal(cache[1], cache[0]) and not torch.equal(cache[2], cache[1])
    infos = [TokenInfo.from_length(int(n)) for n in real.sum(-1)]
    out = build_report(tmp_path / "r.html", title=key, scores=score_heads(cache, infos),
                       examples=example_maps(cache, infos))
    text = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="attnlab-data">(.*?)</script>', text, re.S).group(1))
    ex = data["examples"][1]  # 7 real tokens
    assert ex["n"] == 7 and len(ex["maps"]) == 3 * 4 * 7 * 7
    layer, head, i, j = 1, 2, 3, 4
    want = round(float(cache[layer][1, head, i, j]) * 1000)
    assert ex["maps"][((layer * 4 + head) * 7 + i) * 7 + j] == want
