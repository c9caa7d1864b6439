"""One fuzz case of one mechanism, drawn through a ``fuzz_configs.Pick``, and its checks.

``draw_case`` draws the config, shapes, key mask, flags and seed; ``check_case`` runs the
mechanism and asserts the invariants every mechanism owes (finite outputs and gradients,
padded keys invisible to real rows, no causal leak, fully masked rows zero, determinism in
eval, probabilities consistent with the output, bf16 close to fp32) and, for exact
mechanisms, equality with ``core.reference_attention`` over the mechanism's own bias. Half
the cases run with the fast paths' size thresholds at their minimum (``small_paths``), so
the blocked, gathered and chunked engines run at the fuzzed lengths too.

Tolerances: fp32 outputs and gradients against the reference at 1e-5 (atol and rtol),
invariances at 1e-5; bf16 against fp32 on the same (bf16-rounded) inputs at 5e-2.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

import torch
from fuzz_configs import Pick, draw_config

import attnlab
from attnlab.core import mechanism_class
from attnlab.mechanisms import (
    _blocklayout,
    _blocksparse,
    _gathered,
    _rowchunks,
    content_learned,
    heads_span,
    jat,
    pooling,
)

MAXLEN = 70
MASKS = ("none", "all_real", "right", "left", "inner", "one_real")


@dataclass(frozen=True)
class Case:
    name: str
    cfg: dict[str, Any] | None
    b: int
    h: int
    n: int
    d: int
    mask: str
    causal: bool
    need_weights: bool
    train: bool
    layer_idx: int
    seed: int
    small: bool = False  # size thresholds of the fast paths at their minimum (small_paths)

    def spec(self) -> Any:
        if self.cfg is None:
            return mechanism_class(self.name).example
        return {"name": self.name, **self.cfg}


def draw_case(name: str, pick: Pick) -> Case:
    caps = mechanism_class(name).caps
    b, h, n, d = pick.int(1, 3), pick.int(1, 4), pick.choice([1, 2, 3, pick.int(1, MAXLEN)]), \
        pick.choice([4, 8])
    cfg = draw_config(name, pick, n, h, d)
    return Case(
        name=name, cfg=cfg, b=b, h=h, n=n, d=d,
        mask=pick.choice(MASKS) if caps.key_mask_ok else "none",
        causal=caps.causal_ok and pick.choice([False, True]),
        need_weights=pick.choice([False, True]), train=pick.choice([False, True]),
        layer_idx=pick.choice([0, 0, pick.int(0, 3)]), seed=pick.int(0, 2**16),
        small=pick.choice([False, True]))


# Sizes at which the fast paths take over or split their work: implementation choices that
# must not change a result. At these values the blocked engine, the gathered and sparse
# paths and every row chunking run at the fuzzed lengths (else n <= 70 stays dense).
SMALL_PATHS = [
    (_blocksparse, "DENSE_FALLBACK_MAX_LEN", 1), (_blocklayout, "CHUNK_ELEMS", 64),
    (_rowchunks, "CHUNK_ELEMS", 16), (_gathered, "CHUNK_BYTES", 256),
    (content_learned, "SCORE_CHUNK_ELEMS", 16), (jat, "_SPARSE_MIN_N", 1),
    (heads_span, "_SPAN_CHUNK", 4), (pooling, "SLOT_BLOCK", 4),
]


@contextlib.contextmanager
def small_paths(on: bool):
    with contextlib.ExitStack() as stack:
        for mod, attr, value in SMALL_PATHS if on else []:
            stack.enter_context(mock.patch.object(mod, attr, value))
        yield


def key_mask(case: Case, g: torch.Generator) -> torch.Tensor | None:
    """[b, n] bool; row 0 keeps the drawn layout's extreme, the others vary."""
    b, n = case.b, case.n
    if case.mask == "none":
        return None
    mask = torch.ones(b, n, dtype=torch.bool)
    if case.mask == "all_real":
        return mask
    for r in range(b):
        real = 1 if case.mask == "one_real" and r == 0 else int(torch.randint(1, n + 1, (1,),
                                                                             generator=g))
        if case.mask in ("right", "one_real"):
            mask[r, real:] = False
        elif case.mask == "left":
            mask[r, : n - real] = False
        else:  # inner: a random subset, at least one real key
            mask[r] = torch.rand(n, generator=g) < 0.6
            mask[r, int(torch.randint(0, n, (1,), generator=g))] = True
    return mask


def build(case: Case, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(case.seed)
    mech = attnlab.build_mechanism(case.spec(), attnlab.HeadDims(case.h, case.d, MAXLEN))
    return mech.to(dtype).train(case.train)


def ctx(case: Case, mask: torch.Tensor | None, **kw) -> attnlab.AttnContext:
    kw.setdefault("need_weights", case.need_weights)
    kw.setdefault("causal", case.causal)
    return attnlab.AttnContext(key_mask=mask, layer_idx=case.layer_idx, state={}, **kw)


def run(mech, case: Case, q, k, v, mask, **kw):
    torch.manual_seed(case.seed + 1)  # the same draws (dropout, redraws) on every call
    with small_paths(case.small):
        return mech(q, k, v, ctx(case, mask, **kw))


def own_bias(mech, case: Case) -> torch.Tensor:
    params = inspect.signature(mech.bias).parameters
    extra = {"layer_idx": case.layer_idx} if "layer_idx" in params else {}
    return mech.bias(case.n, case.n, **extra)


def close(a, b, what: str, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def inputs(case: Case, mech, dtype: torch.dtype = torch.float32):
    """q, k [b,h,n,dk], v [b,h,n,dv] (dk, dv: ``caps.head_dims`` when set, else d) and
    the key mask."""
    g = torch.Generator().manual_seed(case.seed)
    dk, dv = mech.caps.head_dims or (case.d, case.d)
    shape = (case.b, case.h, case.n)
    q, k = (torch.randn(*shape, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(*shape, dv, generator=g).to(dtype)
    return q, k, v, key_mask(case, g), g


def padding_may_show(case: Case) -> bool:
    """Documented: jat's default ``mask_pads=False`` lets padded keys into the adjacency
    (the official code; docs/decisions.md)."""
    return case.name == "jat" and not (case.cfg or {}).get("mask_pads", False)


def check_case(case: Case) -> None:
    mech = build(case)
    q, k, v, mask, g = inputs(case, mech)
    b, h, n = case.b, case.h, case.n
    caps = mech.caps

    # finite outputs and gradients (q, k, v and parameters)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    res = run(mech, case, qg, kg, vg, mask)
    assert res.out.shape == (b, h, n, v.shape[-1]), res.out.shape
    assert torch.isfinite(res.out).all(), "non-finite output"
    loss = res.out.square().sum() + (res.aux_loss if res.aux_loss is not None else 0.0)
    if loss.requires_grad:
        with small_paths(case.small):  # a recomputing backward sees the forward's sizes
            loss.backward()
    for name, t in (("q", qg), ("k", kg), ("v", vg)):
        assert t.grad is None or torch.isfinite(t.grad).all(), f"non-finite grad of {name}"
    for pname, p in mech.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"non-finite grad of {pname}"
    if res.probs is not None:
        assert res.probs.shape[-2:] == (n, n) and torch.isfinite(res.probs).all()
    if caps.exact:
        check_exact(mech, case, q, k, v, mask)
    mech.eval()
    ev = replace(case, train=False)
    out = run(mech, ev, q, k, v, mask).out
    assert torch.equal(out, run(mech, ev, q, k, v, mask).out), "eval is not deterministic"
    other = run(mech, ev, q, k, v, mask, need_weights=not case.need_weights)
    close(other.out, out, "need_weights changes the output")
    if mask is not None and not padding_may_show(case):
        check_padding(mech, ev, q, k, v, mask, out)
    if case.causal:
        check_no_leak(mech, ev, q, k, v, mask, out, g)
    check_fully_masked(mech, ev, q, k, v)


def check_exact(mech, case: Case, q, k, v, mask) -> None:
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    res = run(mech, case, qg, kg, vg, mask)
    ref, probs = attnlab.reference_attention(qg, kg, vg, bias=own_bias(mech, case),
                                             key_mask=mask, causal=case.causal)
    close(res.out, ref, "output vs reference")
    gout = torch.randn_like(ref)
    with small_paths(case.small):
        grads = torch.autograd.grad(res.out, (qg, kg, vg), gout, allow_unused=True)
    refs = torch.autograd.grad(ref, (qg, kg, vg), gout)
    for nm, a, r in zip("qkv", grads, refs, strict=True):
        close(a if a is not None else torch.zeros_like(r), r, f"grad of {nm} vs reference")
    if res.probs is not None:
        close(res.probs, probs.detach(), "probs vs reference")


def check_padding(mech, case: Case, q, k, v, mask, out) -> None:
    """Padded keys' content (k and v) never reaches a real query's row."""
    pad = ~mask[:, None, :, None]
    g = torch.Generator().manual_seed(case.seed + 2)
    k2 = torch.where(pad, torch.randn(k.shape, generator=g) * 10, k)
    v2 = torch.where(pad, torch.randn(v.shape, generator=g) * 10, v)
    out2 = run(mech, case, q, k2, v2, mask).out
    real = mask[:, None, :, None].expand_as(out)
    close(out2[real], out[real], "padded keys change real rows")


def check_no_leak(mech, case: Case, q, k, v, mask, out, g) -> None:
    t = int(torch.randint(0, case.n, (1,), generator=g))
    fut = (torch.arange(case.n) > t)[None, None, :, None]
    q2, k2, v2 = (torch.where(fut, torch.randn(x.shape, generator=g), x) for x in (q, k, v))
    out2 = run(mech, case, q2, k2, v2, mask).out
    close(out2[:, :, : t + 1], out[:, :, : t + 1], f"causal leak into rows <= {t}")


def check_fully_masked(mech, case: Case, q, k, v) -> None:
    if not mech.caps.key_mask_ok:
        return
    mask = torch.ones(case.b, case.n, dtype=torch.bool)
    mask[-1] = False
    res = run(mech, case, q, k, v, mask, need_weights=True)
    assert torch.isfinite(res.out).all(), "non-finite output with a fully masked row"
    assert (res.out[-1] == 0).all(), "a fully masked row is not zero"
    if res.probs is not None:
        assert (res.probs[-1] == 0).all(), "a fully masked row has probabilities"


# need_weights gives something else than the weights that multiply v (class docstrings)
NOT_WEIGHTS_TIMES_V = {
    "average": "the averaging weights; a FFN and a gate follow",
    "capsule_routing": "the input heads' probabilities; routing mixes them",
    "mca": "an attribution of the compressed slots, not out = P V",
    "mega": "the single-head map; gates and the EMA follow",
}


def weights_times_v_documented(case: Case) -> bool:
    cfg = case.cfg or {}
    if case.name == "poolingformer":  # exact for "mean", an attribution for "max", "conv"
        return cfg.get("pool", "mean") == "mean"
    return case.name not in NOT_WEIGHTS_TIMES_V


def check_weights_times_v(case: Case) -> None:
    """out == probs @ v when the mechanism returns probabilities (eval); gqa/mqa pool v
    over each group of heads first."""
    if not weights_times_v_documented(case):
        return
    ev = replace(case, train=False)
    mech = build(ev)
    q, k, v, mask, _ = inputs(ev, mech)
    res = run(mech, ev, q, k, v, mask, need_weights=True)
    if res.probs is None:
        return
    g = mech.caps.kv_heads
    if g is not None and g < case.h:  # mean of each group's heads, repeated over the group
        v = v.unflatten(1, (g, -1)).mean(2, keepdim=True).expand(
            -1, -1, case.h // g, -1, -1).flatten(1, 2)
    close(res.out, res.probs @ v, "out != probs @ v")


# Outputs that move far under bf16 rounding of the inputs at a few entries: discrete
# choices (top-k keys or queries, clusters, hash buckets, thresholded links), inverses of
# small matrices, sharp learned windows over positions.
BF16_SENSITIVE = frozenset({
    "clustered", "improved_clustered", "jat", "lsh", "probsparse", "routing", "sac",
    "csalr", "nystrom", "adaptive_span", "gaussian_prior",
})


def check_bf16(case: Case) -> None:
    """bf16 runs finite and close to fp32 on the same (bf16-rounded) inputs."""
    ev = replace(case, train=False)
    mech = build(ev)
    q, k, v, mask, _ = inputs(ev, mech, torch.bfloat16)
    half = copy.deepcopy(mech).to(torch.bfloat16)
    out = run(half, ev, q, k, v, mask).out
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all(), "bf16 not finite"
    ref = run(mech, ev, q.float(), k.float(), v.float(), mask).out
    if case.name in BF16_SENSITIVE:  # most entries agree; a few may flip
        err = (out.float() - ref).abs().mean().item()
        assert err <= 2e-2, f"bf16 vs fp32: mean error {err:.3g} > 2e-2"
    else:
        close(out.float(), ref, "bf16 vs fp32", tol=5e-2)
