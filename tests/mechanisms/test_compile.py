"""Every registered mechanism under ``torch.compile`` (Dynamo + AOTAutograd, the
``aot_eager`` backend: no C++ code generation, so it runs on any CPU quickly) equals eager.

What compiling a whole model exercises: Dynamo tracing of the mechanism (graph breaks at
``.item()``/``bool(tensor)``, seeded ``torch.Generator``s, lru-cached layouts), the custom
``torch.autograd.Function``s of the blocked/gathered/top-key engines, and guards that must
send a call with another key mask (or none) to a fresh graph instead of a stale one.

Tolerance: fp32 outputs and q/k/v gradients at 1e-5 (atol and rtol). ``aot_eager`` runs the
same ATen kernels as eager, so the only freedom is summation order (e.g. gradient
accumulation inside the compiled backward); eager itself repeats a few kernels to ~1e-7
relative. Which of q/k/v receive a gradient must match exactly.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import attnlab
from attnlab.core import mechanism_class
from attnlab.hf import apply_plan
from attnlab.mechanisms._blocksparse import use_blocked


def _compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here, or None."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    try:
        from torch import _dynamo
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"torch._dynamo does not import: {exc}"
    if not _dynamo.is_dynamo_supported():
        return f"torch.compile is not supported on Python {sys.version.split()[0]}"
    return None


_WHY = _compile_unavailable()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
    pytest.mark.usefixtures("one_thread"),
]

NAMES = attnlab.list_mechanisms()
B, H, D = 2, 2, 8
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each case compiles from scratch and leaves no cached graphs behind."""
    from torch import _dynamo

    _dynamo.reset()
    yield
    _dynamo.reset()


def build(name: str, max_len: int = 64):
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(mechanism_class(name).example,
                                   attnlab.HeadDims(H, D, max_len))
    return mech.eval()


def inputs(n: int, lengths: list[int] | None, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, n, D, generator=g) for _ in range(4))
    key_mask = None if lengths is None else torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    return q, k, v, w, key_mask


def run(mech, q, k, v, w, key_mask):
    """Output and q/k/v gradients of sum(out * w) (a fixed random cotangent)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(1)
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, state={})).out
    (out * w).sum().backward()
    return out.detach(), (q.grad, k.grad, v.grad)


def assert_same(eager, compiled, what: str):
    (eo, eg), (co, cg) = eager, compiled
    torch.testing.assert_close(co, eo, **TOL, msg=lambda m: f"{what}: output\n{m}")
    for x, ge, gc in zip("qkv", eg, cg, strict=True):
        assert (ge is None) == (gc is None), f"{what}: d{x} is {ge is None=} but {gc is None=}"
        if ge is not None:
            torch.testing.assert_close(gc, ge, **TOL, msg=lambda m, x=x: f"{what}: d{x}\n{m}")


@pytest.mark.parametrize("name", NAMES)
def test_compiled_mechanism_equals_eager(name):
    """A padded batch (the key-mask path) through each mechanism, against its eager twin."""
    eager, compiled = build(name), torch.compile(build(name), backend="aot_eager")
    inp = inputs(24, [24, 11], 1)
    assert_same(run(eager, *inp), run(compiled, *inp), name)


@pytest.mark.parametrize("name", ["band", "linformer", "realformer"])
def test_compiled_mechanism_follows_mask_and_length_changes(name):
    """One compiled module called with a key mask, with none, with another mask and at
    another length: guards must send each call to a graph of its own (or a dynamic one)
    rather than reuse a stale one."""
    eager, compiled = build(name), torch.compile(build(name), backend="aot_eager")
    for n, lengths, seed in ((24, [24, 11], 1), (24, None, 2), (24, [6, 24], 3), (40, [40, 17], 4)):
        inp = inputs(n, lengths, seed)
        assert_same(run(eager, *inp), run(compiled, *inp), f"{name}, n={n}, lengths {lengths}")


def test_compiled_blocked_sparse_engine_equals_eager():
    """n = 300: the blocked sparse engine (a custom autograd Function with a graph break
    inside) runs from n >= 256."""
    assert use_blocked(300, 300, False, True), "n = 300 no longer takes the blocked engine"
    eager = build("band", max_len=320)
    compiled = torch.compile(build("band", max_len=320), backend="aot_eager")
    inp = inputs(300, [300, 170], 3)
    assert_same(run(eager, *inp), run(compiled, *inp), "band at n=300")


def test_compiled_bert_with_cross_layer_state_equals_eager(bert_factory):
    """A whole tiny BERT compiled, with RealFormer passing scores up the stack through
    ``ctx.state``: hidden states and every parameter gradient match eager."""
    model = bert_factory(num_hidden_layers=2)
    apply_plan(model, "all:all:realformer")
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(16)[None] < torch.tensor([16, 9, 3])[:, None]).long()
    ids = torch.randint(5, 100, (3, 16), generator=g) * mask
    w = torch.randn(3, 16, 32, generator=g)
    outs = []
    for mdl in (model, compiled):
        out = mdl(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * w).sum().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    for (pname, p), p2 in zip(model.named_parameters(), twin.parameters(), strict=True):
        if p.grad is None:  # unused by the loss (the pooler): one compiled graph gives it
            # zeros, as it does for an untouched BERT (AOTAutograd), eager gives None
            assert p2.grad is None or not p2.grad.any(), pname
        else:
            torch.testing.assert_close(p2.grad, p.grad, **TOL, msg=lambda m, s=pname: f"{s}\n{m}")


@pytest.mark.parametrize("spec", ["softmax", "band(window=2)", "mega"])
def test_compiled_bert_traces_into_one_graph(spec, bert_factory):
    """A planned BERT under torch.compile is one graph, eval forward with padding: the
    attention function reads no ContextVar (capture's recorder, eager only) and masked SDPA
    takes no data-dependent branch when compiling (before: a graph break in every
    attention call, and Dynamo's recompile limit hit across the layers)."""
    from torch import _dynamo

    model = bert_factory(num_hidden_layers=2)
    apply_plan(model, f"all:all:{spec}")
    model.eval()
    mask = (torch.arange(16)[None] < torch.tensor([16, 9, 3])[:, None]).long()
    ids = torch.randint(5, 100, (3, 16), generator=torch.Generator().manual_seed(1)) * mask
    with torch.no_grad():
        explained = _dynamo.explain(model)(input_ids=ids, attention_mask=mask)
        assert explained.graph_break_count == 0, explained.break_reasons
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = torch.compile(model, backend="aot_eager")(
            input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("spec", ["linear_elu", "routing(num_clusters=3, window=5)"])
def test_compiled_bert_training_step_equals_eager(spec, bert_factory):
    """A training forward and backward of a whole planned BERT under torch.compile: the loss,
    every parameter gradient and the buffers stepped in training (routing's centroids)
    equal eager's. Before: linear_elu's compiled backward failed on the heads' transposed
    view ("view size is not compatible", elu's backward in torch 2.13), and routing's
    centroid hook, registered inside the compiled forward, dropped the loss from the
    model's output."""
    model = bert_factory("BertForSequenceClassification", num_hidden_layers=2, num_labels=2)
    apply_plan(model, f"all:all:{spec}")
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager")
    mask = (torch.arange(16)[None] < torch.tensor([16, 9, 3])[:, None]).long()
    ids = torch.randint(5, 100, (3, 16), generator=torch.Generator().manual_seed(1)) * mask
    losses = []
    for mdl in (model.train(), compiled.train()):
        loss = mdl(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 1])).loss
        assert loss is not None
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], **TOL)
    for (pname, p), p2 in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None, pname
        torch.testing.assert_close(p2.grad, p.grad, **TOL, msg=lambda m, s=pname: f"{s}\n{m}")
    for (bname, b), b2 in zip(model.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b2, b, **TOL, msg=lambda m, s=bname: f"{s}\n{m}")


def test_capture_of_a_compiled_model_records_on_the_original(bert_factory):
    """capture_attention on torch.compile's wrapper records the original module's maps
    (eagerly): the same maps as on the model itself."""
    from attnlab.hf import capture_attention

    model = bert_factory(num_hidden_layers=2)
    apply_plan(model, "all:all:band(window=2)")
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    want = capture_attention(model, batch)
    got = capture_attention(torch.compile(model, backend="aot_eager"), batch)
    for layer in range(2):
        assert torch.equal(got[layer], want[layer])


def test_jat_link_counts_run_outside_the_graph(monkeypatch):
    """JAT's A_hat (integer link counts, no gradient) runs eagerly under torch.compile, on
    the factored path (``head_adjacency``) and on the weights path (``jump_counts_or_none``):
    their loops step by data-dependent sizes, which Dynamo would unroll (with a symbolic n,
    as after a length change, for minutes at n = 300)."""
    from attnlab.mechanisms import _jat_adjacency, jat

    calls: list[tuple[str, bool]] = []

    def spy(real):
        def wrapped(*args, **kwargs):
            calls.append((real.__name__, torch.compiler.is_compiling()))
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(jat, "jump_counts_or_none", spy(jat.jump_counts_or_none))
    monkeypatch.setattr(_jat_adjacency, "count_compare", spy(_jat_adjacency.count_compare))
    spec = "jat(rho=0.3, adjacency='compare', mask_pads=True)"
    torch.manual_seed(0)
    eager = attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, 64)).eval()
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    q, k, v, _, key_mask = inputs(24, [24, 13], 4)
    for need_weights in (False, True):
        c = attnlab.AttnContext(key_mask=key_mask, need_weights=need_weights)
        want = eager(q, k, v, c).out
        calls.clear()
        got = compiled(q, k, v, c).out
        torch.testing.assert_close(got, want, **TOL)
        expected = {"count_compare"} if need_weights else {"jump_counts_or_none", "count_compare"}
        assert {name for name, _ in calls} >= expected, calls
        assert not any(traced for _, traced in calls), f"traced by Dynamo: {calls}"
