"""``routing`` (Routing Transformer): naive reference, one-cluster = softmax, EMA, surgery.

Tolerances: fp32 outputs, probabilities and gradients vs the naive references 1e-5;
the EMA step vs its hand computation 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plan_step import train_one_step

import attnlab
from attnlab.mechanisms.content import (
    RoutingConfig,
    routing_attention,
    routing_centroids,
    routing_windows,
)

D = 8


def qkv(b=3, h=2, n=13, m=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    return (torch.randn(b, h, n, D, generator=g), torch.randn(b, h, m, D, generator=g),
            torch.randn(b, h, m, D, generator=g))


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [b,n]


def ln(x, eps=1e-5):
    """Layer norm without scale/bias, written out: (x - mean) / sqrt(var + eps)."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def masked(s, allowed):
    any_ = allowed.any(-1, keepdim=True)
    s = s.masked_fill(~allowed, float("-inf")).masked_fill(~any_, 0.0)
    return torch.softmax(s, -1) * any_


def members(sim, w):
    """Explicit membership [b,h,k,len]: the w largest similarities per cluster (stable sort)."""
    order = torch.sort(sim, dim=-1, descending=True, stable=True).indices[..., :w]
    return torch.zeros_like(sim, dtype=torch.bool).scatter(-1, order, True)


def naive_routing(q, k, v, mu, window, key_mask=None):
    """Membership masks per cluster, a dense masked softmax per cluster over all n x m pairs,
    outputs averaged over the clusters keeping each query. Returns (out, probs)."""
    b, h, n, d = q.shape
    m = k.shape[2]
    valid = torch.ones(b, m, dtype=torch.bool) if key_mask is None else key_mask
    qn, kn = ln(q), ln(k)
    s = qn @ kn.transpose(-1, -2) / d**0.5  # [b,h,n,m]
    qs = torch.einsum("bhnd,hcd->bhcn", qn / d**0.5, mu)
    ks = torch.einsum("bhmd,hcd->bhcm", kn / d**0.5, mu)
    ks = ks.masked_fill(~valid[:, None, None, :], float("-inf"))
    if key_mask is not None and n == m:
        qs = qs.masked_fill(~valid[:, None, None, :], float("-inf"))
    mq, mk = [], []  # per row: window 0 keeps ceil(L_b / k) of the row's unpadded length
    for bi in range(b):
        k_len = int(valid[bi].sum()) if key_mask is not None else m
        q_len = k_len if (key_mask is not None and n == m) else n
        wq, wk = routing_windows(window, mu.shape[1], q_len, k_len)
        mq.append(members(qs[bi], wq))
        mk.append(members(ks[bi], wk))
    mq, mk = torch.stack(mq), torch.stack(mk)  # [b,h,k,n], [b,h,k,m]
    out = torch.zeros(b, h, n, v.shape[-1])
    probs = torch.zeros(b, h, n, m)
    for c in range(mu.shape[1]):
        allowed = mq[:, :, c, :, None] & mk[:, :, c, None, :] & valid[:, None, None, :]
        p = masked(s, allowed) * mq[:, :, c, :, None]
        out, probs = out + p @ v, probs + p
    count = mq.sum(2).clamp(min=1)[..., None]  # [b,h,n,1]
    return out / count, probs / count


def test_one_cluster_equals_dense_softmax_over_normalised_q_k():
    q, k, v = (t.requires_grad_() for t in qkv(n=11))
    mask = lengths_mask(11, [11, 6, 2])
    real = mask[:, None, :, None]  # padded query rows: 0 with window 0 (outside w_b), unused
    for spec in ("routing(num_clusters=1)", "routing(num_clusters=1, window=40)"):
        mech = attnlab.build_mechanism(spec, attnlab.HeadDims(2, D)).eval()
        out = mech(q, k, v, attnlab.AttnContext(key_mask=mask)).out * real
        ref, _ = attnlab.reference_attention(ln(q), ln(k), v, key_mask=mask)
        ref = ref * real
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        g = torch.randn_like(out)
        for a, r in zip(torch.autograd.grad(out, (q, k, v), g),
                        torch.autograd.grad(ref, (q, k, v), g), strict=True):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("clusters,window,n,m,padded", [
    (3, 5, 13, 13, False), (3, 5, 13, 13, True), (4, 0, 19, 19, True), (2, 3, 7, 7, False),
    (5, 2, 9, 9, True), (3, 4, 6, 10, True), (3, 4, 10, 6, False), (3, 0, 13, 13, False),
    (3, 0, 9, 14, True),
])
def test_matches_naive_reference(clusters, window, n, m, padded):
    q, k, v = (t.requires_grad_() for t in qkv(n=n, m=m, seed=n + m))
    mask = lengths_mask(m, [m, max(1, m - 4), 2]) if padded else None
    mu = routing_centroids(RoutingConfig(num_clusters=clusters), 2, D)
    out, probs = routing_attention(q, k, v, mu, window=window, key_mask=mask, need_weights=True)
    ref, pref = naive_routing(q, k, v, mu, window, mask)
    # padded queries (self-attention) tie at -inf: which of them fill a cluster is arbitrary,
    # so only real query rows are compared
    real = (mask if (padded and n == m) else torch.ones(3, n, dtype=torch.bool))[:, None, :, None]
    out, ref, probs, pref = out * real, ref * real, probs * real, pref * real
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, pref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g, retain_graph=True)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # without weights: each cluster's softmax on SDPA (no scores kept), same values
    fast, none = routing_attention(q, k, v, mu, window=window, key_mask=mask)
    assert none is None
    torch.testing.assert_close(fast * real, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(torch.autograd.grad(fast * real, (q, k, v), g), grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_a_sequence_of_padding_only_gives_zeros_and_finite_gradients():
    """Its clusters have no valid key: 0 on both paths (SDPA would give NaN for an all -inf
    row), no NaN in the gradients, and the other sequences as the naive reference."""
    q, k, v = (t.requires_grad_() for t in qkv(n=10, m=12, seed=5))
    mask = lengths_mask(12, [12, 0, 3])
    mu = routing_centroids(RoutingConfig(num_clusters=3), 2, D)
    ref, _ = naive_routing(q, k, v, mu, 4, mask)
    for need_weights in (False, True):
        out, _ = routing_attention(q, k, v, mu, window=4, key_mask=mask,
                                   need_weights=need_weights)
        assert (out[1] == 0).all()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert all(torch.isfinite(gr).all() for gr in grads)


def test_pattern_is_sparse_and_unrouted_queries_get_zeros():
    q, k, v = qkv(n=19)
    mu = routing_centroids(RoutingConfig(num_clusters=2, seed=1), 2, D)
    out, probs = routing_attention(q, k, v, mu, window=3, need_weights=True)
    assert probs is not None and (probs > 0).float().mean() < 0.2  # <= 2 * 3 * 3 of 19 * 19
    unrouted = probs.sum(-1) == 0  # [b,h,n]: at most 6 of 19 queries are kept
    assert unrouted.any()
    assert torch.isfinite(out).all() and (out[unrouted] == 0).all()


def test_centroids_seeded_and_update_only_in_training():
    dims = attnlab.HeadDims(2, D)
    a = attnlab.build_mechanism("routing(num_clusters=3, seed=4)", dims)
    b = attnlab.build_mechanism("routing(num_clusters=3, seed=4)", dims)
    c = attnlab.build_mechanism("routing(num_clusters=3, seed=5)", dims)
    assert torch.equal(a.centroids, b.centroids) and not torch.equal(a.centroids, c.centroids)
    assert a.centroids.shape == (2, 3, D)
    torch.testing.assert_close(a.centroids.norm(dim=-1), torch.ones(2, 3))
    assert "centroids" in a.state_dict()
    q, k, v = qkv(n=13)
    before = a.centroids.clone()
    a.eval()
    o1 = a(q, k, v, attnlab.AttnContext()).out
    o2 = a(q, k, v, attnlab.AttnContext()).out
    assert torch.equal(a.centroids, before) and torch.equal(o1, o2)
    a.train()
    a(q, k, v, attnlab.AttnContext())
    assert not torch.equal(a.centroids, before)
    torch.testing.assert_close(a.centroids.norm(dim=-1), torch.ones(2, 3))


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_ema_step_is_the_normalised_mean_of_members(decay):
    dims = attnlab.HeadDims(2, D)
    mech = attnlab.build_mechanism(f"routing(num_clusters=3, decay={decay})", dims).train()
    q, k, v = qkv(n=9)
    mask = lengths_mask(9, [9, 5, 1])
    mu = mech.centroids.clone()
    mech(q, k, v, attnlab.AttnContext(key_mask=mask))
    x = torch.cat([ln(q), ln(k)], 2) / D**0.5  # [b,h,2n,d]
    valid = torch.cat([mask, mask], 1)  # self-attention: padded queries skipped too
    for hh in range(2):
        for c in range(3):
            near = torch.einsum("btd,cd->btc", x[:, hh], mu[hh]).argmax(-1) == c  # [b,2n]
            sel = x[:, hh][near & valid]
            want = mu[hh, c] if len(sel) == 0 else F.normalize(
                decay * mu[hh, c] + (1 - decay) * sel.mean(0), dim=-1)
            torch.testing.assert_close(mech.centroids[hh, c], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_clusters": 0}, "num_clusters must be >= 1"), ({"window": -1}, "window must be >= 0"),
    ({"decay": 1.0}, "decay must be in"), ({"eps": 0.0}, "eps must be > 0"),
])
def test_bad_specs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**kwargs)
    spec = "routing(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
    with pytest.raises(Exception, match=match):
        attnlab.build_mechanism(spec, attnlab.HeadDims(2, D))


def test_refuses_causal():
    mech = attnlab.build_mechanism("routing(num_clusters=2)", attnlab.HeadDims(2, D))
    q, k, v = qkv(n=6)
    with pytest.raises(ValueError, match="causal"):
        mech(q, k, v, attnlab.AttnContext(causal=True))


def test_routing_plan_on_tiny_bert_forward_and_training_step(bert_factory, padded_batch):
    plan = [
        {"layers": "all", "heads": [0, 2], "mechanism": "routing(num_clusters=3, window=4)"},
        {"layers": [1], "heads": "all", "mechanism": "routing(num_clusters=2)"},
    ]
    model = bert_factory()
    report, out, after = train_one_step(model, plan, padded_batch)
    assert report.table[0][0].startswith("routing(") and report.table[0][1] == "softmax"
    assert report.counts["softmax"] == 4 and sum(report.counts.values()) == 12
    fresh = bert_factory()
    attnlab.apply_plan(fresh, plan)  # the seeded initial centroids
    start = {n: b for n, b in fresh.named_buffers() if n.endswith("centroids")}
    now = {n: b for n, b in model.named_buffers() if n.endswith("centroids")}
    assert len(start) == 3 and start.keys() == now.keys()
    assert all(not torch.equal(start[n], now[n]) for n in start)  # moved in training
    frozen = {n: b.clone() for n, b in now.items()}
    with torch.no_grad():  # eval: no update
        model(**padded_batch)
    assert all(torch.equal(frozen[n], b) for n, b in model.named_buffers() if n in frozen)
