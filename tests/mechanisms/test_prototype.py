"""Prototype-query family: ``clustered``, ``improved_clustered`` (Vyas et al. 2020) and
``probsparse`` (Informer, Zhou et al. 2021).

Every fast path is compared with a naive loop reference written here (Python loops over
rows, heads and queries; k-means on tuples of bits) given the same random draws.
Tolerances: fp32 outputs, weights and gradients vs the naive references and vs dense
softmax (degenerate settings) 1e-5; out == weights @ v and invariances 1e-6 (float
reassociation only); cluster assignments and sampled keys compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from plan_step import train_one_step

import attnlab
from attnlab.core import RegistryError
from attnlab.mechanisms.prototype import (
    ClusteredConfig,
    ImprovedClusteredConfig,
    ProbSparseConfig,
    cluster_queries,
    probsparse_keys,
    probsparse_sizes,
)

D, H = 8, 2
TOL = dict(atol=1e-5, rtol=1e-5)


def qkv(b=3, n=13, m=None, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    ts = (torch.randn(b, H, n, D, generator=g), torch.randn(b, H, m, D, generator=g),
          torch.randn(b, H, m, D, generator=g))
    return tuple(t.requires_grad_(requires_grad) for t in ts)


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [b,n]


def build(spec):
    return attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, 64)).eval()


def run(mech, q, k, v, mask=None, layer=0, need_weights=True):
    return mech(q, k, v, attnlab.AttnContext(key_mask=mask, layer_idx=layer,
                                             need_weights=need_weights))


def assert_same_grads(out, ref, inputs):
    """The gradients of out and ref for one random upstream gradient agree to TOL;
    returns out's."""
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, g)
    grads_ref = torch.autograd.grad(ref, inputs, g)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, **TOL)
    return grads


def query_valid(mask, b, n, m):
    if mask is None or n != m:
        return torch.ones(b, n, dtype=torch.bool)
    return mask


# ------------------------------------------------------------------ naive references


def naive_assignment(q, draws, valid, clusters, iterations):
    """Cluster id per query [b,h,n] by explicit loops; padded queries get ``clusters``."""
    b, h, n, d = q.shape
    planes = draws.planes.double()
    out = torch.full((b, h, n), clusters, dtype=torch.long)
    for bi in range(b):
        real = [i for i in range(n) if valid[bi, i]]
        if len(real) <= clusters:  # each real query its own cluster
            for rank, i in enumerate(real):
                out[bi, :, i] = rank
            continue
        seeds = sorted(real, key=lambda i: draws.init_score[i].item())[:clusters]
        for hi in range(h):
            codes = {}
            for i in real:
                x = q[bi, hi, i].detach().double()
                codes[i] = tuple(int((x @ planes[j, :d]).item() > planes[j, d].item())
                                 for j in range(planes.shape[0]))

            def nearest(code, cents):
                dist = [sum(a != c for a, c in zip(code, cent, strict=True)) for cent in cents]
                return dist.index(min(dist))  # first nearest

            cents = [codes[i] for i in seeds]
            for t in range(iterations - 1):
                assign = {i: nearest(codes[i], cents) for i in real}
                new = []
                for c in range(clusters):
                    mem = [i for i in real if assign[i] == c]
                    if not mem:
                        new.append(tuple(int(x) for x in draws.empty_codes[t, c]))
                    else:
                        new.append(tuple(int(2 * sum(codes[i][j] for i in mem) > len(mem))
                                         for j in range(len(cents[0]))))
                cents = new
            for i in real:
                out[bi, hi, i] = nearest(codes[i], cents)
    return out


def softmax_over(scores, keys):
    """Softmax of a 1-D score vector restricted to index list ``keys`` -> dense weights."""
    w = torch.zeros_like(scores)
    if keys:
        w = w.index_put((torch.tensor(keys),), torch.softmax(scores[keys], 0))
    return w


def naive_clustered(q, k, v, assign, clusters, key_mask=None, topk=None):
    """Clustered (topk=None) or i-clustered attention by loops; returns (out, weights).

    assign [b,h,n]: cluster ids, ``clusters`` = no cluster (the query outputs zeros)."""
    b, h, n, d = q.shape
    m = k.shape[2]
    kvalid = torch.ones(b, m, dtype=torch.bool) if key_mask is None else key_mask
    rows = []
    for bi in range(b):
        real_keys = [j for j in range(m) if kvalid[bi, j]]
        for hi in range(h):
            for i in range(n):
                c = assign[bi, hi, i].item()
                if c == clusters:
                    rows.append(torch.zeros(m))
                    continue
                mem = [j for j in range(n) if assign[bi, hi, j].item() == c]
                centroid = torch.stack([q[bi, hi, j] for j in mem]).mean(0)
                raw = torch.stack([centroid @ k[bi, hi, j] for j in range(m)])
                a_c = softmax_over(raw / d**0.5, real_keys)
                if topk is None:
                    rows.append(a_c)
                    continue
                ranked = sorted(real_keys, key=lambda j: -raw[j].item())[:topk]
                mass = sum(a_c[j] for j in ranked)
                own = torch.stack([q[bi, hi, i] @ k[bi, hi, j] for j in range(m)]) / d**0.5
                in_top = torch.zeros(m, dtype=torch.bool)
                in_top[ranked] = True
                rows.append(torch.where(in_top, softmax_over(own, ranked) * mass, a_c))
    w = torch.stack(rows).view(b, h, n, m)
    return w @ v, w


def naive_probsparse(q, k, v, draws, factor, key_mask=None):
    """Informer's query selection by loops; returns (out, weights, sampled keys [b,n,U]).

    Row b has the sizes of its unpadded sequence: U_b = min(c*ceil(ln L_b), L_b) samples
    (the first U_b draws), u_b from its real query count; M = max - mean of the samples."""
    b, h, n, d = q.shape
    m = k.shape[2]
    kvalid = torch.ones(b, m, dtype=torch.bool) if key_mask is None else key_mask
    qvalid = query_valid(key_mask, b, n, m)
    sampled = torch.zeros(b, n, draws.shape[1], dtype=torch.long)
    rows = []
    for bi in range(b):
        real = [j for j in range(m) if kvalid[bi, j]]
        big_l = len(real)
        num = probsparse_sizes(big_l, factor)[0] if big_l else 0
        active = probsparse_sizes(int(qvalid[bi].sum()), factor)[1]
        for i in range(n):
            for s, r in enumerate(draws[i].tolist()):
                sampled[bi, i, s] = real[r * big_l // 2**31] if real else 0
        for hi in range(h):
            measure = {}
            for i in range(n):
                if not qvalid[bi, i]:
                    continue
                dots = [(q[bi, hi, i] @ k[bi, hi, j]).item()
                        for j in sampled[bi, i, :num].tolist()]
                measure[i] = max(dots) - sum(dots) / len(dots) if dots else 0.0
            chosen = sorted(measure, key=lambda i: -measure[i])[:active]
            for i in range(n):
                if not qvalid[bi, i]:
                    rows.append(torch.zeros(m))
                elif i in chosen:
                    s = torch.stack([q[bi, hi, i] @ k[bi, hi, j] for j in range(m)]) / d**0.5
                    rows.append(softmax_over(s, real))
                else:
                    rows.append(kvalid[bi].float() / max(big_l, 1))
    w = torch.stack(rows).view(b, h, n, m)
    return w @ v, w, sampled


# --------------------------------------------------------------- clustering vs the loops


@pytest.mark.parametrize("case", ["unpadded", "padded", "scattered_mask", "duplicates"])
def test_cluster_assignment_matches_naive_kmeans(case):
    q, _, _ = qkv(n=13, seed=1)
    valid = torch.ones(3, 13, dtype=torch.bool)
    if case == "padded":
        valid = lengths_mask(13, [13, 9, 3])  # row 2: at most C real queries
    elif case == "scattered_mask":
        valid = torch.rand(3, 13, generator=torch.Generator().manual_seed(2)) > 0.3
    elif case == "duplicates":  # 2 distinct queries, 4 clusters: empty clusters get codes
        q = q[:, :, :2].repeat_interleave(7, dim=2)[:, :, :13].contiguous()
    mech = build("clustered(clusters=4, bits=6, iterations=5)")
    draws = mech.draws(13, layer_idx=0)
    got = cluster_queries(q, draws, valid, 4, 5)
    want = naive_assignment(q, draws, valid, 4, 5)
    assert torch.equal(got, want)
    if case == "duplicates":  # the tie rule: equal codes go to the lowest centroid
        assert got.unique().numel() <= 2
    assert ((got == 4) == ~valid[:, None, :]).all()  # exactly the padded queries: no cluster


# -------------------------------------------------- mechanisms vs the loops (same draws)


@pytest.mark.parametrize("topk", [None, 3])
@pytest.mark.parametrize("lengths", [None, [13, 8, 4]])
def test_clustered_matches_naive_reference(topk, lengths):
    name = "clustered" if topk is None else "improved_clustered"
    extra = "" if topk is None else f", topk={topk}"
    mech = build(f"{name}(clusters=3, bits=8, iterations=4{extra})")
    q, k, v = qkv(n=13, seed=3, requires_grad=True)
    mask = None if lengths is None else lengths_mask(13, lengths)
    res = run(mech, q, k, v, mask, layer=2)
    draws = mech.draws(13, layer_idx=2)  # eval: the draw the call used
    assign = naive_assignment(q, draws, query_valid(mask, 3, 13, 13), 3, 4)
    ref, ref_w = naive_clustered(q, k, v, assign, 3, mask, topk)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, ref_w, **TOL)
    grads = assert_same_grads(res.out, ref, (q, k, v))
    assert grads[0].abs().sum() > 0  # gradient reaches the queries through the centroids


@pytest.mark.parametrize("topk", [None, 3])
@pytest.mark.parametrize("n,m,lengths", [(13, 13, None), (13, 13, [13, 8, 4]), (9, 11, [11, 6, 2])])
def test_clustered_without_weights_matches_naive_with_gradients(n, m, lengths, topk):
    """Without need_weights, clustered's A_c V runs on ``masked_sdpa`` and i-clustered's
    top keys go through ``_topkeys.TopKeysAttention`` (its own backward, gathering the keys
    again): output and gradients of q, k, v against the loops (the same draws)."""
    name = "clustered" if topk is None else "improved_clustered"
    extra = "" if topk is None else f", topk={topk}"
    mech = build(f"{name}(clusters=3, bits=8, iterations=4{extra})")
    q, k, v = qkv(n=n, m=m, seed=12, requires_grad=True)
    mask = None if lengths is None else lengths_mask(m, lengths)
    res = run(mech, q, k, v, mask, layer=1, need_weights=False)
    assert res.probs is None
    assign = naive_assignment(q, mech.draws(n, layer_idx=1), query_valid(mask, 3, n, m), 3, 4)
    ref, _ = naive_clustered(q, k, v, assign, 3, mask, topk)
    torch.testing.assert_close(res.out, ref, **TOL)
    assert_same_grads(res.out, ref, (q, k, v))


def test_top_keys_backward_is_the_gradient():
    """TopKeysAttention against finite differences (float64): q, k, v and the mass, with
    a disallowed key, a row with none allowed, a repeated key and a dropout keep-mask."""
    from attnlab.mechanisms._topkeys import TopKeysAttention

    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 2, s, 3, generator=g, dtype=torch.float64, requires_grad=True)
               for s in (4, 5, 5))
    idx = torch.randint(0, 5, (2, 2, 4, 3), generator=g)
    idx[0, 0, 0] = torch.tensor([1, 1, 2])  # a key twice
    ok = torch.rand(2, 2, 4, 3, generator=g) > 0.2
    ok[1, 1, 2] = False  # no allowed key: the row is 0
    mass = torch.rand(2, 2, 4, 1, generator=g, dtype=torch.float64, requires_grad=True)
    keep = (torch.rand(2, 2, 4, 3, generator=g) > 0.3).double() / 0.7
    for kp in (None, keep):
        assert torch.autograd.gradcheck(
            lambda q, k, v, mass, kp=kp: TopKeysAttention.apply(q, k, v, idx, ok, mass, 0.7, kp),
            (q, k, v, mass))


def test_improved_clustered_dropout_draws_alike_with_and_without_weights():
    """In training both branches (weights returned or not) draw the same dropout masks:
    fresh mechanisms (the same clustering draws), the same torch seed, the same output."""
    q, k, v = qkv(n=13, seed=14)

    def out(seed, need_weights):
        mech = build("improved_clustered(clusters=3, bits=8, topk=3)").train()
        torch.manual_seed(seed)
        c = attnlab.AttnContext(layer_idx=1, dropout=0.5, need_weights=need_weights)
        return mech(q, k, v, c).out

    torch.testing.assert_close(out(5, True), out(5, False), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out(5, False), out(6, False))  # dropout is on: other masks


@pytest.mark.parametrize("name", ["clustered", "improved_clustered"])
def test_clustered_cross_attention_matches_naive(name):
    """n != m: every query is real; the key mask pads keys only."""
    extra = ", topk=4" if name == "improved_clustered" else ""
    mech = build(f"{name}(clusters=3, bits=8, iterations=3{extra})")
    q, k, v = qkv(n=9, m=11, seed=4)
    mask = lengths_mask(11, [11, 6, 2])
    res = run(mech, q, k, v, mask)
    assign = naive_assignment(q, mech.draws(9, 0), torch.ones(3, 9, dtype=torch.bool), 3, 3)
    ref, ref_w = naive_clustered(q, k, v, assign, 3, mask, 4 if extra else None)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, ref_w, **TOL)


@pytest.mark.parametrize("n,m,lengths", [(13, 13, None), (13, 13, [13, 7, 2]), (9, 12, [12, 5, 1]),
                                         (40, 40, [40, 23, 9]), (30, 50, [50, 17, 3])])
@pytest.mark.parametrize("factor", [1, 2])
def test_probsparse_matches_naive_reference(n, m, lengths, factor):
    mech = build(f"probsparse(factor={factor})")
    q, k, v = qkv(n=n, m=m, seed=5, requires_grad=True)
    mask = None if lengths is None else lengths_mask(m, lengths)
    res = run(mech, q, k, v, mask, layer=1)
    num, u = mech.sizes(n, m)
    assert (num, u) == (probsparse_sizes(m, factor)[0], probsparse_sizes(n, factor)[1])
    draws = mech.draws(n, m, layer_idx=1)
    assert draws.shape == (n, num)
    ref, ref_w, sampled = naive_probsparse(q, k, v, draws, factor, mask)
    kvalid = torch.ones(3, m, dtype=torch.bool) if mask is None else mask
    assert torch.equal(probsparse_keys(draws, kvalid), sampled)
    torch.testing.assert_close(res.out, ref, **TOL)
    torch.testing.assert_close(res.probs, ref_w, **TOL)
    assert_same_grads(res.out, ref, (q, k, v))


def _official_probsparse(q, k, v, index_sample, factor, divisor):
    """The official ``ProbAttention`` (mask_flag=False) with the sampled keys given and its
    measure's sample sum divided by ``divisor`` (the official code: L_K)."""
    b, h, lq, dk = q.shape
    lk = k.shape[2]
    u = min(factor * math.ceil(math.log(lq)), lq)
    k_sample = k.unsqueeze(-3).expand(b, h, lq, lk, dk)[
        :, :, torch.arange(lq).unsqueeze(1), index_sample, :]
    qk_sample = (q.unsqueeze(-2) @ k_sample.transpose(-2, -1)).squeeze(-2)
    meas = qk_sample.max(-1)[0] - qk_sample.sum(-1) / divisor
    top = meas.topk(u, sorted=False)[1]
    q_red = q[torch.arange(b)[:, None, None], torch.arange(h)[None, :, None], top, :]
    attn = torch.softmax(q_red @ k.transpose(-2, -1) / math.sqrt(dk), dim=-1)
    out = v.mean(dim=-2, keepdim=True).expand(b, h, lq, v.shape[-1]).clone()
    out[torch.arange(b)[:, None, None], torch.arange(h)[None, :, None], top, :] = attn @ v
    return out


@pytest.mark.parametrize("n,m,factor", [(40, 40, 1), (30, 50, 1), (200, 120, 2), (7, 7, 5)])
def test_probsparse_matches_the_official_code_with_the_papers_mean(n, m, factor):
    """The official code fed our sampled keys, its measure's sum divided by U (the paper's
    "M = max(S) - mean(S) by row"; the official code divides by L_K, the same at U = L_K:
    the last case, 5 * ceil(ln 7) >= 7)."""
    mech = build(f"probsparse(factor={factor})")
    q, k, v = qkv(n=n, m=m, seed=11)
    draws = mech.draws(n, m, layer_idx=0)
    sample = probsparse_keys(draws, torch.ones(3, m, dtype=torch.bool))[0]  # [n,U]
    ref = _official_probsparse(q, k, v, sample, factor, sample.shape[1])
    torch.testing.assert_close(run(mech, q, k, v).out, ref, **TOL)
    if sample.shape[1] == m:
        official = _official_probsparse(q, k, v, sample, factor, m)
        torch.testing.assert_close(run(mech, q, k, v).out, official, **TOL)


def test_probsparse_padded_rows_take_the_sizes_of_their_own_length():
    """A row of L real tokens in a batch padded to n has u = min(c*ceil(ln L), L) active
    queries and U = min(c*ceil(ln L), L) samples, not the padded length's."""
    mech = build("probsparse(factor=1)")
    n, real = 60, 20  # ceil(ln 60) = 5, ceil(ln 20) = 3
    q, k, v = qkv(b=1, n=n, seed=12)
    mask = lengths_mask(n, [real])
    res = run(mech, q, k, v, mask)
    lazy = (res.probs[0, :, :real] - mask[0] / real).abs().amax(-1) < 1e-7  # [h,real]
    assert ((~lazy).sum(-1) == 3).all()  # u_b = 3 active queries per head, not 5
    samples, active = mech.row_sizes(1, n, n, mask)
    assert samples.tolist() == [3] and active.tolist() == [3] and mech.sizes(n, n) == (5, 5)


def test_probsparse_sizes_follow_the_official_rounding():
    """U = c*ceil(ln m), u = c*ceil(ln n), each capped at the length (np.ceil(np.log(L)))."""
    mech = build("probsparse(factor=5)")
    assert mech.sizes(96, 96) == (25, 25)  # ln 96 = 4.56 -> 5
    assert mech.sizes(8, 100) == (25, 8)  # u capped at n = 8
    assert mech.sizes(1, 1) == (0, 0)  # ln 1 = 0: every query lazy (the mean of one value)
    assert build("probsparse(factor=2)").sizes(20, 3) == (3, 6)  # 2*ceil(ln 3) = 4 > 3


# ------------------------------------------------------------- degenerate = softmax


DEGENERATE = [
    "clustered(clusters=13)",  # C = n: every query its own cluster
    "clustered(clusters=64)",  # C > n
    "improved_clustered(clusters=13, topk=2)",  # C = n: top-k re-weighting is exact
    "improved_clustered(clusters=2, bits=4, topk=13)",  # k = m: every key re-weighted exactly
    "probsparse(factor=100)",  # u = n: every query active
]


@pytest.mark.parametrize("spec", DEGENERATE)
@pytest.mark.parametrize("lengths", [None, [13, 9, 3]])
def test_degenerate_settings_equal_softmax(spec, lengths):
    mech = build(spec)
    q, k, v = qkv(n=13, seed=6, requires_grad=True)
    mask = None if lengths is None else lengths_mask(13, lengths)
    res = run(mech, q, k, v, mask)
    ref, ref_p = attnlab.reference_attention(q, k, v, key_mask=mask)
    real = query_valid(mask, 3, 13, 13)[:, None, :, None]  # padded query rows output zeros
    torch.testing.assert_close(res.out, ref * real, **TOL)
    torch.testing.assert_close(res.probs, ref_p * real, **TOL)
    g = torch.randn_like(ref) * real
    grads = torch.autograd.grad(res.out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, **TOL)


# ------------------------------------------------------------------ weights, padding


ALL = ["clustered(clusters=3, bits=8)", "improved_clustered(clusters=3, bits=8, topk=3)",
       "probsparse(factor=1)"]


@pytest.mark.parametrize("spec", ALL)
def test_out_equals_weights_at_v(spec):
    mech = build(spec)
    q, k, v = qkv(n=13, seed=7)
    res = run(mech, q, k, v, lengths_mask(13, [13, 6, 1]))
    torch.testing.assert_close(res.out, res.probs @ v, atol=1e-6, rtol=1e-6)
    sums = res.probs.sum(-1)  # [b,h,n]: real query rows are distributions, padded ones 0
    real = lengths_mask(13, [13, 6, 1])[:, None, :].expand_as(sums)
    torch.testing.assert_close(sums[real], torch.ones_like(sums[real]), atol=1e-6, rtol=0)
    assert (sums[~real] == 0).all() and (res.probs >= 0).all()


@pytest.mark.parametrize("spec", ALL)
def test_padded_queries_do_not_disturb_real_ones(spec):
    """Changing padded query vectors leaves every real row (and the padded rows: 0) as is."""
    mech = build(spec)
    q, k, v = qkv(n=13, seed=8)
    mask = lengths_mask(13, [13, 9, 5])
    pad = ~mask[:, None, :, None]
    q2 = torch.where(pad, torch.randn_like(q) * 10, q)
    a, b = run(mech, q, k, v, mask), run(mech, q2, k, v, mask)
    torch.testing.assert_close(a.out, b.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=1e-6)
    assert (a.out.masked_select(pad) == 0).all()


def test_padded_keys_get_zero_weight_and_lazy_mean_is_over_real_values():
    mech = build("probsparse(factor=1)")
    q, k, v = qkv(n=13, seed=9)
    mask = lengths_mask(13, [13, 7, 4])
    res = run(mech, q, k, v, mask)
    assert (res.probs.masked_select(~mask[:, None, None, :]) == 0).all()
    lazy = (res.probs - mask[:, None, None, :] / mask.sum(-1)[:, None, None, None]).abs()
    lazy = lazy.amax(-1) < 1e-7  # [b,h,n] rows equal to 1/L_b on the real keys
    _, u = mech.row_sizes(3, 13, 13, mask)  # u_b of each row's unpadded length
    assert (lazy.sum(-1) == (mask.sum(-1) - u)[:, None]).all()  # all real rows but u_b active
    mean_v = (v * mask[:, None, :, None]).sum(2) / mask.sum(-1)[:, None, None]  # [b,h,dv]
    got = res.out[lazy]  # lazy rows' outputs
    want = mean_v[:, :, None, :].expand_as(res.out)[lazy]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("name", ["clustered", "probsparse"])
def test_draws_are_seeded_per_layer_and_redrawn_in_training(name):
    spec = "clustered(clusters=3, bits=8)" if name == "clustered" else "probsparse(factor=1)"

    def draw(mech, layer=0):
        d = mech.draws(13, layer) if name == "clustered" else mech.draws(13, 13, layer)
        return torch.cat([t.float().flatten() for t in (d if name == "clustered" else [d])])

    mech = build(spec)
    assert torch.equal(draw(mech), draw(mech))  # eval: fixed per (seed, layer, n)
    assert not torch.equal(draw(mech, 0), draw(mech, 1))  # differs per layer
    other_seed = build(spec.replace("(", "(seed=1, "))
    assert not torch.equal(draw(mech), draw(other_seed))
    mech.train()
    torch.manual_seed(0)
    first, second = draw(mech), draw(mech)
    assert not torch.equal(first, second)  # training: fresh draws every call
    torch.manual_seed(0)  # through the global RNG: the run's seed fixes the draws
    fresh = build(spec).train()
    assert torch.equal(draw(fresh), first) and torch.equal(draw(fresh), second)
    torch.manual_seed(0)
    assert not torch.equal(draw(build(spec).train(), 1), first)  # and differ per layer
    torch.manual_seed(0)
    assert not torch.equal(draw(other_seed.train()), first)  # and per the config's seed


def test_training_forward_uses_the_draws():
    """A training call equals the functional form fed the draws of the same RNG state."""
    from attnlab.mechanisms.prototype import clustered_attention

    mech = build("clustered(clusters=3, bits=8)").train()
    twin = build("clustered(clusters=3, bits=8)").train()
    q, k, v = qkv(n=13, seed=10)
    for step in range(2):
        torch.manual_seed(step)
        out = mech(q, k, v, attnlab.AttnContext(layer_idx=1)).out
        torch.manual_seed(step)
        assign = cluster_queries(q, twin.draws(13, 1), torch.ones(3, 13, dtype=torch.bool), 3, 10)
        ref, _ = clustered_attention(q, k, v, assign, clusters=3)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("spec", ALL)
def test_dropout_only_in_training(spec):
    mech = build(spec)
    q, k, v = qkv(n=13, seed=11)
    a = mech(q, k, v, attnlab.AttnContext(dropout=0.5)).out
    b = mech(q, k, v, attnlab.AttnContext()).out
    assert torch.equal(a, b)


# ---------------------------------------------------------------- errors and surgery


@pytest.mark.parametrize("config,kwargs,match", [
    (ClusteredConfig, {"clusters": 0}, "clusters must be >= 1"),
    (ClusteredConfig, {"bits": 0}, "bits must be >= 1"),
    (ClusteredConfig, {"iterations": 0}, "iterations must be >= 1"),
    (ImprovedClusteredConfig, {"clusters": -1}, "clusters must be >= 1"),
    (ImprovedClusteredConfig, {"topk": 0}, "topk must be >= 1"),
    (ImprovedClusteredConfig, {"bits": -2}, "bits must be >= 1"),
    (ProbSparseConfig, {"factor": 0}, "factor must be >= 1"),
])
def test_bad_specs_are_clear_errors(config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(**kwargs)
    spec = config.name + "(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
    with pytest.raises(RegistryError, match=match):  # the spec path names the same fix
        attnlab.build_mechanism(spec, attnlab.HeadDims(H, D))


@pytest.mark.parametrize("config", [ClusteredConfig, ImprovedClusteredConfig, ProbSparseConfig])
def test_refuses_causal(config):
    mech = attnlab.build_mechanism(config(), attnlab.HeadDims(H, D))
    assert not mech.caps.causal_ok and mech.caps.family == "prototype"
    q, k, v = qkv(n=6)
    with pytest.raises(ValueError, match="cannot run causally"):
        mech(q, k, v, attnlab.AttnContext(causal=True))


def test_prototype_plan_on_tiny_bert_trains_one_step(bert_factory, padded_batch):
    plan = [
        {"layers": "all", "heads": [0, 1], "mechanism": "clustered(clusters=3, bits=8)"},
        {"layers": [1], "heads": [2, 3], "mechanism": "improved_clustered(clusters=3, topk=4)"},
        {"layers": [2], "heads": "all", "mechanism": "probsparse(factor=1)"},
    ]
    model = bert_factory()
    report, out, after = train_one_step(model, plan, padded_batch)
    assert report.table[0][:2] == [report.table[0][0]] * 2
    assert report.table[0][0].startswith("clustered(") and report.table[0][2] == "softmax"
    assert report.table[1][2].startswith("improved_clustered(")
    assert all(s.startswith("probsparse(") for s in report.table[2])
    assert not torch.equal(out, after)  # the step moved the model
