"""``lsh`` (Reformer LSH attention): naive references, Hugging Face parity, specs, surgery.

Tolerances: fp32 outputs, probabilities and gradients vs the naive references 1e-5;
Hugging Face ``LSHSelfAttention`` parity 1e-5 (real tokens); hash buckets exactly equal.
"""

from __future__ import annotations

import pytest
import torch
from plan_step import train_one_step
from saved import kept_for_backward

import attnlab
from attnlab.mechanisms.content import SELF_SCORE, LSHConfig, lsh_attention, lsh_buckets

D = 8


def qv(b=3, h=2, n=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, D, generator=g), torch.randn(b, h, n, D, generator=g)


def lengths_mask(n, lengths):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [b,n]


def shared_scores(q, eps=1e-6):
    """Dense shared-QK scores [b,h,n,n]: q_i . (q_j / sqrt(mean(q_j^2)+eps)) / sqrt(d), s_ii
    = SELF_SCORE (the paper's self-mask)."""
    keys = q / torch.sqrt(q.square().mean(-1, keepdim=True) + eps)
    s = q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5
    eye = torch.eye(q.shape[2], dtype=torch.bool)
    return s.masked_fill(eye, SELF_SCORE)


def masked_round(s, allowed):
    """Dense masked softmax of one round: probs [b,h,n,n], log-normaliser z [b,h,n], row has key."""
    any_ = allowed.any(-1)
    s = s.masked_fill(~allowed, float("-inf")).masked_fill(~any_[..., None], 0.0)
    z = torch.logsumexp(s, -1)
    return torch.exp(s - z[..., None]) * any_[..., None], z, any_


def naive_lsh(q, v, rotations, buckets, chunk, key_mask=None, wrap=True):
    """Explicit per-round bucket/chunk masks, a dense masked softmax per round, logsumexp
    combination of the rounds. Returns (out [b,h,n,d], probs [b,h,n,n])."""
    b, h, n, _ = q.shape
    valid = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask
    s = shared_scores(q)
    c = min(chunk, n)
    nc = -(-n // c)
    outs, zs, founds, probs = [], [], [], []
    for r in range(rotations.shape[2]):
        if buckets == 1:
            ids = torch.zeros(b, h, n, dtype=torch.long)
        else:
            ids = torch.empty(b, h, n, dtype=torch.long)
            for hh in range(h):
                proj = q[:, hh] @ rotations[hh, :, r, :]  # [b,n,buckets/2]
                ids[:, hh] = torch.cat([proj, -proj], -1).argmax(-1)
        ids = torch.where(valid[:, None, :], ids, buckets)  # padding: an extra last bucket
        # rank of each token in the (bucket, position) order, then its chunk
        order = torch.argsort(ids * n + torch.arange(n), dim=-1)
        rank = torch.argsort(order, dim=-1)
        ch = rank // c  # [b,h,n]
        ci, cj = ch[..., :, None], ch[..., None, :]
        prev = (ci - 1) % nc if wrap else ci - 1
        window = (cj == ci) | ((cj == prev) & (nc > 1))
        allowed = window & valid[:, None, None, :]
        p, z, f = masked_round(s, allowed)
        outs.append(p @ v)
        zs.append(z)
        founds.append(f)
        probs.append(p)
    z, f = torch.stack(zs, -1), torch.stack(founds, -1)  # [b,h,n,r]
    w = torch.softmax(z.masked_fill(~f, float("-inf")).masked_fill(~f.any(-1, keepdim=True), 0),
                      -1) * f.any(-1, keepdim=True)
    out = sum(w[..., r, None] * outs[r] for r in range(len(outs)))
    dense = sum(w[..., r, None] * probs[r] for r in range(len(probs)))
    return out, dense


# ------------------------------------------------------------------ dense special case


@pytest.mark.parametrize("spec", ["lsh(buckets=1, chunk=16, num_hashes=1)",
                                  "lsh(buckets=4, chunk=16, num_hashes=3)"])
def test_one_chunk_equals_dense_shared_qk_softmax_with_self_mask(spec):
    n = 13
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(2, D, 64)).eval()
    q, v = qv(n=n)
    k = torch.randn_like(q)  # ignored: shared QK
    key_mask = lengths_mask(n, [13, 6, 1])
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, need_weights=True))
    # naive dense reference: softmax over all unpadded tokens, keys = normalised queries
    s = shared_scores(q).masked_fill(~key_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(s, -1)
    torch.testing.assert_close(res.out, probs @ v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.probs, probs, atol=1e-5, rtol=1e-5)
    # the self-mask: no weight on the diagonal unless the token is alone (row 2 has 1 token)
    assert res.probs[0].diagonal(dim1=-2, dim2=-1).max() < 1e-6
    torch.testing.assert_close(res.out[2, :, 0], v[2, :, 0], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ general case


@pytest.mark.parametrize("buckets,chunk,rounds,wrap,n", [
    (4, 4, 1, True, 16), (4, 3, 2, True, 13), (8, 2, 3, True, 11), (2, 5, 2, False, 13),
    (4, 4, 4, False, 7), (1, 3, 2, True, 10), (6, 4, 2, True, 2),
])
@pytest.mark.parametrize("weights", [True, False])
def test_matches_naive_reference(buckets, chunk, rounds, wrap, n, weights):
    """Outputs, weights and gradients against the loops; without weights the attention
    runs under a checkpoint (recomputed in the backward)."""
    spec = f"lsh(buckets={buckets}, chunk={chunk}, num_hashes={rounds}, wrap={wrap}, seed=5)"
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(2, D, 64)).eval()
    q, v = qv(n=n, seed=n + buckets)
    q.requires_grad_()
    v.requires_grad_()
    key_mask = lengths_mask(n, [n, max(1, n - 4), 0])
    ctx = attnlab.AttnContext(key_mask=key_mask, layer_idx=2, need_weights=weights)
    res = mech(q, torch.zeros_like(q), v, ctx)
    ref, ref_probs = naive_lsh(q, v, mech.rotations(2), buckets, chunk, key_mask, wrap)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    if not weights:
        assert res.probs is None
        res = mech(q, torch.zeros_like(q), v, attnlab.AttnContext(
            key_mask=key_mask, layer_idx=2, need_weights=True))  # for the checks below
    torch.testing.assert_close(res.probs, ref_probs, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(res.out, (q, v), g)
    grads_ref = torch.autograd.grad(ref, (q, v), g)
    for a, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # padded keys are never attended; the fully padded sequence gives zeros
    assert (res.probs[1][..., max(1, n - 4):] == 0).all()
    assert (res.out[2] == 0).all() and (res.probs[2] == 0).all()


def test_training_recomputes_the_rounds_with_their_dropout_masks(monkeypatch):
    """Without weights the attention runs under a checkpoint: with attention dropout the
    gradients equal those of the same call without it (same seed, so the same masks), and
    autograd keeps less than the window scores [b, h, r, n, 2C]."""
    from attnlab.mechanisms import content

    n, rounds, chunk = 64, 2, 8
    mech = attnlab.build_mechanism(f"lsh(buckets=4, chunk={chunk}, num_hashes={rounds})",
                                   attnlab.HeadDims(2, D, 64)).train()
    results = []
    for plain in (False, True):
        if plain:
            monkeypatch.setattr(content, "checkpoint", lambda fn, *a, **kw: fn(*a))
        q, v = qv(n=n, seed=3)
        q.requires_grad_()
        v.requires_grad_()

        torch.manual_seed(4)
        with kept_for_backward() as kept:
            out = mech(q, torch.zeros_like(q), v, attnlab.AttnContext(dropout=0.3)).out
        out.sum().backward()
        results.append((out.detach(), q.grad, v.grad, kept.bytes))
    for a, b in zip(results[0][:3], results[1][:3], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    scores = q.shape[0] * 2 * rounds * n * 2 * chunk * 4  # bytes of the window scores
    assert results[0][3] < scores < results[1][3]


def test_pattern_is_sparse_and_rounds_differ():
    n = 16
    mech = attnlab.build_mechanism("lsh(buckets=4, chunk=4, num_hashes=2)",
                                   attnlab.HeadDims(2, D, 64)).eval()
    q, v = qv(n=n)
    probs = mech(q, q, v, attnlab.AttnContext(need_weights=True)).probs
    assert ((probs > 0).sum(-1) <= 2 * 2 * 4).all()  # <= rounds * window keys
    assert (probs > 0).float().mean() < 0.9
    ids = lsh_buckets(q, mech.rotations(0), 4, None)
    assert not torch.equal(ids[:, :, 0], ids[:, :, 1])


def test_rotations_seeded_per_layer_and_seed():
    dims = attnlab.HeadDims(2, D, 64)
    a = attnlab.build_mechanism("lsh(buckets=4, num_hashes=2)", dims)
    b = attnlab.build_mechanism("lsh(buckets=4, num_hashes=2, seed=1)", dims)
    assert a.rotations(0).shape == (2, D, 2, 2)
    assert torch.equal(a.rotations(0), a.rotations(0))
    assert not torch.equal(a.rotations(0), a.rotations(1))
    assert not torch.equal(a.rotations(0), b.rotations(0))


# ------------------------------------------------------------------ Hugging Face parity


def _hf_lsh(num_hashes=1, num_buckets=4, chunk=4, seed=123):
    from transformers import ReformerConfig
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention

    torch.manual_seed(0)
    cfg = ReformerConfig(
        hidden_size=16, num_attention_heads=2, attention_head_size=D, attn_layers=["lsh"],
        num_hashes=num_hashes, num_buckets=num_buckets, lsh_attn_chunk_length=chunk,
        lsh_num_chunks_before=1, lsh_num_chunks_after=0, hash_seed=seed, is_decoder=False,
        lsh_attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
    )
    return LSHSelfAttention(cfg, layer_idx=0).eval()


def _hf_rotations(att, num_hashes, num_buckets, seed=123):
    """The rotations ``_hash_vectors`` draws: manual_seed(hash_seed); randn(h, d, r, nb/2)."""
    torch.manual_seed(seed)
    return torch.randn(att.num_attention_heads, D, num_hashes, num_buckets // 2)


def _split(att, x, lin):
    b, n, _ = x.shape
    return lin(x).view(b, n, att.num_attention_heads, D).transpose(1, 2)  # [b,h,n,d]


@pytest.mark.parametrize("n,padded", [(16, False), (16, True), (12, True), (4, True)])
def test_matches_hugging_face_lsh_self_attention(n, padded):
    """One hashing round: HF's LSHSelfAttention (query_key / value weights, its rotations
    from hash_seed, its length-normalised keys / sqrt(d) and its self-mask) is reproduced
    on every real token. n = 4 <= chunk exercises HF's full-attention path.

    Not compared: several rounds. HF (as trax) chunks the concatenation of all rounds'
    sorted orders, so the first chunk of round r also sees the tail of round r-1; lsh
    chunks each round on its own (the paper's description). The hashing itself matches
    for several rounds (test below). Padded query rows differ (HF lets a pad attend to
    itself; lsh never attends a padded key); their outputs are unused.
    """
    att = _hf_lsh()
    b = 3
    x = torch.randn(b, n, 16)
    mask = lengths_mask(n, [n, n - 3, 2]) if padded else torch.ones(b, n, dtype=torch.bool)
    with torch.no_grad():
        ref = att(x, attention_mask=mask.long() if padded else None).hidden_states  # [b,n,h*d]
        qk, v = _split(att, x, att.query_key), _split(att, x, att.value)
        out, _ = lsh_attention(qk, v, _hf_rotations(att, 1, 4), buckets=4, chunk=4,
                               key_mask=mask if padded else None)
    out = out.transpose(1, 2).reshape(b, n, -1)
    torch.testing.assert_close(out[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_hashes,padded", [(1, False), (3, True)])
def test_hashing_matches_hugging_face(num_hashes, padded):
    att = _hf_lsh(num_hashes=num_hashes, num_buckets=8)
    b, n = 2, 16
    x = torch.randn(b, n, 16)
    mask = lengths_mask(n, [n, 9]) if padded else None
    with torch.no_grad():
        qk = _split(att, x, att.query_key)
        hf = att._hash_vectors(qk, num_hashes, None if mask is None else mask.long())
        ours = lsh_buckets(qk, _hf_rotations(att, num_hashes, 8), 8, mask)  # [b,h,r,n]
    # HF offsets round r by r * (buckets + 1 if any padding else buckets), rounds flattened
    per_round = 8 + (1 if padded else 0)
    hf = hf.view(b, 2, num_hashes, n) - per_round * torch.arange(num_hashes)[:, None]
    assert torch.equal(ours, hf)


# ------------------------------------------------------------------ specs and errors


@pytest.mark.parametrize("kwargs,match", [
    ({"buckets": 0}, "buckets must be 1"), ({"buckets": 3}, "even"),
    ({"chunk": 0}, "chunk must be >= 1"), ({"num_hashes": 0}, "num_hashes must be >= 1"),
])
def test_bad_specs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LSHConfig(**kwargs)
    spec = "lsh(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
    with pytest.raises(Exception, match=match):
        attnlab.build_mechanism(spec, attnlab.HeadDims(2, D))


def test_refuses_causal_and_cross_attention():
    mech = attnlab.build_mechanism("lsh(buckets=2, chunk=2)", attnlab.HeadDims(2, D))
    q, v = qv(n=6)
    with pytest.raises(ValueError, match="causal"):
        mech(q, q, v, attnlab.AttnContext(causal=True))
    with pytest.raises(ValueError, match="as many queries as keys"):
        mech(q, q[:, :, :4], v[:, :, :4], attnlab.AttnContext())


# ------------------------------------------------------------------ in a plan


def test_lsh_plan_on_tiny_bert_forward_and_training_step(bert_factory, padded_batch):
    plan = [
        {"layers": "all", "heads": [0, 2], "mechanism": "lsh(buckets=4, chunk=4, num_hashes=2)"},
        {"layers": [1], "heads": "all", "mechanism": "lsh(buckets=2, chunk=3)"},
    ]
    report, out, after = train_one_step(bert_factory(), plan, padded_batch)
    assert report.table[0][0].startswith("lsh(") and report.table[0][1] == "softmax"
    assert report.table[1] == [report.table[1][0]] * 4 and "chunk=3" in report.table[1][0]
    assert report.counts["softmax"] == 4 and sum(report.counts.values()) == 12
    assert not torch.allclose(after, out)
