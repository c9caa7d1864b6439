"""camtl_prior, average, synthesizer (attention with learned priors).

Each is checked against a naive per-(example, head, query) loop written here from the
paper's formula (CA-MTL's prior built with ``torch.block_diag`` as the official code does,
the factorized synthesizer with repeat_interleave / repeat), padded and unpadded, causal
and not. Then: synthesizer mix = 0 equals dot-product softmax, task ids (sources, errors,
a mixed-task batch equals its per-task parts), seeded init, bad specs, and on a tiny BERT:
one training step, loss decreasing on a toy task (host frozen), the frozen-encoder adapter
use of camtl_prior, save/load round trips and capture_attention.

Tolerances: fp32 at 1e-5 against the loops (same maths, different summation order);
1e-6 for mix = 0 against softmax (the same scores up to float reassociation).
"""

from __future__ import annotations

import copy

import pytest
import torch
from plan_step import train_one_step

import attnlab
from attnlab import apply_plan, load_pretrained, save_pretrained
from attnlab.core import RegistryError
from attnlab.hf import capture_attention, set_task_id

B, H, D, MAXLEN = 3, 2, 8, 32
TOL = {"atol": 1e-5, "rtol": 1e-5}


def build(spec, max_len=MAXLEN, h=H, seed=0, perturb=True):
    """Built from seed; parameters moved off their init (CA-MTL's A starts at 0)."""
    torch.manual_seed(seed)
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, max_len)).eval()
    if perturb:
        with torch.no_grad():
            for p in mech.parameters():
                p.add_(0.5 * torch.randn_like(p))
    return mech


def rand(n, m=None, seed=0, h=H):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    return tuple(torch.randn(B, h, x, D, generator=g) for x in (n, m, m))


def visible(key_mask, causal, b, i, m, n):
    """Keys query i of example b sees (queries aligned to the last n keys)."""
    return [j for j in range(m)
            if (key_mask is None or bool(key_mask[b, j])) and (not causal or j <= i + m - n)]


def loop_softmax(score, q, k, v, key_mask, causal):
    """score(b, h, i, keys) -> raw scores of row i over ``keys``; returns (out, probs)."""
    b_, h_, n, _ = q.shape
    m = k.shape[2]
    out, probs = torch.zeros(b_, h_, n, v.shape[-1]), torch.zeros(b_, h_, n, m)
    for b in range(b_):
        for h in range(h_):
            for i in range(n):
                keys = visible(key_mask, causal, b, i, m, n)
                if keys:
                    p = torch.softmax(score(b, h, i, keys), dim=0)
                    probs[b, h, i, keys] = p
                    out[b, h, i] = p @ v[b, h, keys]
    return out, probs


def masks(n):
    return [None, torch.arange(n)[None, :] < torch.tensor([n, max(1, n - 4), 2])[:, None]]


def ctx(**kw):
    return attnlab.AttnContext(**kw)


# ---------------------------------------------------------------------------- camtl_prior


def official_prior(mech, task, n):
    """M(z) built like the official CBDA: FiLM the [L, s] matrix, chunk its rows into blocks,
    ``torch.block_diag`` them, keep the first L columns; then the first n rows/columns."""
    z = mech.task_embedding[task]
    gb = mech.film_weight @ z + mech.film_bias
    gamma, beta = gb[: mech.block], gb[mech.block:]
    filmed = (1 + gamma) * mech.blocks_a + beta  # [L,s]
    full = torch.block_diag(*filmed.split(mech.block, dim=0))
    return full[:, : mech.dims.max_len][:n, :n]


@pytest.mark.parametrize("max_len,blocks", [(32, 4), (30, 4), (32, 1), (16, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_camtl_matches_naive_loop(max_len, blocks, causal):
    mech = build(f"camtl_prior(tasks=3, blocks={blocks}, task_dim=5)", max_len=max_len)
    n = min(13, max_len)
    q, k, v = rand(n, seed=blocks)
    tasks = torch.tensor([2, 0, 1])
    with torch.no_grad():
        priors = [official_prior(mech, int(t), n) for t in tasks]
    for key_mask in masks(n):
        res = mech(q, k, v, ctx(key_mask=key_mask, causal=causal, need_weights=True,
                                extras={"task_id": tasks}))

        def score(b, h, i, keys, priors=priors):
            return q[b, h, i] @ k[b, h, keys].T * D**-0.5 + priors[b][i, keys]

        ref, pref = loop_softmax(score, q, k, v, key_mask, causal)
        torch.testing.assert_close(res.out, ref, **TOL)
        torch.testing.assert_close(res.probs, pref, **TOL)


def test_camtl_prior_is_block_diagonal_and_depends_on_the_task():
    mech = build("camtl_prior(tasks=2, blocks=4)")  # L = 32: blocks of 8
    with torch.no_grad():
        m0, m1 = mech.prior(torch.tensor([0, 1]), 20, 20)
    i = torch.arange(20)
    off = (i[:, None] // 8) != (i[None, :] // 8)
    assert (m0[off] == 0).all() and (m0[~off] != 0).all()
    assert (m0 - m1).abs().max() > 0.1


def test_camtl_init_is_the_official_one():
    mech = build("camtl_prior(tasks=3, blocks=4)", perturb=False)
    assert (mech.blocks_a == 0).all() and (mech.film_bias == 0).all()
    assert mech.blocks_a.shape == (MAXLEN, 8) and mech.film_weight.shape == (16, 32)
    assert abs(mech.film_weight.std().item() - 0.02) < 0.004
    with torch.no_grad():
        assert mech.prior(torch.tensor([0, 1, 2]), 16, 16).abs().max() < 0.02


def test_camtl_task_id_sources_and_errors():
    mech = build("camtl_prior(tasks=3)")
    q, k, v = rand(6)
    per_example = mech(q, k, v, ctx(extras={"task_id": torch.tensor([1, 1, 1])})).out
    torch.testing.assert_close(mech(q, k, v, ctx(extras={"task_id": 1})).out, per_example,
                               atol=0, rtol=0)
    fixed = build("camtl_prior(tasks=3, task=1)")
    torch.testing.assert_close(fixed(q, k, v, ctx()).out, per_example, atol=0, rtol=0)
    # the batch's id wins over the configured one
    other = fixed(q, k, v, ctx(extras={"task_id": 2})).out
    assert not torch.allclose(other, per_example)
    with pytest.raises(ValueError, match=r"needs a task id.*set_task_id.*task="):
        mech(q, k, v, ctx())
    with pytest.raises(ValueError, match=r"0\.\.2, got 0\.\.3.*tasks > 3"):
        mech(q, k, v, ctx(extras={"task_id": torch.tensor([0, 3, 1])}))
    with pytest.raises(ValueError, match=r"one per example \(\[3\]\)"):
        mech(q, k, v, ctx(extras={"task_id": torch.tensor([0, 1])}))
    with pytest.raises(ValueError, match="integers"):
        mech(q, k, v, ctx(extras={"task_id": 1.0}))
    with pytest.raises(ValueError, match=r"13 positions.*max_len=12.*truncate"):
        build("camtl_prior", max_len=12)(*rand(13), ctx(extras={"task_id": 0}))


# -------------------------------------------------------------------------------- average


def naive_average(mech, q, k, v, key_mask, causal):
    """Loop: mean of the visible values, FFN, then the gate on [v_i; g_i]."""
    b_, h_, n, _ = q.shape
    m = k.shape[2]
    out, probs = torch.zeros_like(q), torch.zeros(b_, h_, n, m)
    for b in range(b_):
        for h in range(h_):
            for i in range(n):
                keys = visible(key_mask, causal, b, i, m, n)
                if not keys:
                    continue
                probs[b, h, i, keys] = 1.0 / len(keys)
                g = v[b, h, keys].mean(0)
                if mech.ffn_w1 is not None:
                    hid = torch.relu(g @ mech.ffn_w1[h] + mech.ffn_b1[h])
                    g = hid @ mech.ffn_w2[h] + mech.ffn_b2[h]
                gates = torch.sigmoid(torch.cat([v[b, h, i], g]) @ mech.gate_w[h]
                                      + mech.gate_b[h])
                out[b, h, i] = gates[:D] * v[b, h, i] + gates[D:] * g
    return out, probs


@pytest.mark.parametrize("spec", ["average", "average(ffn=False)", "average(hidden=5)"])
@pytest.mark.parametrize("causal", [False, True])
def test_average_matches_naive_loop(spec, causal):
    mech = build(spec)
    n = m = 9
    q, k, v = rand(n, seed=len(spec))
    for key_mask in [None, torch.arange(m)[None, :] < torch.tensor([m, m - 3, 1])[:, None]]:
        with torch.no_grad():
            ref, pref = naive_average(mech, q, k, v, key_mask, causal)
        fast = mech(q, k, v, ctx(key_mask=key_mask, causal=causal)).out  # cumulative sums
        dense = mech(q, k, v, ctx(key_mask=key_mask, causal=causal, need_weights=True))
        torch.testing.assert_close(fast, ref, **TOL)
        torch.testing.assert_close(dense.out, ref, **TOL)  # the weights-matrix path
        torch.testing.assert_close(dense.probs, pref, **TOL)


@pytest.mark.parametrize("spec", ["average", "average(ffn=False)"])
@pytest.mark.parametrize("causal", [False, True])
def test_average_gradients_match_naive_loop(spec, causal):
    """v's and every parameter's gradient through the fast path (the FFN on one row per
    sequence when bidirectional, W_g applied to v and g apart) equal autograd through the
    loop's [v_i; g_i] form, padded."""
    mech = build(spec)
    n = 9
    q, k, v = rand(n, seed=3)
    v.requires_grad_()
    key_mask = torch.arange(n)[None, :] < torch.tensor([n, n - 3, 1])[:, None]
    out = mech(q, k, v, ctx(key_mask=key_mask, causal=causal)).out
    ref, _ = naive_average(mech, q, k, v, key_mask, causal)
    g = torch.randn_like(out)
    params = [v, *mech.parameters()]
    for a, r in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g),
                    strict=True):
        torch.testing.assert_close(a, r, **TOL)


def test_average_shapes_errors_and_no_query_key_reads():
    assert build("average", perturb=False).ffn_w1.shape == (H, D, 4 * D)
    assert build("average(ffn=False)").ffn_w1 is None
    q, k, v = (t.requires_grad_() for t in rand(5))
    build("average")(q, k, v, ctx(causal=True)).out.sum().backward()
    assert q.grad is None and k.grad is None and v.grad is not None
    with pytest.raises(ValueError, match="sized by head_dim=8, but v has head dim 4"):
        build("average")(q, k, v[..., :4], ctx())
    with pytest.raises(ValueError, match="got 5 queries and 7 keys"):
        build("average")(*rand(5, 7), ctx())


def test_average_dropout_only_in_training():
    mech = build("average")
    q, k, v = rand(9, seed=3)
    c = ctx(dropout=0.5)
    assert torch.equal(mech(q, k, v, c).out, mech(q, k, v, ctx()).out)
    torch.manual_seed(1)
    assert not torch.allclose(mech.train()(q, k, v, c).out, mech.eval()(q, k, v, c).out)


# ---------------------------------------------------------------------------- synthesizer


def naive_synth_row(mech, q, b, h, i, m):
    """S_i over keys 0..m-1 from the paper's formulas, one (example, head, query)."""
    cfg = mech.cfg
    if cfg.kind == "dense":
        hid = torch.relu(q[b, h, i] @ mech.w1[h] + mech.b1[h])
        outs = [hid @ w[h] + bias[h] for w, bias in zip(mech.heads_w, mech.heads_b,
                                                          strict=True)]
        if cfg.factorized:
            a_vec, b_vec = outs
            row = a_vec.repeat_interleave(b_vec.numel()) * b_vec.repeat(a_vec.numel())
        else:
            row = outs[0]
        return row[:m]
    tables = mech._tables()
    if cfg.factorized:
        return (tables[0][h] @ tables[1][h].T)[i, :m]
    return tables[0][h, i, :m]


SYNTH = [
    "synthesizer",
    "synthesizer(factorized=True, a=4)",
    "synthesizer(hidden=5, mix=0.3)",
    "synthesizer(kind='random')",
    "synthesizer(kind='random', trainable=False, mix=0.6)",
    "synthesizer(kind='random', factorized=True, rank=3)",
    "synthesizer(kind='random', factorized=True, rank=3, mix=0.5, learn_mix=True)",
    "synthesizer(factorized=True, a=8, mix=0.25, learn_mix=True)",
]


@pytest.mark.parametrize("spec", SYNTH)
@pytest.mark.parametrize("causal", [False, True])
def test_synthesizer_matches_naive_loop(spec, causal):
    mech = build(spec)
    n = 10
    q, k, v = rand(n, seed=len(spec))
    if mech.alpha is not None:
        alpha = mech.alpha.detach()
        assert not torch.allclose(alpha, torch.full((H,), mech.cfg.mix))  # perturbed per head
    else:
        alpha = torch.full((H,), mech.cfg.mix)
    for key_mask in masks(n):
        res = mech(q, k, v, ctx(key_mask=key_mask, causal=causal, need_weights=True))

        def score(b, h, i, keys):
            with torch.no_grad():
                syn = naive_synth_row(mech, q, b, h, i, n)[keys]
            dot = q[b, h, i] @ k[b, h, keys].T * D**-0.5
            return (1 - alpha[h]) * dot + alpha[h] * syn

        ref, pref = loop_softmax(score, q, k, v, key_mask, causal)
        torch.testing.assert_close(res.out, ref, **TOL)
        torch.testing.assert_close(res.probs, pref, **TOL)


@pytest.mark.parametrize("spec", ["synthesizer(mix=0)", "synthesizer(kind='random', mix=0)",
                                  "synthesizer(factorized=True, a=4, mix=0.0)"])
@pytest.mark.parametrize("causal", [False, True])
def test_synthesizer_mix_zero_is_dot_product_softmax(spec, causal):
    mech = build(spec)
    softmax = attnlab.build_mechanism("softmax", attnlab.HeadDims(H, D))
    q, k, v = rand(10, seed=2)
    key_mask = masks(10)[1]
    c = ctx(key_mask=key_mask, causal=causal, need_weights=True)
    res, ref = mech(q, k, v, c), softmax(q, k, v, c)
    torch.testing.assert_close(res.out, ref.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(res.probs, ref.probs, atol=1e-6, rtol=1e-6)


def test_pure_synthesizer_reads_no_keys():
    q, k, v = (t.requires_grad_() for t in rand(6))
    build("synthesizer")(q, k, v, ctx()).out.sum().backward()
    assert k.grad is None and q.grad is not None
    q, k, v = (t.detach().requires_grad_() for t in rand(6))
    build("synthesizer(kind='random')")(q, k, v, ctx()).out.sum().backward()
    assert q.grad is None and k.grad is None and v.grad is not None


def test_synthesizer_parameter_shapes_and_fixed_table():
    dense = build("synthesizer(factorized=True, a=4)", perturb=False)
    assert [tuple(w.shape) for w in dense.heads_w] == [(H, D, 4), (H, D, 8)]
    rnd = build("synthesizer(kind='random', factorized=True, rank=3)", perturb=False)
    assert [tuple(t.shape) for t in rnd.tables] == [(H, MAXLEN, 3)] * 2
    fixed = build("synthesizer(kind='random', trainable=False)", perturb=False)
    assert list(fixed.parameters()) == [] and "table_0" in fixed.state_dict()
    assert abs(fixed.table_0.std().item() - MAXLEN**-0.5) < 0.01  # N(0, 1/L)


def test_synthesizer_length_and_shape_errors():
    with pytest.raises(ValueError, match=r"13 keys.*max_len=12.*truncate"):
        build("synthesizer", max_len=12)(*rand(13), ctx())
    with pytest.raises(ValueError, match="got 5 queries and 7 keys"):
        build("synthesizer(kind='random')")(*rand(5, 7), ctx())
    with pytest.raises(ValueError, match=r"a to divide max_len=32.*use a in \[1, 2, 4"):
        build("synthesizer(factorized=True, a=5)")
    assert build("synthesizer")(*rand(5, 7), ctx()).out.shape == (B, H, 5, D)


@pytest.mark.parametrize("spec,match", [
    ("synthesizer(mix=1.5)", r"mix must lie in \[0, 1\].*0 = pure dot-product"),
    ("synthesizer(rank=0)", "rank must be >= 1"),
    ("synthesizer(trainable=False)", "kind='random' only"),
    ("synthesizer(kind='learned')", "must be one of"),
    ("camtl_prior(tasks=0)", "tasks must be >= 1"),
    ("camtl_prior(blocks=0)", "blocks must be >= 1"),
    ("camtl_prior(tasks=2, task=2)", r"task id in 0\.\.1.*raise tasks"),
    ("average(hidden=0)", "hidden must be >= 1"),
])
def test_bad_specs_name_the_fix(spec, match):
    with pytest.raises(RegistryError, match=match):
        attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, MAXLEN))


@pytest.mark.parametrize("spec", ["camtl_prior", "average",
                                  "synthesizer(factorized=True, a=4, learn_mix=True)",
                                  "synthesizer(kind='random', trainable=False)"])
def test_init_is_deterministic_from_the_global_seed(spec):
    a, b, c = (build(spec, seed=s, perturb=False).state_dict() for s in (5, 5, 6))
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert any(not torch.equal(a[key], c[key]) for key in a)


# ------------------------------------------------------------------- in a tiny BERT

CAMTL = "camtl_prior(tasks=2, blocks=4, task_dim=8)"
PLANS = {
    "camtl_prior": CAMTL,
    "average": "average(hidden=16)",
    "synthesizer": "synthesizer(factorized=True, a=8, mix=0.5)",
    "synthesizer_random": "synthesizer(kind='random', factorized=True, rank=4)",
    "synthesizer_fixed": "synthesizer(kind='random', trainable=False, mix=0.5)",
}


@pytest.mark.parametrize("spec", ["camtl_prior(tasks=2, task=1)", "average",
                                  "synthesizer", "synthesizer(kind='random', mix=0.5)"])
def test_plan_trains_one_step(bert_factory, padded_batch, spec):
    model = bert_factory()
    # average reads no q: its layers keep softmax heads, whose query gradient plan_step checks
    last = "2:1,3:" if spec == "average" else "2:all:"
    report, before, after = train_one_step(model, ["1:0,2:" + spec, last + spec], padded_batch)
    name = spec.split("(")[0]
    assert [row.split("(")[0] for row in report.table[1]] == [name, "softmax", name, "softmax"]
    assert not torch.allclose(before, after)


def mechanism_params(model):
    return [p for name, p in model.named_parameters() if ".attnlab." in name]


def fit_teacher(model, batch, tasks=(None,), steps=8, lr=0.05):
    """Toy task with a reachable optimum: a copy of ``model`` whose mechanism parameters are
    moved by N(0, 1) is the teacher; the student (host frozen, Adam on its mechanisms'
    parameters only) fits the teacher's last hidden states, cycling through ``tasks``
    (task ids set with set_task_id, None = no task). Returns the loss of each step."""
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        for p in mechanism_params(teacher):
            p.add_(torch.randn_like(p))
        targets = {}
        for task in tasks:
            if task is not None:
                set_task_id(teacher, task)
            targets[task] = teacher(**batch).last_hidden_state  # [b,n,hidden]
    for p in model.parameters():
        p.requires_grad_(False)
    params = mechanism_params(model)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    mask = batch["attention_mask"][..., None].float()
    losses = []
    model.train()
    for step in range(steps):
        task = tasks[step % len(tasks)]
        if task is not None:
            set_task_id(model, task)
        out = model(**batch).last_hidden_state  # [b,n,hidden]
        loss = ((out - targets[task]).square() * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("key", ["synthesizer", "synthesizer_random", "average"])
def test_loss_decreases_on_a_toy_task(bert_factory, padded_batch, key):
    model = bert_factory()
    apply_plan(model, {"layers": "all", "heads": "all", "mechanism": PLANS[key]})
    losses = fit_teacher(model, padded_batch)
    assert losses[-1] < 0.75 * losses[0], losses


def test_camtl_on_a_frozen_encoder_trains_only_the_prior(bert_factory, padded_batch):
    model = bert_factory()
    apply_plan(model, {"layers": "all", "heads": "all", "mechanism": CAMTL})
    host = {n: p.detach().clone() for n, p in model.named_parameters() if ".attnlab." not in n}
    prior = {n: p.detach().clone() for n, p in model.named_parameters() if ".attnlab." in n}
    assert len(prior) == 3 * 4  # per layer: task embedding, FiLM weight and bias, A
    with torch.no_grad():
        set_task_id(model, 0)
        start = model(**padded_batch).last_hidden_state
    losses = fit_teacher(model, padded_batch, tasks=(0, 1), steps=10)
    for name, p in model.named_parameters():
        if name in host:
            assert p.grad is None and torch.equal(p, host[name]), name
        else:
            assert p.grad is not None and not torch.equal(p, prior[name]), name
    # each task's own loss went down (steps alternate 0, 1, 0, 1, ...)
    assert losses[-2] < 0.75 * losses[0] and losses[-1] < 0.75 * losses[1], losses
    # different task ids give different outputs, and the model moved off the host
    model.eval()
    outs = []
    with torch.no_grad():
        for task in (0, 1):
            set_task_id(model, task)
            outs.append(model(**padded_batch).last_hidden_state)
    assert (outs[0] - outs[1]).abs().max() > 1e-2
    assert (outs[0] - start).abs().max() > 1e-2


def test_a_mixed_task_batch_equals_its_per_task_parts(bert_factory, padded_batch):
    model = bert_factory()
    apply_plan(model, {"layers": "all", "heads": "all", "mechanism": CAMTL})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attnlab." in name:
                p.add_(0.3 * torch.randn_like(p))
        set_task_id(model, [1, 0, 1])
        mixed = model(**padded_batch).last_hidden_state
        for task in (0, 1):
            set_task_id(model, torch.tensor(task))
            whole = model(**padded_batch).last_hidden_state
            rows = torch.tensor([1, 0, 1]) == task
            torch.testing.assert_close(mixed[rows], whole[rows], atol=1e-6, rtol=1e-6)
        set_task_id(model, None)
        with pytest.raises(ValueError, match="needs a task id"):
            model(**padded_batch)
    with pytest.raises(ValueError, match="1-D list/tensor of ints"):
        set_task_id(model, [0.5, 1.0])
    with pytest.raises(ValueError, match="no attnlab plan applied"):
        set_task_id(bert_factory(), 0)


@pytest.mark.parametrize("key", list(PLANS))
def test_save_load_round_trip(bert_factory, padded_batch, tmp_path, key):
    model = bert_factory()
    apply_plan(model, ["all:0,1:" + PLANS[key]])
    with torch.no_grad():  # off the init, fixed tables (buffers) included
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if ".attnlab." in name and p.is_floating_point():
                p.add_(0.1 * torch.randn_like(p))
    if key == "camtl_prior":
        set_task_id(model, [0, 1, 1])
    with torch.no_grad():
        ref = model(**padded_batch).last_hidden_state
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    if key == "camtl_prior":  # task ids belong to the batch, not the checkpoint
        set_task_id(loaded, [0, 1, 1])
    with torch.no_grad():
        assert torch.equal(loaded(**padded_batch).last_hidden_state, ref)


@pytest.mark.parametrize("key", list(PLANS))
def test_capture_attention_sees_the_maps(bert_factory, padded_batch, key):
    model = bert_factory()
    apply_plan(model, ["1:all:" + PLANS[key], "2:1,3:" + PLANS[key]])
    if key == "camtl_prior":
        set_task_id(model, 1)
    cache = capture_attention(model, padded_batch)
    assert len(cache) == 3
    real = padded_batch["attention_mask"].bool()  # [b,n]
    for layer in range(3):
        probs = cache[layer]
        assert probs.shape == (3, 4, 12, 12)
        rows = probs.sum(-1)  # [b,h,n]: real query rows sum to 1 over real keys
        torch.testing.assert_close(rows[real[:, None, :].expand_as(rows)],
                                   torch.ones(int(real.sum()) * 4), atol=1e-5, rtol=1e-5)
        assert (probs * ~real[:, None, None, :] == 0).all()  # padded keys get no weight
    assert cache.mechanisms[1] == [PLANS[key].split("(")[0]]
