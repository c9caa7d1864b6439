"""disagreement and pattern_loss: their aux losses against loop references, outputs equal to
softmax, gradients from the aux terms, and the aux path through a tiny BERT, the training
loop (total loss = task loss + weighted aux, with the gradient of both) and the runner's
metrics.jsonl; maps visible to capture_attention and the HTML report.

Tolerances: fp32 1e-5 (same sums, different order); outputs vs the softmax oracle 1e-6
(identical computation).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from plan_step import train_one_step

import attnlab
from attnlab import apply_plan
from attnlab.core import RegistryError

B, H, D = 3, 4, 8


def build(spec, h=H):
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, 64)).eval()


def rand(n, seed=0, b=B, h=H):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, D, generator=g) for _ in range(3))


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def naive_probs(q, k, key_mask, causal):
    """Per example and head: softmax over the real (and causal) keys, by loops."""
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, k.shape[2])
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                keys = [j for j in range(k.shape[2]) if (key_mask is None or key_mask[bi, j])
                        and (not causal or j <= i)]
                if keys:
                    s = torch.stack([q[bi, hi, i] @ k[bi, hi, j] for j in keys]) * D**-0.5
                    out[bi, hi, i, keys] = torch.softmax(s, 0)
    return out


# ----------------------------------------------------------------------------- disagreement


def naive_disagreement(q, k, v, key_mask, terms, causal=False):
    """-D of Li et al. 2018 with explicit loops over examples and head pairs."""
    b, h, n, _ = q.shape
    A = naive_probs(q, k, key_mask, causal)
    O = A @ v
    total = 0.0
    for bi in range(b):
        real = [j for j in range(n) if key_mask is None or key_mask[bi, j]]
        ex = 0.0
        for i in range(h):
            for j in range(h):
                if "subspace" in terms:
                    vi, vj = v[bi, i, real].flatten(), v[bi, j, real].flatten()
                    den = vi.norm() * vj.norm()
                    ex += float((vi @ vj) / den) if den > 0 else 0.0
                if "output" in terms:
                    oi, oj = O[bi, i, real].flatten(), O[bi, j, real].flatten()
                    den = oi.norm() * oj.norm()
                    ex += float((oi @ oj) / den) if den > 0 else 0.0
                if "position" in terms:
                    ex += float((A[bi, i][real] * A[bi, j][real]).abs().sum())
        total += ex / h**2
    return total / b


@pytest.mark.parametrize("terms", [("subspace",), ("position",), ("output",), None])
@pytest.mark.parametrize("lengths", [None, [9, 5, 0]])
@pytest.mark.parametrize("causal", [False, True])
def test_disagreement_equals_loop_reference(terms, lengths, causal):
    spec = "disagreement(weight=0.7)" if terms is None else \
        f"disagreement(terms={list(terms)}, weight=0.7)"
    terms = terms or ("subspace", "position", "output")
    q, k, v = rand(9, seed=len(terms) + causal)
    key_mask = None if lengths is None else lengths_mask(9, lengths)
    res = build(spec)(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                                   need_weights=True))
    ref = naive_disagreement(q, k, v, key_mask, terms, causal)
    assert res.aux_loss.item() == pytest.approx(0.7 * ref, rel=1e-5, abs=1e-6)
    out, probs = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(res.out, out, atol=1e-6, rtol=1e-6)  # plain softmax heads
    torch.testing.assert_close(res.probs, probs, atol=1e-6, rtol=1e-6)


def test_identical_heads_have_no_disagreement():
    """Degenerate case: all heads equal -> every cosine is 1 and -D_subspace = -D_output = 1;
    weight 0 gives a zero aux loss."""
    q, k, v = (x[:, :1].expand(B, H, 7, D) for x in rand(7, seed=3))
    for term in ("subspace", "output"):
        aux = build(f"disagreement(terms=['{term}'])")(q, k, v, attnlab.AttnContext()).aux_loss
        assert aux.item() == pytest.approx(1.0, abs=1e-6)
    assert build("disagreement(weight=0.0)")(*rand(7), attnlab.AttnContext()).aux_loss == 0


@pytest.mark.parametrize("term,reads", [("subspace", "v"), ("position", "qk"),
                                        ("output", "qkv")])
def test_disagreement_terms_have_gradients(term, reads):
    q, k, v = (x.requires_grad_() for x in rand(6, seed=4))
    aux = build(f"disagreement(terms=['{term}'])").train()(
        q, k, v, attnlab.AttnContext(key_mask=lengths_mask(6, [6, 4, 2]))).aux_loss
    grads = torch.autograd.grad(aux, (q, k, v), allow_unused=True)
    for name, g in zip("qkv", grads, strict=True):
        if name in reads:
            assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
        else:
            assert g is None or (g == 0).all(), name


def test_disagreement_spec_errors_name_the_fix():
    for spec, match in [("disagreement(weight=-1)", "must be >= 0"),
                        ("disagreement(terms=[])", "at least one term"),
                        ("disagreement(terms=['output', 'output'])", "at most once"),
                        ("disagreement(terms=['outputs'])", "must be one of")]:
        with pytest.raises(RegistryError, match=match):
            build(spec)


# ----------------------------------------------------------------------------- pattern loss


def naive_target(pattern, bi, i, j, n, key_mask, causal):
    """P[i, j] of one example by cases (positions 0-based)."""
    def ok(jj):
        return 0 <= jj < n and (key_mask is None or bool(key_mask[bi, jj])) and \
            (not causal or jj <= i)
    if pattern == "bow":
        seen = [jj for jj in range(n) if ok(jj)]
        return 1.0 / len(seen) if ok(j) and seen else 0.0
    want = {"prev": i - 1, "next": i + 1, "first": 0, "self": i}[pattern]
    return 1.0 if j == want and ok(j) else 0.0


def naive_pattern_loss(q, k, key_mask, patterns, causal=False):
    """sum over patterns of the MSE over (heads of the pattern, real rows, real keys)."""
    b, h, n, _ = q.shape
    A = naive_probs(q, k, key_mask, causal)
    heads = {}
    for hi in range(h):
        heads.setdefault(patterns[hi % len(patterns)], []).append(hi)
    total = 0.0
    for pat, hs in heads.items():
        if pat == "none":
            continue
        sq, count = 0.0, 0
        for bi in range(b):
            real = [j for j in range(n) if key_mask is None or key_mask[bi, j]]
            for hi in hs:
                for i in real:
                    for j in real:
                        t = naive_target(pat, bi, i, j, n, key_mask, causal)
                        sq += (float(A[bi, hi, i, j]) - t) ** 2
                        count += 1
        total += sq / count
    return total


@pytest.mark.parametrize("patterns", [("prev", "next", "first", "bow"), ("self",),
                                      ("next", "none")])
@pytest.mark.parametrize("lengths", [None, [8, 5, 1]])
@pytest.mark.parametrize("causal", [False, True])
def test_pattern_loss_equals_loop_reference(patterns, lengths, causal):
    q, k, v = rand(8, seed=len(patterns))
    key_mask = None if lengths is None else lengths_mask(8, lengths)
    mech = build(f"pattern_loss(patterns={list(patterns)}, weight=2.5)")
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal))
    ref = naive_pattern_loss(q, k, key_mask, patterns, causal)
    assert res.aux_loss.item() == pytest.approx(2.5 * ref, rel=1e-5, abs=1e-6)
    out, _ = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(res.out, out, atol=1e-6, rtol=1e-6)


def test_bow_pattern_is_met_by_uniform_attention():
    """Degenerate case: q = 0 makes every head uniform over the real keys, which is the bag
    of words pattern exactly -> zero loss; a head without a pattern gives no loss at all."""
    q, k, v = rand(7, seed=5)
    key_mask = lengths_mask(7, [7, 4, 2])
    aux = build("pattern_loss(patterns=['bow'])")(torch.zeros_like(q), k, v,
                                                  attnlab.AttnContext(key_mask=key_mask))
    assert aux.aux_loss.item() == pytest.approx(0.0, abs=1e-12)
    none = build("pattern_loss(patterns=['none'])")(q, k, v, attnlab.AttnContext())
    assert none.aux_loss is None


def test_pattern_loss_gradient_moves_heads_towards_their_patterns():
    """Gradient steps on q, k with the aux loss alone lower it at every step (v gets no
    gradient)."""
    q, k, v = (x.clone().requires_grad_() for x in rand(8, seed=6))
    mech = build("pattern_loss(patterns=['prev', 'next', 'first', 'self'])").train()
    losses = []
    for _ in range(5):
        aux = mech(q, k, v, attnlab.AttnContext()).aux_loss
        gq, gk, gv = torch.autograd.grad(aux, (q, k, v), allow_unused=True)
        assert gv is None and gq.abs().sum() > 0 and gk.abs().sum() > 0
        with torch.no_grad():
            q -= 2.0 * gq
            k -= 2.0 * gk
        losses.append(aux.item())
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_pattern_loss_spec_errors_name_the_fix():
    with pytest.raises(RegistryError, match="must be one of"):
        build("pattern_loss(patterns=['previous'])")
    with pytest.raises(RegistryError, match="at least one pattern"):
        build("pattern_loss(patterns=[])")
    with pytest.raises(RegistryError, match="must be >= 0"):
        build("pattern_loss(weight=-2)")
    with pytest.raises(ValueError, match="5 patterns for 4 heads"):
        build("pattern_loss(patterns=['prev', 'next', 'first', 'self', 'bow'])")


# -------------------------------------------------------------------- inside a tiny BERT

PLANS = {
    "disagreement": ["all:all:disagreement(weight=0.5)"],
    "pattern_loss": ["0,2:0,1:pattern_loss(patterns=['prev', 'first'], weight=3.0)"],
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_trains_one_step(name, bert_factory, padded_batch):
    report, _, _ = train_one_step(bert_factory(), PLANS[name], padded_batch)
    assert any(s.startswith(name) for row in report.table for s in row)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_aux_loss_scales_with_weight_and_reaches_the_query(name, bert_factory, padded_batch):
    """The model's aux loss is the weighted sum of the layers' terms (twice the weight, twice
    the loss), and its gradient alone reaches the query projections of the planned layers."""
    rule = PLANS[name][0]
    model, double = bert_factory(), bert_factory()
    apply_plan(model, [rule])
    weight = float(re.search(r"weight=([\d.]+)", rule).group(1))
    apply_plan(double, [rule.replace(f"weight={weight}", f"weight={2 * weight}")])
    model(**padded_batch)
    double(**padded_batch)
    aux = attnlab.aux_loss(model)
    assert aux is not None and aux.item() > 0
    assert attnlab.aux_loss(double).item() == pytest.approx(2 * aux.item(), rel=1e-6)
    layers = sorted({int(x) for x in rule.split(":")[0].replace("all", "0,1,2").split(",")})
    queries = [model.encoder.layer[i].attention.self.query.weight for i in layers]
    for g in torch.autograd.grad(aux, queries):
        assert g.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(PLANS))
def test_loop_total_loss_is_task_plus_weighted_aux(name, bert_factory, padded_batch):
    """train.loop's micro-step: total = task loss + aux (the weighted sum), its returned aux
    share is that aux, and the query gradient is the sum of both terms' gradients."""
    from attnlab.recipes.finetune import _Run
    from attnlab.train.accel import run_accelerator
    from attnlab.train.loop import LoopParts, _micro_step

    model = bert_factory("BertForSequenceClassification", num_labels=2)
    apply_plan(model, PLANS[name])
    batch = {**padded_batch, "labels": torch.tensor([0, 1, 1])}
    run = _Run(task=None, tokenizer=None, model=model, plan=None, report=None,
               tuner=_NoTuner(), tuner_cfg=None, train_features=[], collate=None,
               evaluate=None, main_metric="", params={})  # the runner's aux_loss sum
    parts = LoopParts(model=model, optimizer=None, scheduler=None, train_features=[0],
                      collate=lambda _: batch, evaluate=None, main_metric="",
                      greater_is_better=True, aux_loss=run.aux_loss)
    query = model.bert.encoder.layer[0].attention.self.query.weight
    model.train()
    task = model(**batch).loss
    aux = attnlab.aux_loss(model)
    g_task, g_aux = (torch.autograd.grad(x, query, retain_graph=True)[0] for x in (task, aux))
    model.zero_grad()
    total, aux_share = _micro_step(parts, model, run_accelerator(), [0], 1, True)
    assert total == pytest.approx(task.item() + aux.item(), rel=1e-6)
    assert aux_share == pytest.approx(aux.item(), rel=1e-6)
    assert g_aux.abs().sum() > 0
    torch.testing.assert_close(query.grad, g_task + g_aux, atol=1e-6, rtol=1e-5)


class _NoTuner:
    """A tuner without an aux loss of its own (full fine-tuning)."""

    def aux_loss(self, model):
        return None


def test_runner_logs_the_aux_loss_in_metrics(tmp_path):
    """Two steps of `attnlab run` with a disagreement plan: every logged step carries the
    aux term, part of (and smaller than) the total loss."""
    from attnlab.config import load_config
    from attnlab.recipes.finetune import run_experiment

    base = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=24",
            "train.batch_size=8", "train.max_steps=2", "train.log_every=1",
            "task.train_limit=16", "task.eval_limit=8", "train.keep_best=false",
            "optim.lr=1e-3", "plan=all:all:disagreement(weight=0.5)"]
    run_experiment(load_config(None, base + ["name=dis", f"output_dir={tmp_path}"]))
    lines = [json.loads(x) for x in (tmp_path / "dis" / "metrics.jsonl").read_text()
             .splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0 < r["aux_loss"] < r["loss"] for r in steps)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_maps_reach_capture_and_the_report(name, bert_factory, padded_batch, tmp_path):
    """capture_attention records every layer (the planned heads' maps equal plain softmax
    ones: these mechanisms only add a loss), and the maps go into the HTML report."""
    from attnlab.analysis import TokenInfo, build_report, example_maps, score_heads

    plain = attnlab.capture_attention(bert_factory(), padded_batch)
    model = bert_factory()
    apply_plan(model, PLANS[name])
    cache = attnlab.capture_attention(model, padded_batch)
    assert any(name in names for names in cache.mechanisms.values())
    for layer in cache:
        torch.testing.assert_close(cache[layer], plain[layer], atol=1e-6, rtol=1e-6)
    infos = [TokenInfo.from_length(int(n)) for n in padded_batch["attention_mask"].sum(1)]
    maps = cache.stack()  # [L,b,h,n,n]
    out = build_report(tmp_path / "report.html", title=name, plan=PLANS[name],
                       scores=score_heads(maps, infos), examples=example_maps(maps, infos))
    text = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="attnlab-data">(.*?)</script>', text, re.S).group(1))
    assert json.dumps(data).count('"maps"') >= 1 and name in text
