"""Sparse-pattern family: patterns vs the rule text, the blocked engine vs the reference.

Tolerances: fp32 outputs and gradients at 1e-5 (atol and rtol) against
``core.reference_attention``; float64 gradchecks of the hand-written backward at the
``torch.autograd.gradcheck`` defaults (eps 1e-6, atol 1e-5, rtol 1e-3, fast mode); patterns
exact.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch

import attnlab
from attnlab.core import RegistryError, resolve_config
from attnlab.mechanisms import _blocklayout
from attnlab.mechanisms import _blocksparse as bs

NEG_INF = float("-inf")


def build(spec: str, heads: int = 2, head_dim: int = 8):
    return attnlab.build_mechanism(spec, attnlab.HeadDims(heads, head_dim)).eval()


def brute(n: int, m: int, rule) -> torch.Tensor:
    """[1, n, m] bias from a literal double loop over (i, j)."""
    out = torch.full((1, n, m), NEG_INF)
    for i, j in itertools.product(range(n), range(m)):
        if rule(i, j):
            out[0, i, j] = 0.0
    return out


# ----------------------------------------------------------------- patterns vs the rule text

RULES = [
    *[(f"band(window={w})", lambda i, j, w=w: abs(i - j) <= w) for w in (0, 1, 3)],
    *[
        (f"dilated(window={w}, dilation={r})",
         lambda i, j, w=w, r=r: abs(i - j) <= w * r and (i - j) % r == 0)
        for w, r in ((1, 1), (2, 2), (1, 3), (3, 2))
    ],
    *[(f"block_local(block={b})", lambda i, j, b=b: i // b == j // b) for b in (1, 4, 5)],
    *[
        (f"global_tokens(tokens={list(t)})",
         lambda i, j, t=t: i in t or j in t or i == j)
        for t in ((0,), (0, 5), (3, 20))
    ],
    *[
        (f"longformer(window={w}, global_tokens={list(t)})",
         lambda i, j, w=w, t=t: abs(i - j) <= w or i in t or j in t)
        for w, t in ((1, (0,)), (2, (0, 3)))
    ],
    *[
        (f"star(relay={r})", lambda i, j, r=r: abs(i - j) <= 1 or i == r or j == r)
        for r in (0, 4)
    ],
    *[
        (f"sparse_transformer(mode='strided', stride={s})",
         lambda i, j, s=s: abs(i - j) < s or (i - j) % s == 0)
        for s in (3, 4)
    ],
    *[
        (f"sparse_transformer(mode='fixed', stride={s}, summary={c})",
         lambda i, j, s=s, c=c: i // s == j // s or j % s >= s - c)
        for s, c in ((4, 1), (4, 2), (5, 1))
    ],
]


@pytest.mark.parametrize("spec,rule", RULES, ids=[r[0] for r in RULES])
@pytest.mark.parametrize("n,m", [(13, 13), (17, 17), (7, 11)])
def test_bias_equals_rule(spec, rule, n, m):
    torch.testing.assert_close(build(spec).bias(n, m), brute(n, m, rule), atol=0, rtol=0)


@pytest.mark.parametrize(
    "block,wb,r,g,last", [(4, 3, 1, 1, False), (3, 3, 2, 1, False), (4, 5, 1, 2, False),
                          (2, 2, 3, 0, False), (5, 1, 0, 1, False), (2, 3, 1, 1, True),
                          (4, 3, 2, 0, True)]
)
@pytest.mark.parametrize("n", [13, 22])
def test_bigbird_bias_equals_rule(block, wb, r, g, last, n):
    mech = build(f"bigbird(block={block}, window_blocks={wb}, num_random_blocks={r}, "
                 f"global_blocks={g}, seed=3, last_global={last})")
    rnd = mech.random_blocks(n, n, layer_idx=1)  # [nqb, r]
    end = -(-n // block) - 1 if last else -1  # the last block, when it is global

    def rule(i, j):
        qb, kb = i // block, j // block
        return (abs(qb - kb) <= wb // 2 or kb < g or qb < g or kb == end or qb == end
                or kb in rnd[qb].tolist())

    torch.testing.assert_close(mech.bias(n, n, layer_idx=1), brute(n, n, rule), atol=0, rtol=0)


def test_bigbird_random_blocks_are_distinct_and_outside_window_and_global():
    mech = build("bigbird(block=2, window_blocks=3, num_random_blocks=3, global_blocks=1)")
    n = 40
    nqb = n // 2
    rnd = mech.random_blocks(n, n, layer_idx=0)
    assert rnd.shape == (nqb, 3)
    for qb in range(nqb):
        picks = [kb for kb in rnd[qb].tolist() if kb >= 0]
        free = [kb for kb in range(nqb) if abs(qb - kb) > 1 and kb >= 1]
        assert len(set(picks)) == len(picks) == min(3, len(free))
        assert set(picks) <= set(free)
    # seeded by (seed, layer_idx, n)
    assert torch.equal(rnd, mech.random_blocks(n, n, layer_idx=0))
    assert not torch.equal(rnd, mech.random_blocks(n, n, layer_idx=1))
    # the official ITC layout (first and last block global): no random block is the last
    itc = build("bigbird(block=2, window_blocks=3, num_random_blocks=3, last_global=True)")
    picks = itc.random_blocks(n, n, layer_idx=0)
    assert (picks != nqb - 1).all() and (picks[:, 0] >= 0).all()


def test_bigbird_itc_layout_is_the_first_and_last_block():
    """global_blocks=1, last_global=True: the first and the last block are global rows and
    columns (google-research/bigbird's ITC; transformers' BigBirdBlockSparseAttention);
    the spec leaves last_global out when False."""
    mech = build("bigbird(block=2, window_blocks=3, num_random_blocks=0, last_global=True)")
    allowed = mech.bias(16, 16)[0] == 0  # [n,m]
    assert allowed[6, 14] and allowed[14, 6] and allowed[15].all() and allowed[:, 15].all()
    assert not allowed[6, 12]  # outside the window, neither global nor random
    plain = build("bigbird(block=2, window_blocks=3, num_random_blocks=0)").bias(16, 16)[0]
    assert not (plain == 0)[6, 14]
    spell = attnlab.core.config_spec
    assert "last_global" not in spell(build("bigbird").cfg)
    assert "last_global=True" in spell(mech.cfg)


def test_random_pattern_rule_and_seeding():
    mech = build("random(num_random=3, seed=1)")
    n = 29
    allowed = mech.bias(n, n) == 0  # [1,n,n]
    assert allowed[0].diagonal().all()  # j == i always
    off = allowed[0] & ~torch.eye(n, dtype=torch.bool)
    # exactly r keys drawn per query (one of them may be the query itself)
    assert set(off.sum(-1).tolist()) <= {2, 3} and (off.sum(-1) == 3).float().mean() > 0.5
    assert torch.equal(mech.bias(n, n), mech.bias(n, n))  # across calls
    assert not torch.equal(mech.bias(n, n, layer_idx=0), mech.bias(n, n, layer_idx=1))
    assert not torch.equal(mech.bias(n, n), build("random(num_random=3, seed=2)").bias(n, n))


def test_random_identical_in_train_and_eval():
    mech = build("random(num_random=2, seed=0)")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 21, 8, generator=g) for _ in range(3))
    c = attnlab.AttnContext(layer_idx=3)
    out_eval = mech(q, k, v, c).out
    out_train = mech.train()(q, k, v, c).out  # no dropout in the context
    assert torch.equal(out_eval, out_train)
    assert torch.equal(out_eval, mech.eval()(q, k, v, c).out)


# -------------------------------------------------------------------- dense equivalences


@pytest.mark.parametrize("n", [19, 300])  # dense path, blocked path
def test_band_wider_than_sequence_is_dense_softmax(n):
    mech = build(f"band(window={n})")
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
    key_mask = torch.arange(n)[None, :] < torch.tensor([n, n // 2])[:, None]
    for causal in (False, True):
        c = attnlab.AttnContext(key_mask=key_mask, causal=causal)
        ref, _ = attnlab.reference_attention(q, k, v, key_mask=key_mask, causal=causal)
        torch.testing.assert_close(mech(q, k, v, c).out, ref, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------- blocked path vs the reference

N_FAST = 300  # >= DENSE_FALLBACK_MAX_LEN and not a multiple of the query block
FAST = [
    "band(window=5)",
    "band(window=70)",
    "dilated(window=3, dilation=3)",
    "block_local(block=5)",
    "block_local(block=100)",
    "global_tokens(tokens=[0, 7, 299])",
    "longformer(window=6, global_tokens=[0, 3, 150])",
    "star(relay=4)",
    "bigbird(block=8, window_blocks=3, num_random_blocks=2, global_blocks=1)",
    "bigbird(block=16, window_blocks=5, num_random_blocks=1, global_blocks=2)",
    "bigbird(block=16, window_blocks=3, num_random_blocks=2, last_global=True)",
    "bigbird(block=8, window_blocks=3, num_random_blocks=1, global_blocks=0, last_global=True)",
    "sparse_transformer(mode='fixed', stride=8, summary=2)",  # own block + shared summaries
    "sparse_transformer(mode='fixed', stride=64, summary=1)",
    "sparse_transformer(mode='fixed', stride=100, summary=30)",  # a block over query blocks
]


def _qkv(n: int, b: int = 3, h: int = 2, d: int = 8, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def test_fast_threshold_is_above_test_length():
    assert bs.use_blocked(N_FAST, N_FAST, need_weights=False)
    assert not bs.use_blocked(N_FAST, N_FAST, need_weights=True)
    assert not bs.use_blocked(N_FAST, N_FAST + 1, need_weights=False)


# per-query key lists (random): the gathered engine
KEY_LISTS = [
    "random(num_random=5, seed=3)",
    "random(num_random=0)",
]
# sparse_transformer's strided mode: two block patterns in two orders merged by lse
# (``_blockunion``) on the flash kernels, else (dropout) per-query key lists
UNION = [
    "sparse_transformer(mode='strided', stride=7)",
    "sparse_transformer(mode='strided', stride=64)",
    "sparse_transformer(mode='strided', stride=16)",
]


@pytest.fixture(params=["flash", "explicit"])
def engine(request, monkeypatch):
    """The blocked engine's window part: torch's CPU flash kernels (``_blockflash``, used
    without attention dropout), or the explicit path that dropout takes."""
    from attnlab.mechanisms import _blockflash

    monkeypatch.setattr(_blockflash, "ENABLED", request.param == "flash")
    return request.param


@pytest.mark.parametrize("spec", FAST + UNION + KEY_LISTS)
@pytest.mark.parametrize("causal", [False, True])
def test_blocked_path_matches_reference(spec, causal, engine):
    """The fast path (the blocked engine; the gathered one for per-query key lists) equals
    autograd through the dense masked reference to 1e-5 (fp32), outputs and gradients,
    with padding, a fully masked sequence and the causal rule, and it ran."""
    from attnlab.mechanisms import _gathered

    mech = build(spec)
    q, k, v = _qkv(N_FAST, seed=len(spec))
    lengths = torch.tensor([N_FAST, 170, 0])  # full, padded, fully masked
    key_mask = torch.arange(N_FAST)[None, :] < lengths[:, None]
    c = attnlab.AttnContext(key_mask=key_mask, causal=causal, layer_idx=2)
    from attnlab.mechanisms import _blockflash, _blockpatterns

    if spec in KEY_LISTS or (spec in UNION and engine == "explicit"):
        path = (_gathered, "gathered_attention", _gathered.gathered_attention)
    elif spec in UNION:
        path = (_blockpatterns, "union_attention", _blockpatterns.union_attention)
    else:
        path = (bs, "blocked_attention", bs.blocked_attention)
    with (mock.patch.object(path[0], path[1], wraps=path[2]) as spy,
          mock.patch.object(_blockflash, "forward", wraps=_blockflash.forward) as flash):
        out = mech(q, k, v, c).out
    assert spy.called, f"the {path[1]} path did not run"
    assert flash.called == (engine == "flash" and spec not in KEY_LISTS)
    bias = mech.bias(N_FAST, N_FAST, layer_idx=2)
    ref, _ = attnlab.reference_attention(q, k, v, bias=bias, key_mask=key_mask, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out[2] == 0).all()
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_blocked_path_without_padding_or_dead_rows(causal, engine):
    """n a multiple of the query block and no key mask: the path that skips row masking."""
    n = 5 * bs.DEFAULT_BLOCK
    mech = build("band(window=7)")
    q, k, v = _qkv(n, seed=7)
    out = mech(q, k, v, attnlab.AttnContext(causal=causal)).out
    ref, _ = attnlab.reference_attention(q, k, v, bias=mech.bias(n, n), causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [4000, 20_000, 1 << 22])  # part of a head, heads, all
@pytest.mark.parametrize("padded", [True, False])  # chunks per batch element / across it
@pytest.mark.parametrize("spec", [  # extra keys shared by every block / per block
    "longformer(window=9, global_tokens=[1])",
    "bigbird(block=16, window_blocks=3, num_random_blocks=1)"])
def test_blocked_chunking_is_invisible(chunk, padded, spec, monkeypatch, engine):
    monkeypatch.setattr(_blocklayout, "CHUNK_ELEMS", chunk)
    mech = build(spec, heads=3)
    q, k, v = _qkv(N_FAST, h=3, seed=5)
    lengths = torch.tensor([N_FAST, 200, 40] if padded else [N_FAST] * 3)
    key_mask = torch.arange(N_FAST)[None, :] < lengths[:, None]
    c = attnlab.AttnContext(key_mask=key_mask, causal=False)
    out = mech(q, k, v, c).out
    ref, _ = attnlab.reference_attention(
        q, k, v, bias=mech.bias(N_FAST, N_FAST), key_mask=key_mask
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_global_row_with_a_padded_window_still_attends_the_real_keys(causal, engine):
    """Query 150 is global; in a sequence of 100 real tokens its window and its own key
    are padding, yet as a global row it attends keys 0-99 (the reference's semantics)."""
    mech = build("longformer(window=2, global_tokens=[150])")
    q, k, v = _qkv(N_FAST, b=2, seed=3)
    key_mask = torch.arange(N_FAST)[None, :] < torch.tensor([N_FAST, 100])[:, None]
    c = attnlab.AttnContext(key_mask=key_mask, causal=causal)
    out = mech(q, k, v, c).out
    ref, _ = attnlab.reference_attention(q, k, v, bias=mech.bias(N_FAST, N_FAST),
                                         key_mask=key_mask, causal=causal)
    assert ref[1, :, 150].abs().sum() > 0
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_need_weights_gives_reference_probs_at_long_lengths():
    mech = build("band(window=4)")
    q, k, v = (t.detach() for t in _qkv(N_FAST, b=1))
    res = mech(q, k, v, attnlab.AttnContext(need_weights=True))
    fast = mech(q, k, v, attnlab.AttnContext()).out
    ref, probs = attnlab.reference_attention(q, k, v, bias=mech.bias(N_FAST, N_FAST))
    torch.testing.assert_close(res.probs, probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, res.out, atol=1e-5, rtol=1e-5)


def test_unequal_lengths_use_the_dense_path():
    mech = build("band(window=6)")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, N_FAST, 8, generator=g)
    k, v = (torch.randn(1, 2, N_FAST + 20, 8, generator=g) for _ in range(2))
    out = mech(q, k, v, attnlab.AttnContext(causal=True)).out
    ref, _ = attnlab.reference_attention(
        q, k, v, bias=brute(N_FAST, N_FAST + 20, lambda i, j: abs(i - j) <= 6 and j <= i))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec,rule", RULES, ids=[r[0] for r in RULES])
@pytest.mark.parametrize("n,m", [(7, 11), (11, 7)])
def test_causal_with_unequal_lengths_is_the_rule_and_j_le_i(spec, rule, n, m):
    """The issue's semantics at n != m: the pattern on raw positions AND j <= i (query i is
    position i for the pattern and for causality alike), with a key mask; fp32, 1e-6."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, n, 8, generator=g)
    k, v = (torch.randn(2, 2, m, 8, generator=g) for _ in range(2))
    key_mask = torch.ones(2, m, dtype=torch.bool)
    key_mask[1, m - 3:] = False
    out = build(spec)(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=True)).out
    ref, _ = attnlab.reference_attention(
        q, k, v, bias=brute(n, m, lambda i, j: rule(i, j) and j <= i), key_mask=key_mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_blocked_bf16_runs():
    mech = build("longformer(window=8, global_tokens=[0])")
    q, k, v = (t.detach() for t in _qkv(N_FAST, dtype=torch.bfloat16))
    out = mech(q, k, v, attnlab.AttnContext()).out
    ref, _ = attnlab.reference_attention(q.float(), k.float(), v.float(),
                                         bias=mech.bias(N_FAST, N_FAST))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)  # bf16: ~8 bits


# ------------------------------------------------ the hand-written backward (float64)


def _engine(p: float, causal: bool, extra: str | None, rows: bool = False):
    """The engine on a small problem; ``extra``: None, "shared" (the same extra keys for
    every block, as Longformer's global keys) or "block" (their order and slots differ
    per block, as BigBird's random keys)."""
    n, block, w = 21, 4, 3
    nqb = -(-n // block)
    ex = {None: None, "shared": torch.tensor([[0, 17, -1]]).expand(nqb, -1),
          "block": torch.tensor([[0, 17, -1], [17, -1, 0]]).repeat(nqb, 1)[:nqb]}[extra]
    key_mask = torch.arange(n)[None, :] < torch.tensor([n, 12])[:, None]

    def pattern(i, j):
        return ((i - j).abs() <= w) & (j != 0) & (j != 17) if extra else (i - j).abs() <= w

    bias, bias_x, live = bs.build_block_bias(n, block, w, bs.window_width(block, w, w),
                                             pattern, ex, key_mask, causal, torch.float64,
                                             torch.device("cpu"))
    lay = bs._Layout(n, block, w, bs.window_width(block, w, w), 2 * 2,
                     0 if ex is None else ex.shape[-1])
    xi = None if ex is None else bs.ExtraKeys(ex.clamp(0, n - 1))
    # dense rows: query 0 and 17 attend every key (17's window is padding in sequence 2)
    r = torch.tensor([0, 17]) if rows else None
    rb = bs.row_bias(r, n, key_mask, causal, torch.float64) if rows else None

    def fn(q, k, v):
        return bs._BlockedAttention.apply(q, k, v, bias, bias_x, live, xi, lay, 0.4, p, 1234,
                                          r, rb)

    return fn, n


def _gradcheck(fn, shape: tuple[int, ...], seed: int) -> None:
    """float64 gradcheck of fn(q, k, v) on random inputs of ``shape``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("p,causal,extra,rows", [
    (0.0, False, "shared", False), (0.0, True, None, False), (0.3, False, None, False),
    (0.3, True, "shared", False), (0.0, False, "shared", True), (0.0, True, None, True),
    (0.3, True, "shared", True), (0.0, False, "block", False), (0.3, True, "block", True)])
def test_blocked_backward_gradcheck(p, causal, extra, rows, engine):
    fn, n = _engine(p, causal, extra, rows)
    _gradcheck(fn, (4, n, 3), seed=0)


@pytest.mark.parametrize("causal", [False, True])
def test_union_backward_gradcheck(causal):
    """The strided pattern's two parts merged by log-sum-exp (``_blockunion``): float64
    gradcheck with padding (n not a multiple of the stride) and a padded sequence."""
    from attnlab.mechanisms import _blockpatterns

    n = 23
    key_mask = torch.arange(n)[None, :] < torch.tensor([n, 12])[:, None]

    def fn(q, k, v):
        return _blockpatterns.strided_attention(q, k, v, stride=5, key_mask=key_mask,
                                                causal=causal, scale=0.4)

    _gradcheck(fn, (2, 2, n, 3), seed=2)


def test_blocked_backward_recomputes_many_dense_rows(monkeypatch):
    """Dense rows beyond ``_KEEP_ROWS_MAX`` are recomputed in the backward, not kept."""
    monkeypatch.setattr(bs, "_KEEP_ROWS_MAX", 1)
    fn, n = _engine(0.3, True, "block", rows=True)
    _gradcheck(fn, (4, n, 3), seed=1)


@pytest.mark.parametrize("causal", [False, True])
def test_cached_bias_equals_a_fresh_one_under_every_key_mask(causal):
    """The bias cache (``_blockbias``): a named pattern is built once per shape; each
    batch's key mask still applies on top, and the result equals an uncached build."""
    from attnlab.mechanisms import _blockbias

    n, block, w = 300, 64, 20
    width = bs.window_width(block, w, w)
    built = []

    def pattern(i, j):
        built.append(1)
        return (i - j).abs() <= w

    ex = torch.tensor([[0, 5]]).expand(-(-n // block), -1)
    masks = [None, torch.arange(n)[None, :] < torch.tensor([n, 123])[:, None],
             torch.arange(n)[None, :] < torch.tensor([7, n])[:, None], None]
    for km in masks:
        got = bs.build_block_bias(n, block, w, width, pattern, ex, km, causal, torch.float32,
                                  torch.device("cpu"), key=("test-band", w, causal))
        fresh = bs.build_block_bias(n, block, w, width, pattern, ex, km, causal,
                                    torch.float32, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(got, fresh, strict=True))
    assert len(built) == 1 + len(masks)  # the keyed pattern once, the fresh builds each time
    assert len(_blockbias._BIAS_CACHE) <= _blockbias.BIAS_CACHE_SIZE


def test_dropout_only_in_training():
    mech = build("band(window=8)")
    q, k, v = (t.detach() for t in _qkv(N_FAST, b=1))
    c = attnlab.AttnContext(dropout=0.5)
    clean = mech(q, k, v, attnlab.AttnContext()).out
    assert torch.equal(mech(q, k, v, c).out, clean)  # eval: no dropout
    torch.manual_seed(0)
    noisy = mech.train()(q, k, v, c).out
    assert torch.isfinite(noisy).all() and not torch.allclose(noisy, clean)


# ------------------------------------------------------------------------- configs


def test_spec_strings_parse():
    cfg = resolve_config("longformer(window=64, global_tokens=[0])")
    assert (cfg.name, cfg.window, cfg.global_tokens) == ("longformer", 64, (0,))
    cfg = resolve_config("sparse_transformer(mode='fixed', stride=8, summary=2)")
    assert (cfg.mode, cfg.stride, cfg.summary) == ("fixed", 8, 2)
    cfg = resolve_config("bigbird(block=32, num_random_blocks=2)")
    assert resolve_config(cfg.spec()) == cfg
    assert resolve_config("global_tokens(tokens=[0, 5])").tokens == (0, 5)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("band(window=-1)", "window"),
        ("dilated(dilation=0)", "dilation"),
        ("block_local(block=0)", "block"),
        ("sparse_transformer(mode='diagonal')", "mode"),
        ("sparse_transformer(stride=4, summary=5)", "summary"),
        ("longformer(windw=3)", "window"),
    ],
)
def test_bad_configs_name_the_problem(spec, needle):
    with pytest.raises(RegistryError, match=needle):
        resolve_config(spec)


# ------------------------------------------------ K, V, q and dO read without copies


N_BLOCKS = 5 * bs.DEFAULT_BLOCK  # a multiple of the query block: K and V need no padded copy


@pytest.mark.parametrize("spec", ["band(window=70)", "longformer(window=9, global_tokens=[1, 200])",
                                  "bigbird(block=16, window_blocks=3, num_random_blocks=1)"])
@pytest.mark.parametrize(("layout", "b", "chunk", "form", "masked"), [
    ("contiguous", 2, 4000, "flat", True),  # windows are views of k shifted by P rows
    ("contiguous", 2, 1 << 22, "flat", True),  # chunks of whole sequences
    ("transposed", 1, 4000, "strided", True),  # [b,n,h,d] as encoders give it: strided
    ("transposed", 1, 4000, "strided", False),  # no key mask: dO arrives strided too
    ("transposed", 1, 1 << 22, "flat", True),  # whole sequences need one stride: a copy
    ("transposed", 2, 4000, "flat", True),  # b > 1: reshape to [b*h, n, d] copies
])
def test_keys_without_padded_copy_match_reference(spec, layout, b, chunk, form, masked,
                                                   monkeypatch, engine):
    monkeypatch.setattr(_blocklayout, "CHUNK_ELEMS", chunk)
    forms = []
    real_of = bs._KeyRows.of

    def spy(lay, x, inside):
        rows = real_of(lay, x, inside)
        forms.append(rows.form)
        return rows

    monkeypatch.setattr(bs._KeyRows, "of", staticmethod(spy))
    strided_queries = []  # per _QueryRows made (q forward, q backward, dO): no block view

    class QuerySpy(bs._QueryRows):
        def __init__(self, *args):
            super().__init__(*args)
            strided_queries.append(self.flat is None)

    monkeypatch.setattr(bs, "_QueryRows", QuerySpy)
    mech = build(spec, heads=2)
    g = torch.Generator().manual_seed(11)
    n = N_BLOCKS
    if layout == "contiguous":
        leaves = [torch.randn(b, 2, n, 8, generator=g).requires_grad_() for _ in range(3)]
        q, k, v = leaves
    else:
        leaves = [torch.randn(b, n, 2, 8, generator=g).requires_grad_() for _ in range(3)]
        q, k, v = (x.transpose(1, 2) for x in leaves)  # [b,h,n,d], not contiguous
    key_mask = torch.arange(n)[None, :] < torch.tensor([170, n][:b])[:, None]
    key_mask = key_mask if masked else None
    c = attnlab.AttnContext(key_mask=key_mask)
    out = mech(q, k, v, c).out
    assert forms == [form, form]
    ref, _ = attnlab.reference_attention(q, k, v, bias=mech.bias(n, n), key_mask=key_mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # dO in the layout of the inputs: transposed [b,n,h,d] as an encoder's output would be
    gout = torch.randn(leaves[0].shape, generator=g)
    gout = gout if layout == "contiguous" else gout.transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, gout)
    grads_ref = torch.autograd.grad(ref, leaves, gout)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # q in the forward and the backward, then dO: strided as it arrives without a key mask
    # (with one, some patterns' padded rows pass through a product that makes it contiguous)
    assert strided_queries[:2] == [form == "strided"] * 2 and len(strided_queries) == 3
    if not masked:
        assert strided_queries[2] == (form == "strided")


# ------------------------------------------------------------- key lists are the patterns


@pytest.mark.parametrize("n", [300, 1000])
def test_key_lists_are_the_patterns(n):
    """Each query's listed keys are exactly its row of the [n, n] pattern, none twice."""
    from attnlab.core import masks

    cases = [(masks.random_key_list(n, 4, 1, 3), masks.random_pattern(n, n, 4, 1, 3)),
             (masks.strided_key_list(n, 16), masks.strided_pattern(n, n, 16))]
    for (idx, ok), pattern in cases:
        counts = torch.zeros(n, n, dtype=torch.long).scatter_add(1, idx, ok.long())
        assert counts.max() == 1 and torch.equal(counts.bool(), pattern)
