"""Structured family: axial (grid) and bp_tree (binary-partition tree).

Tolerances: fp32 outputs, probabilities and gradients at 1e-5 (atol and rtol) against the
naive references (``core.reference_attention`` over ``bias`` for axial "union",
``axial_two_pass_reference`` and ``bp_tree_reference``); patterns and key sets exact.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from plan_step import train_one_step

import attnlab
from attnlab.core import RegistryError, resolve_config
from attnlab.mechanisms.structured import (
    axial_two_pass_reference,
    bp_tree_index,
    bp_tree_levels,
    bp_tree_reference,
)

B, H, D = 2, 2, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}


def build(spec: str):
    return attnlab.build_mechanism(spec, attnlab.HeadDims(H, D)).eval()


def rand(n: int, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(B, H, n, D, generator=g) for _ in range(3)]
    return [t.requires_grad_() for t in ts] if grad else ts


def lengths_mask(n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor([n, max(1, n - 6)])[:, None]


def ctx(**kw):
    return attnlab.AttnContext(state={}, **kw)


def assert_same_with_grads(out, ref, inputs):
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g),
                    strict=True):
        torch.testing.assert_close(a, r, **TOL)


# ------------------------------------------------------------------------------------ axial


@pytest.mark.parametrize("cols", [1, 3, 4, 5])
@pytest.mark.parametrize("n,m", [(12, 12), (13, 13), (7, 11)])
def test_axial_bias_equals_rule(cols, n, m):
    bias = build(f"axial(cols={cols})").bias(n, m)
    want = torch.full((1, n, m), float("-inf"))
    for i, j in itertools.product(range(n), range(m)):
        if i // cols == j // cols or i % cols == j % cols:
            want[0, i, j] = 0.0
    torch.testing.assert_close(bias, want, atol=0, rtol=0)


@pytest.mark.parametrize("cols", [1, 3, 4, 16])
@pytest.mark.parametrize("n", [1, 12, 14])
@pytest.mark.parametrize("causal", [False, True])
def test_axial_union_grid_path_equals_reference(cols, n, causal):
    mech = build(f"axial(cols={cols}, mode='union')")
    q, k, v = rand(n, seed=n, grad=True)
    km = lengths_mask(n)
    out = mech(q, k, v, ctx(key_mask=km, causal=causal)).out
    ref, _ = attnlab.reference_attention(q, k, v, bias=mech.bias(n, n), key_mask=km,
                                         causal=causal)
    assert_same_with_grads(out, ref, (q, k, v))


@pytest.mark.parametrize("cols", [1, 3, 4, 16])
@pytest.mark.parametrize("n", [1, 12, 14])
@pytest.mark.parametrize("causal", [False, True])
def test_axial_two_pass_equals_naive_reference(cols, n, causal):
    mech = build(f"axial(cols={cols}, mode='two_pass')")
    q, k, v = rand(n, seed=n, grad=True)
    km = lengths_mask(n)
    out = mech(q, k, v, ctx(key_mask=km, causal=causal)).out
    ref, probs = axial_two_pass_reference(q, k, v, cols, key_mask=km, causal=causal)
    assert_same_with_grads(out, ref, (q, k, v))
    res = mech(q, k, v, ctx(key_mask=km, causal=causal, need_weights=True))
    torch.testing.assert_close(res.probs, probs, **TOL)
    torch.testing.assert_close(res.probs @ v, ref, **TOL)


def test_axial_two_pass_is_row_then_column():
    """Literal loops: y_i over the row, then out_i over the column on y."""
    cols, n = 3, 7
    q, k, v = rand(n)
    out = build(f"axial(cols={cols}, mode='two_pass')")(q, k, v, ctx()).out

    def attend(i, js, vals):
        s = torch.stack([(q[:, :, i] * k[:, :, j]).sum(-1) for j in js], -1) * D**-0.5
        p = s.softmax(-1)
        return sum(p[..., t, None] * vals[:, :, j] for t, j in enumerate(js))

    y = torch.stack([attend(i, [j for j in range(n) if j // cols == i // cols], v)
                     for i in range(n)], 2)
    want = torch.stack([attend(i, [j for j in range(n) if j % cols == i % cols], y)
                        for i in range(n)], 2)
    torch.testing.assert_close(out, want, **TOL)


def test_axial_two_pass_reaches_every_token_in_two_hops():
    mech = build("axial(cols=4, mode='two_pass')")
    q, k, v = rand(12)  # a full 3 x 4 grid (a ragged last row is reached from its columns)
    probs = mech(q, k, v, ctx(need_weights=True)).probs
    assert (probs > 0).all()
    assert not mech.caps.exact and type(mech).caps.exact  # instance caps refine the class


def test_axial_strict_names_the_fix():
    mech = build("axial(cols=4, strict=True)")
    q, k, v = rand(10)
    with pytest.raises(ValueError, match="not a multiple of cols=4.*strict=False"):
        mech(q, k, v, ctx())
    q, k, v = rand(12)
    assert mech(q, k, v, ctx()).out.shape == (B, H, 12, D)


def test_axial_bad_specs():
    with pytest.raises((ValueError, RegistryError), match="cols must be >= 1"):
        resolve_config("axial(cols=0)")
    with pytest.raises((ValueError, RegistryError)):
        resolve_config("axial(mode='diagonal')")


# ---------------------------------------------------------------------------------- bp_tree


def key_set(n, window, k, causal, i):
    """Token positions and (level, start, stop) spans of query i, from bp_tree_index."""
    tok, span, offsets = bp_tree_index(n, window, k, causal)
    toks = sorted(int(t) for t in tok[i] if t >= 0)
    spans = []
    for node in (int(s) for s in span[i] if s >= 0):
        lvl = int(torch.searchsorted(offsets, node, right=True))
        a = node - int(offsets[lvl - 1])
        spans.append((lvl, a * 2**lvl, min((a + 1) * 2**lvl, n)))
    return toks, spans


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 19, 33, 64])
@pytest.mark.parametrize("window,k", [(0, 1), (1, 1), (2, 2), (3, 1)])
def test_bp_tree_key_sets_partition_the_sequence(n, window, k):
    """Tokens and spans of each query are disjoint and cover [0, n) (left side only, up to
    and including i, when causal); per level at most k + 1 spans per side."""
    for causal in (False, True):
        for i in range(n):
            toks, spans = key_set(n, window, k, causal, i)
            assert all(abs(i - j) <= window + 1 for j in toks)
            covered = list(toks)
            for lvl, lo, hi in spans:
                assert lo % 2**lvl == 0 and (hi <= i - window or lo > i + window)
                covered += range(lo, hi)
            want = list(range(i + 1)) if causal else list(range(n))
            assert sorted(covered) == want, (n, i, causal, toks, spans)
            for lvl in range(1, bp_tree_levels(n) + 1):
                side = [s for s in spans if s[0] == lvl]
                assert len([s for s in side if s[1] > i]) <= k + 1
                assert len([s for s in side if s[1] < i]) <= k + 1


def test_bp_tree_keys_grow_as_log_n():
    for n in (64, 256, 1024):
        tok, span, _ = bp_tree_index(n, 2, 2, False)
        assert tok.shape[1] == 2 * 2 + 3
        assert span.shape[1] == 2 * (2 + 1) * (bp_tree_levels(n))
        assert bp_tree_levels(n) == round(torch.log2(torch.tensor(float(n))).item()) - 1


@pytest.mark.parametrize("n", [1, 5, 16, 19, 40])
@pytest.mark.parametrize("spec", ["bp_tree(window=0, k=1)", "bp_tree(window=1, k=2)",
                                  "bp_tree(window=3, k=1)"])
@pytest.mark.parametrize("causal", [False, True])
def test_bp_tree_fast_path_equals_reference(n, spec, causal):
    mech = build(spec)
    c = mech.cfg
    q, k, v = rand(n, seed=n, grad=True)
    km = lengths_mask(n)
    out = mech(q, k, v, ctx(key_mask=km, causal=causal)).out
    ref, probs = bp_tree_reference(q, k, v, c.window, c.k, key_mask=km, causal=causal)
    assert_same_with_grads(out, ref, (q, k, v))
    res = mech(q.detach(), k.detach(), v.detach(), ctx(key_mask=km, causal=causal,
                                                       need_weights=True))
    torch.testing.assert_close(res.probs, probs.detach(), **TOL)
    torch.testing.assert_close(res.probs @ v.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(res.probs.sum(-1)[:, :, : int(km[1].sum())],
                               torch.ones(B, H, int(km[1].sum())), **TOL)


def test_bp_tree_span_means_skip_padding():
    """A span holding padded tokens averages only its kept ones; fully padded -> masked."""
    n = 16
    q, k, v = rand(n)
    km = torch.arange(n)[None, :] < torch.tensor([16, 5])[:, None]
    probs = build("bp_tree(window=0, k=1)")(q, k, v, ctx(key_mask=km, need_weights=True)).probs
    assert (probs[1, :, :, 5:] == 0).all()  # padded tokens get no weight, via spans neither
    assert (probs[0, :, :, :] > 0).all()  # every token reached (the key sets cover the input)


def test_bp_tree_needs_equal_lengths_and_good_specs():
    mech = build("bp_tree")
    q = torch.randn(1, H, 5, D)
    k = torch.randn(1, H, 6, D)
    with pytest.raises(ValueError, match="n == m"):
        mech(q, k, k, ctx())
    with pytest.raises((ValueError, RegistryError), match="window must be >= 0"):
        resolve_config("bp_tree(window=-1)")
    with pytest.raises((ValueError, RegistryError), match="k must be >= 1"):
        resolve_config("bp_tree(k=0)")


# ---------------------------------------------------------------------------- in a plan


@pytest.mark.parametrize("spec", ["axial(cols=4)", "axial(cols=3, mode='two_pass')",
                                  "bp_tree(window=1, k=1)"])
def test_plan_forward_and_training_step(bert_factory, padded_batch, spec):
    model = bert_factory()
    _, _, out2 = train_one_step(model, [{"layers": "all", "heads": [0, 2], "mechanism": spec}],
                                padded_batch, lr=1e-2)
    # padding invariance: the real tokens of the shorter rows ignore what the pads hold
    ids = padded_batch["input_ids"].clone()
    ids[padded_batch["attention_mask"] == 0] = 7
    with torch.no_grad():
        out3 = model(input_ids=ids,
                     attention_mask=padded_batch["attention_mask"]).last_hidden_state
    real = padded_batch["attention_mask"].bool()
    torch.testing.assert_close(out3[real], out2[real], **TOL)

