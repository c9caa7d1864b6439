"""The sparse patterns against their papers' definitions (#21, §3.1).

Every key set here is rebuilt from the paper's text (not from ``core.masks`` or the
mechanisms' helpers): Longformer's window, dilation and symmetric global tokens (Beltagy
et al. 2020), BigBird's ITC layout (Zaheer et al. 2020; random blocks read off the
mechanism, their properties checked), Sparse Transformer's A(1)/A(2) sets (Child et al.
2019: strided A(1) = {max(0, i - l), ..., i}, A(2) = {j : (i - j) mod l = 0}; fixed
A(1) = {j : floor(j / l) = floor(i / l)}, A(2) = {j : j mod l in {l - c, ..., l - 1}}),
Star-Transformer's neighbours and relay (Guo et al. 2019), axial rows and columns (Ho et
al. 2019) and BP-Transformer's token + span-node sets (Ye et al. 2019, as the issue words
them). Outputs and gradients are compared with a dense masked softmax written here, on
every path: the dense one (short inputs), the blocked engine with torch's flash kernels
and with the explicit scores (forced at a short odd length), the strided union and its
key-list fallback, the weights-returning reference, and eager FlexAttention (forward).

Tolerances (atol and rtol): fp32 1e-5, float64 1e-10, outputs and gradients; key sets and
perturbation invariances exact (float64, 0 difference up to 1e-12).
"""

from __future__ import annotations

import math
import warnings
from unittest import mock

import pytest
import torch

import attnlab
from attnlab.mechanisms import _blockflash, _blockpatterns, _gathered
from attnlab.mechanisms import _blocksparse as bs
from attnlab.mechanisms.structured import bp_tree_index

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
N_DENSE = 23  # below the blocked engine's length: the dense (SDPA) path
N_BLOCKED = 77  # run on the blocked engine by lowering its threshold: 64 + a partial block


def build(spec: str, d: int = 8):
    return attnlab.build_mechanism(spec, attnlab.HeadDims(2, d)).eval()


def to_matrix(n: int, keys, causal: bool) -> torch.Tensor:
    """[n, n] bool from keys(i) -> iterable of key positions (out of range ignored)."""
    a = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in keys(i):
            if 0 <= j < n and (j <= i or not causal):
                a[i, j] = True
    return a


def band(w):
    return lambda n, i: range(i - w, i + w + 1)


def dilated(w, r):
    return lambda n, i: [i + t * r for t in range(-w, w + 1)]


def block_local(b):
    return lambda n, i: range(i // b * b, i // b * b + b)


def with_globals(local, glob):
    """Longformer's symmetric global attention: a global token attends every token and
    every token attends it (positions past the sequence ignored)."""
    def keys(n, i):
        g = [t for t in glob if t < n]
        return range(n) if i in g else [*local(n, i), *g]
    return keys


def star(relay):  # satellites: i-1, i, i+1 and the relay; the relay: everything
    return with_globals(band(1), [relay])


def strided(l):
    """Child et al.: A(1) = {max(0, i-l), ..., i}, A(2) = {j: (i - j) mod l = 0}; the
    bidirectional form mirrors A(1) (the causal rule then keeps j <= i)."""
    return lambda n, i: [*range(i - l, i + l + 1), *(j for j in range(n) if (i - j) % l == 0)]


def fixed(l, c):
    return lambda n, i: [j for j in range(n) if j // l == i // l or j % l in range(l - c, l)]


def bigbird_keys(mech, n: int, layer: int):
    """ITC: query block qb sees key blocks |qb - kb| <= w // 2, the global blocks and its
    random blocks; a global query block sees everything."""
    c = mech.cfg
    nb = -(-n // c.block)
    glob = set(range(min(c.global_blocks, nb))) | ({nb - 1} if c.last_global else set())
    rnd = mech.random_blocks(n, n, layer_idx=layer)

    def keys(_n, i):
        qb = i // c.block
        if qb in glob:
            return range(n)
        kbs = {kb for kb in range(nb) if abs(qb - kb) <= c.window_blocks // 2} | glob
        kbs |= {int(x) for x in rnd[qb] if x >= 0}
        return [j for j in range(n) if j // c.block in kbs]
    return keys


def axial(cols):
    return lambda n, i: [j for j in range(n) if j // cols == i // cols or j % cols == i % cols]


# spec -> rule(n, i) (or, for the seeded patterns, a function of the mechanism)
PAPER = {
    "band(window=3)": band(3),
    "band(window=70)": band(70),  # a window wider than the engine's query block
    "dilated(window=2, dilation=3)": dilated(2, 3),
    "block_local(block=5)": block_local(5),
    "block_local(block=100)": block_local(100),
    "global_tokens(tokens=[0, 7, 70, 500])": with_globals(band(0), [0, 7, 70, 500]),
    "longformer(window=4, global_tokens=[0, 3, 40])": with_globals(band(4), [0, 3, 40]),
    "star(relay=4)": star(4),
    "star(relay=0)": star(0),
    "sparse_transformer(mode='strided', stride=5)": strided(5),
    "sparse_transformer(mode='strided', stride=16)": strided(16),
    "sparse_transformer(mode='fixed', stride=8, summary=2)": fixed(8, 2),
    "sparse_transformer(mode='fixed', stride=100, summary=30)": fixed(100, 30),
    "axial(cols=7)": axial(7),
}
SEEDED = ["bigbird(block=4, window_blocks=3, num_random_blocks=1, global_blocks=1, seed=5)",
          "bigbird(block=5, window_blocks=3, num_random_blocks=2, seed=2, last_global=True)",
          "random(num_random=3, seed=3)"]
LAYER = 2
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: one thread is faster


def paper_pattern(spec: str, mech, n: int, causal: bool) -> torch.Tensor:
    """[n, n] bool: the keys of every query by the paper's definition."""
    if spec.startswith("bigbird"):
        rule = bigbird_keys(mech, n, LAYER)
    elif spec.startswith("random"):  # BigBird's random attention: i itself and r draws
        drawn = mech.bias(n, n, layer_idx=LAYER)[0] == 0
        for i in range(n):
            others = set(drawn[i].nonzero().flatten().tolist()) - {i}
            assert drawn[i, i] and len(others) in (mech.cfg.num_random - 1, mech.cfg.num_random)
        return drawn & (torch.ones(n, n, dtype=torch.bool).tril() if causal else True)
    else:
        rule = PAPER[spec]
    return to_matrix(n, lambda i: rule(n, i), causal)


def dense(q, k, v, allowed, key_mask, scale):
    """Dense masked softmax: rows with no allowed key give 0 (the protocol)."""
    s = q @ k.transpose(-1, -2) * scale  # [b,h,n,m]
    ok = allowed[None, None] & key_mask[:, None, None, :]
    live = ok.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~ok, -math.inf).masked_fill(~live, 0.0), -1) * live
    return p @ v


def key_mask(n: int, b: int = 3) -> torch.Tensor:
    """Full; holes anywhere plus left padding; fully masked."""
    g = torch.Generator().manual_seed(n)
    km = torch.rand(b, n, generator=g) > 0.3
    km[0], km[1, : n // 3], km[2] = True, False, False
    return km


def qkv(n: int, dtype, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 2, n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def assert_close_with_grads(out, ref, inputs, tol):
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g),
                    strict=True):
        torch.testing.assert_close(a, r, atol=tol, rtol=tol)


# ------------------------------------------------------------------------- key sets


@pytest.mark.parametrize("spec", [*PAPER, *SEEDED])
@pytest.mark.parametrize("n", [N_DENSE, 37])
@pytest.mark.parametrize("causal", [False, True])
def test_exposed_pattern_is_the_papers(spec, n, causal):
    """``bias(n, n)`` (with j <= i when causal) is the paper's key set, exactly."""
    mech = build(spec)
    allowed = mech.bias(n, n, layer_idx=LAYER)[0] == 0 if not spec.startswith("axial") else (
        mech.bias(n, n)[0] == 0)
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(allowed, paper_pattern(spec, mech, n, causal))


def test_windows_are_one_sided():
    """``window=w`` is w keys on each side (2w + 1 in all), as the docstrings say; the
    dilated window is w keys per side at distances r, 2r, ..., w r."""
    n, i = 40, 20
    for spec, want in [("band(window=3)", range(17, 24)),
                       ("longformer(window=3, global_tokens=[])", range(17, 24)),
                       ("dilated(window=2, dilation=3)", [14, 17, 20, 23, 26])]:
        row = build(spec).bias(n, n)[0, i] == 0
        assert row.nonzero().flatten().tolist() == list(want), spec


@pytest.mark.parametrize("spec,glob", [
    ("global_tokens(tokens=[0, 7])", [0, 7]),
    ("longformer(window=2, global_tokens=[3, 30])", [3, 30]),
    ("star(relay=5)", [5]),
    ("bigbird(block=4, window_blocks=3, num_random_blocks=1, global_blocks=1)", range(4)),
    ("bigbird(block=4, window_blocks=3, num_random_blocks=1, last_global=True)",
     [0, 1, 2, 3, 32, 33]),  # n = 34: the last, partial block is global
])
def test_global_positions_are_rows_and_columns(spec, glob):
    allowed = build(spec).bias(34, 34)[0] == 0
    for t in glob:
        assert allowed[t].all() and allowed[:, t].all(), t


def test_star_relay_and_neighbours_without_wrap():
    """Satellites see i - 1, i, i + 1 and the relay; the relay sees everything. The first
    and last token are not neighbours (no wrap-around, as the authors' code)."""
    allowed = build("star(relay=6)").bias(12, 12)[0] == 0
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 6]
    assert allowed[11].nonzero().flatten().tolist() == [6, 10, 11]
    assert allowed[6].all() and allowed[:, 6].all()


def test_bigbird_random_blocks_are_seeded_distinct_and_outside_window_and_globals():
    spec = "bigbird(block=4, window_blocks=3, num_random_blocks=2, seed=9, last_global=True)"
    n, nb = 45, 12
    rnd = build(spec).random_blocks(n, n, layer_idx=1)
    for qb in range(nb):
        picks = [int(x) for x in rnd[qb] if x >= 0]
        free = [kb for kb in range(nb) if abs(qb - kb) > 1 and kb not in (0, nb - 1)]
        assert len(set(picks)) == len(picks) == min(2, len(free)) and set(picks) <= set(free)
    assert torch.equal(rnd, build(spec).random_blocks(n, n, layer_idx=1))  # a fresh instance
    for other in (build(spec.replace("seed=9", "seed=8")).random_blocks(n, n, layer_idx=1),
                  build(spec).random_blocks(n, n, layer_idx=2)):
        assert not torch.equal(rnd, other)


# -------------------------------------------------- every path vs the dense reference


@pytest.fixture(params=["flash", "explicit"])
def engine(request, monkeypatch):
    monkeypatch.setattr(_blockflash, "ENABLED", request.param == "flash")
    return request.param


@pytest.mark.parametrize("spec", [*PAPER, *SEEDED])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_paths_equal_dense_reference(spec, causal, dtype, engine, monkeypatch):
    """The blocked engine (or the strided union, or key lists) at an odd length over more
    than one query block, then the dense path and the weights path at a short one: all
    equal the dense masked softmax of the paper's key set, outputs and gradients, with
    holes, left padding and a fully masked sequence (which gives zeros)."""
    monkeypatch.setattr(bs, "DENSE_FALLBACK_MAX_LEN", N_BLOCKED)
    mech, tol = build(spec), TOL[dtype]
    for n in (N_BLOCKED, N_DENSE):
        q, k, v = qkv(n, dtype, seed=n)
        km = key_mask(n)
        ctx = attnlab.AttnContext(key_mask=km, causal=causal, layer_idx=LAYER)
        spies = [mock.patch.object(mod, name, wraps=getattr(mod, name)) for mod, name in (
            (bs, "blocked_attention"), (_blockpatterns, "union_attention"),
            (_gathered, "gathered_attention"))]
        with spies[0] as blocked, spies[1] as union, spies[2] as gathered:
            out = mech(q, k, v, ctx).out
        fast = blocked.called or union.called or gathered.called
        assert fast == (n == N_BLOCKED and not spec.startswith("axial")), spec
        ref = dense(q, k, v, paper_pattern(spec, mech, n, causal), km, 8**-0.5)
        assert_close_with_grads(out, ref, (q, k, v), tol)
        assert (out[2] == 0).all()
        if n == N_DENSE:
            res = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal,
                                                    layer_idx=LAYER, need_weights=True))
            torch.testing.assert_close(res.out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("spec", ["dilated(window=2, dilation=3)", "block_local(block=5)",
                                  "star(relay=4)", "global_tokens(tokens=[0, 7, 70, 500])",
                                  "sparse_transformer(mode='strided', stride=5)",
                                  "sparse_transformer(mode='fixed', stride=8, summary=2)"])
@pytest.mark.parametrize("causal", [False, True])
def test_flex_masks_equal_the_papers(spec, causal):
    """The FlexAttention backend's masks (eager, forward only on CPU) at an odd length."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from attnlab.mechanisms import _flex

    n, mech = 37, build(spec, d=16)
    q, k, v = (t.detach() for t in qkv(n, torch.float32, d=16))
    km = key_mask(n)
    with warnings.catch_warnings():  # eager FlexAttention warns that it is slow
        warnings.simplefilter("ignore")
        out = _flex.flex_pattern_attention(
            q, k, v, lambda: mech.bias(n, n)[0] == 0, (mech.cfg, 0), key_mask=km,
            causal=causal, scale=0.25, compiled=False)
    ref = dense(q, k, v, paper_pattern(spec, mech, n, causal), km, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


ALL = [*PAPER, *SEEDED, "axial(cols=7, mode='two_pass')", "bp_tree(window=2, k=1)"]


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("n", [N_DENSE, N_BLOCKED])
def test_no_future_key_no_padded_key(spec, n, monkeypatch, engine):
    """Causal: changing q, k, v after position t leaves outputs up to t unchanged. Padding:
    changing padded keys and values changes no output (any row, causal or not)."""
    monkeypatch.setattr(bs, "DENSE_FALLBACK_MAX_LEN", N_BLOCKED)
    mech = build(spec)
    q, k, v = (x.detach() for x in qkv(n, torch.float64))
    km = key_mask(n)
    t = n // 2
    later = torch.arange(n)[None, None, :, None] > t
    q2, k2, v2 = (torch.where(later, x + 3 * torch.randn_like(x), x) for x in (q, k, v))
    ctx = attnlab.AttnContext(key_mask=km, causal=True, layer_idx=LAYER)
    a, b = mech(q, k, v, ctx).out, mech(q2, k2, v2, ctx).out
    torch.testing.assert_close(a[:, :, : t + 1], b[:, :, : t + 1], atol=1e-12, rtol=0)
    pad = ~km[:, None, :, None]
    k3, v3 = torch.where(pad, k + 5 * torch.randn_like(k), k), torch.where(pad, v + 100, v)
    for causal in (False, True):
        ctx = attnlab.AttnContext(key_mask=km, causal=causal, layer_idx=LAYER)
        a, b = mech(q, k, v, ctx).out, mech(q, k3, v3, ctx).out
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        assert (a[2] == 0).all()


# -------------------------------------------------------------------------------- axial


def axial_two_pass_loops(q, k, v, cols, km, causal, scale):
    """Ho et al.'s row pass then column pass, one query at a time."""
    n = q.shape[2]

    def attend(i, js, vals):
        js = [j for j in js if j <= i or not causal]
        s = torch.stack([(q[:, :, i] * k[:, :, j]).sum(-1) for j in js], -1) * scale
        ok = torch.stack([km[:, j] for j in js], -1)[:, None]  # [b,1,J]
        live = ok.any(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(~ok, -math.inf).masked_fill(~live, 0.0), -1) * live
        return sum(p[..., x, None] * vals[:, :, j] for x, j in enumerate(js))

    y = torch.stack([attend(i, [j for j in range(n) if j // cols == i // cols], v)
                     for i in range(n)], 2)
    return torch.stack([attend(i, [j for j in range(n) if j % cols == i % cols], y)
                        for i in range(n)], 2)


@pytest.mark.parametrize("cols", [1, 4, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_axial_two_pass_equals_row_then_column(cols, causal, dtype):
    n = 26  # not a multiple of 4 or 7: a ragged last row
    mech = build(f"axial(cols={cols}, mode='two_pass')")
    q, k, v = qkv(n, dtype, seed=cols)
    km = key_mask(n)
    out = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal)).out
    ref = axial_two_pass_loops(q, k, v, cols, km, causal, 8**-0.5)
    assert_close_with_grads(out, ref, (q, k, v), TOL[dtype])


# ------------------------------------------------------------------------------ bp_tree


def bp_tree_sets(n: int, w: int, k: int, causal: bool, i: int):
    """Query i's tokens and spans (level, start, stop), as the issue words them: tokens
    |i - j| <= w plus one token where a frontier is odd; then at each level l = 1..L-1
    (2^L >= n) k nodes of 2^l tokens adjacent to what is covered, on each side (the left
    only when causal), plus one where the frontier is not on a 2^(l+1) boundary."""
    toks = list(range(i - w, i + (0 if causal else w) + 1))
    lo, hi = i - w, i + (0 if causal else w) + 1  # covered: [lo, hi)
    if lo % 2:
        toks, lo = [*toks, lo - 1], lo - 1
    if not causal and hi % 2:
        toks, hi = [*toks, hi], hi + 1
    spans = []
    for level in range(1, max(0, math.ceil(math.log2(max(n, 1))) - 1) + 1):
        s = 2**level
        for _ in range(k + bool((lo - k * s) % (2 * s))):
            lo -= s
            spans.append((level, lo, lo + s))
        for _ in range(0 if causal else k + bool((hi + k * s) % (2 * s))):
            spans.append((level, hi, hi + s))
            hi += s
    return ([j for j in toks if 0 <= j < n],
            [(lv, a, min(b, n)) for lv, a, b in spans if b > 0 and a < n])


@pytest.mark.parametrize("w,k", [(0, 1), (1, 1), (2, 2), (3, 1), (1, 3)])
def test_bp_tree_key_sets_are_the_construction(w, k):
    for n in [*range(1, 41), 63, 64, 65, 100]:
        for causal in (False, True):
            tok, span, offsets = bp_tree_index(n, w, k, causal)
            for i in range(n):
                got = []
                for node in (int(x) for x in span[i] if x >= 0):
                    lv = int(torch.searchsorted(offsets, node, right=True))
                    a = node - int(offsets[lv - 1])
                    got.append((lv, a * 2**lv, min((a + 1) * 2**lv, n)))
                toks, spans = bp_tree_sets(n, w, k, causal, i)
                assert sorted(int(t) for t in tok[i] if t >= 0) == sorted(toks), (n, i)
                assert sorted(got) == sorted(spans), (n, causal, i)
                covered = sorted([*toks, *(j for _, a, b in spans for j in range(a, b))])
                assert covered == list(range(i + 1 if causal else n))  # a disjoint cover


def bp_tree_loops(q, k, v, w, kk, causal, km, scale):
    """Softmax over query i's tokens and span nodes, a span's key and value the mean of
    its unpadded tokens (a span of padding only is masked), one query at a time."""
    n, rows = q.shape[2], []
    for i in range(n):
        toks, spans = bp_tree_sets(n, w, kk, causal, i)
        keys, vals, ok = [k[:, :, j] for j in toks], [v[:, :, j] for j in toks], [
            km[:, j] for j in toks]
        for _, a, b in spans:
            mem = km[:, None, a:b, None].to(q.dtype)  # [b,1,span,1]
            cnt = mem.sum(2).clamp(min=1)
            keys.append((k[:, :, a:b] * mem).sum(2) / cnt)
            vals.append((v[:, :, a:b] * mem).sum(2) / cnt)
            ok.append(km[:, a:b].any(-1))
        kx, vx, okx = torch.stack(keys, 2), torch.stack(vals, 2), torch.stack(ok, 1)[:, None]
        s = (q[:, :, i, None] * kx).sum(-1) * scale  # [b,h,T]
        live = okx.any(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(~okx, -math.inf).masked_fill(~live, 0.0), -1) * live
        rows.append((p[..., None] * vx).sum(2))
    return torch.stack(rows, 2)


@pytest.mark.parametrize("spec", ["bp_tree(window=0, k=1)", "bp_tree(window=2, k=2)"])
@pytest.mark.parametrize("n", [9, 37])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bp_tree_equals_mean_pooled_span_softmax(spec, n, causal, dtype):
    mech = build(spec)
    q, k, v = qkv(n, dtype, seed=n)
    km = key_mask(n)
    out = mech(q, k, v, attnlab.AttnContext(key_mask=km, causal=causal)).out
    ref = bp_tree_loops(q, k, v, mech.cfg.window, mech.cfg.k, causal, km, 8**-0.5)
    assert_close_with_grads(out, ref, (q, k, v), TOL[dtype])
