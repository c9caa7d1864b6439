"""bfloat16: every registered mechanism against its own float32 computation.

The situations users meet on GPUs, checked here on the CPU:

* ``autocast``: training under ``torch.autocast(dtype=torch.bfloat16)`` hands a mechanism
  bf16 q, k, v while its parameters stay float32;
* ``inputs``: bf16 q, k, v reach a float32 module called on its own (no autocast);
* ``module``: the whole mechanism in bf16 (``.to(torch.bfloat16)``).

Each must return bf16, finite outputs and finite q, k, v gradients, close to the float32
computation of the same module on the same values: the module's parameters and float
buffers are rounded to bf16 once first (``.to(bf16).float()``), so all sides hold the same
numbers, and the float32 reference gets the bf16-rounded inputs upcast. Eval mode (the
random mechanisms are deterministic there), batch 2 with a padded row (a key mask),
2 heads of d = 16, n = 96 and n = 300 (the blocked sparse engines and the JAT sparse path
start at 256 positions), and n = 96 causal where the mechanism allows it (the prefix-sum
paths of causal linear attention).

Tolerance, with u = 2^-8 (bf16's unit roundoff, 8 significand bits): max|out - ref| <=
C u max|ref|, and for each of q, k, v max|grad - grad_ref| <= C u max|grad_ref|, C = 8.
Why 8: a bf16 forward rounds about three stored intermediates in a chain (scores,
probabilities or features, output), each to within u; a score s off by u|s| moves exp(s)
by a factor of about 1 + u|s|, and |s| reaches about 4 here (unit-variance inputs, scale
1/sqrt(d)), so up to ~4u from the softmax and ~1u for each other rounding. The backward
runs the same chain in reverse, so the same bound. Measured (in u): at most 5.1 for a
gradient and 3.0 for an output across the mechanisms and cases here (bp_tree at n = 300;
then synthesizer's gradients under autocast, 4.6), most softmax-based mechanisms 0.4-2.

Mechanisms that equal softmax over a pattern (``caps.exact``) are also held to the dense
oracle: their bf16 error (output and each gradient) at most that of ``reference_attention``
run in bf16 over the same bias plus 1u, one rounding of their own, so a fast path may not
round much more than the dense computation it replaces (measured at most 0.9 of that
bound, axial's q gradient at n = 300: 2.76u against the oracle's 2.08u).

Also: one training step (attention dropout 0.1) under autocast, and a tiny Hugging Face
BERT with every mechanism on all heads trained one step under CPU autocast.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from conftest import make_tiny_bert

import attnlab
from attnlab.core import mechanism_class
from attnlab.hf import apply_plan

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = attnlab.list_mechanisms()
BF16 = torch.bfloat16
U = 2.0**-8  # bf16 unit roundoff
C = 8  # roundings allowed, relative to the largest reference value (module docstring)
EXACT_EXTRA = 1.0  # exact mechanisms: bf16 error <= the dense bf16 oracle's + 1u
B, H, D, MAXLEN = 2, 2, 16, 512
MODES = ("autocast", "inputs", "module")
CASES = ([(nm, n, False) for nm in NAMES for n in (96, 300)]
         + [(nm, 96, True) for nm in NAMES if mechanism_class(nm).caps.causal_ok])


def _case_id(case) -> str:
    name, n, causal = case
    return f"{name}-n{n}" + ("-causal" if causal else "")


def _build(name: str) -> torch.nn.Module:
    """The example mechanism with its parameters and float buffers rounded to bf16."""
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(mechanism_class(name).example,
                                   attnlab.HeadDims(H, D, MAXLEN))
    return mech.eval().to(BF16).float()


def _inputs(n: int):
    """bf16 q, k, v [B,H,n,D], an upstream gradient, and a key mask (row 1 padded)."""
    g = torch.Generator().manual_seed(n)
    q, k, v, go = (torch.randn(B, H, n, D, generator=g).to(BF16) for _ in range(4))
    key_mask = torch.arange(n)[None, :] < torch.tensor([n, n - n // 4])[:, None]
    return q, k, v, go, key_mask


def _run(mech, q, k, v, go, ctx, dtype, amp: bool = False):
    """(out, [grad q, grad k, grad v]) with the inputs in ``dtype``; under CPU autocast
    when ``amp`` (the backward outside it, as training loops do)."""
    xs = [t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=BF16, enabled=amp):
        out = mech(*xs, ctx).out
    out.backward(go.to(out.dtype))
    return out.detach(), [x.grad for x in xs]


def _ctx(key_mask, causal: bool):
    return attnlab.AttnContext(key_mask=key_mask, causal=causal, state={})


@functools.cache
def _reference(name: str, n: int, causal: bool):
    """The float32 computation of the rounded module on the bf16-rounded inputs."""
    q, k, v, go, key_mask = _inputs(n)
    return _run(_build(name), q, k, v, go, _ctx(key_mask, causal), torch.float32)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x - ref| / max|ref|, in units of u."""
    return ((x.float() - ref).abs().max() / ref.abs().max()).item() / U


def _bf16_run(name: str, n: int, causal: bool, mode: str):
    mech = _build(name)
    if mode == "module":
        mech = copy.deepcopy(mech).to(BF16)
    q, k, v, go, key_mask = _inputs(n)
    return _run(mech, q, k, v, go, _ctx(key_mask, causal), BF16, amp=mode == "autocast")


def _errors(name: str, n: int, causal: bool, mode: str):
    """(out, grads, output error in u, {tensor: gradient error in u}); asserts dtypes,
    finiteness and that the same inputs get gradients as in float32."""
    out, grads = _bf16_run(name, n, causal, mode)
    ref, ref_grads = _reference(name, n, causal)
    assert out.dtype == BF16, f"{name} ({mode}) returned {out.dtype} for bf16 inputs"
    assert torch.isfinite(out).all(), f"{name} ({mode}): non-finite output"
    grad_err = {}
    for label, gr, gref in zip("qkv", grads, ref_grads, strict=True):
        assert (gr is None) == (gref is None), f"{name} ({mode}): grad of {label} differs"
        if gr is None:
            continue
        assert gr.dtype == BF16 and torch.isfinite(gr).all(), (
            f"{name} ({mode}): grad of {label} is {gr.dtype} or not finite")
        if gref.abs().max() > 0:
            grad_err[label] = _rel(gr, gref)
    return _rel(out, ref), grad_err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bf16_close_to_float32(case, mode):
    name, n, causal = case
    out_err, grad_err = _errors(name, n, causal, mode)
    assert out_err <= C, f"{name} ({mode}): output {out_err:.2f}u from float32 (> {C}u)"
    for label, err in grad_err.items():
        assert err <= C, f"{name} ({mode}): grad of {label} {err:.2f}u from float32 (> {C}u)"


EXACT_CASES = [c for c in CASES if mechanism_class(c[0]).caps.exact]


@functools.cache
def _oracle_errors(name: str, n: int, causal: bool):
    """The dense oracle's bf16 error (output, per-tensor gradients) over the mechanism's
    own bias, in u, against the oracle in float32."""
    bias = _build(name).bias(n, n).detach()
    q, k, v, go, key_mask = _inputs(n)

    def oracle(dtype):
        xs = [t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = attnlab.reference_attention(*xs, bias=bias.to(dtype), key_mask=key_mask,
                                             causal=causal)
        out.backward(go.to(dtype))
        return out.detach(), [x.grad for x in xs]

    (lo, lo_g), (hi, hi_g) = oracle(BF16), oracle(torch.float32)
    return _rel(lo, hi), {lab: _rel(a, b) for lab, a, b in zip("qkv", lo_g, hi_g, strict=True)}


@pytest.mark.parametrize("case", EXACT_CASES, ids=_case_id)
def test_exact_mechanisms_round_no_more_than_the_dense_oracle(case):
    name, n, causal = case
    out_err, grad_err = _errors(name, n, causal, "module")
    ref_out, ref_grads = _oracle_errors(name, n, causal)
    assert out_err <= ref_out + EXACT_EXTRA, (
        f"{name}: output {out_err:.2f}u from float32, the dense bf16 oracle {ref_out:.2f}u")
    for label, err in grad_err.items():
        assert err <= ref_grads[label] + EXACT_EXTRA, (
            f"{name}: grad of {label} {err:.2f}u, the dense bf16 oracle "
            f"{ref_grads[label]:.2f}u")


@pytest.mark.parametrize("name", NAMES)
def test_training_step_under_autocast(name):
    """Train mode with attention dropout (the engines' dropout paths) at n = 300."""
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(mechanism_class(name).example,
                                   attnlab.HeadDims(H, D, MAXLEN)).train()
    q, k, v, go, key_mask = _inputs(300)
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ctx = attnlab.AttnContext(key_mask=key_mask, dropout=0.1, state={})
    with torch.autocast("cpu", dtype=BF16):
        res = mech(*xs, ctx)
    loss = (res.out.float() * go.float()).sum()
    if res.aux_loss is not None:
        loss = loss + res.aux_loss.float()
    loss.backward()
    assert res.out.dtype == BF16 and torch.isfinite(res.out).all()
    for x in xs:
        assert x.grad is None or torch.isfinite(x.grad).all()
    for p in mech.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_tiny_bert_trains_under_cpu_autocast(name):
    """Every head of a tiny BERT on ``name``: a forward and backward under CPU autocast."""
    model = make_tiny_bert("BertForSequenceClassification", num_labels=2).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # plan notes (e.g. position-bound mechanisms)
        apply_plan(model, f"all:all:{mechanism_class(name).example}", max_len=16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (2, 12), generator=g)
    mask = (torch.arange(12)[None, :] < torch.tensor([12, 7])[:, None]).long()
    with torch.autocast("cpu", dtype=BF16):
        loss = model(input_ids=ids * mask, attention_mask=mask, labels=torch.tensor([0, 1])).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("mode", ["module", "autocast"])
@pytest.mark.parametrize("name", NAMES)
def test_fp16_outputs_and_gradients_are_finite(name, mode):
    """float16 (GPUs without bf16): its largest value is 65504 and its smallest 2^-24
    (eps 2^-10), so a small epsilon added in fp16 is 0 and sums of squares overflow. The
    whole module in fp16, or an fp32 module under fp16 autocast; inputs of standard
    deviation 4 (scores of std 16), a row whose last quarter is padding (so adaptive_span's
    last queries see no key in their span, and capsule_routing routes zero capsules): fp16
    outputs, finite outputs and q, k, v gradients. (Before: adaptive_span's renormalisation
    gave 0/0 = NaN rows, capsule_routing's squash infinite gradients at a zero capsule, and
    under autocast capsule_routing and performer infinite gradients.)"""
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(mechanism_class(name).example,
                                   attnlab.HeadDims(H, D, MAXLEN)).eval()
    if mode == "module":
        mech = mech.half()
    q, k, v, go, key_mask = _inputs(96)
    xs = [(4 * t).to(torch.float16).requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.float16, enabled=mode == "autocast"):
        out = mech(*xs, _ctx(key_mask, False)).out
    out.backward(go.to(out.dtype))
    grads = [x.grad for x in xs]
    assert out.dtype == torch.float16 and torch.isfinite(out).all(), name
    for label, gr in zip("qkv", grads, strict=True):
        assert gr is None or torch.isfinite(gr).all(), f"{name}: grad of {label} not finite"
