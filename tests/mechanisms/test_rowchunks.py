"""Query rows in checkpointed chunks (``_rowchunks``) for the mechanisms with explicit
scores: outputs and the gradients of q, k, v and the parameters equal the dense form's
(``need_weights``, which keeps the whole [b, h, n, m]) to 1e-5 (fp32), with chunks that do
not divide n, a key mask, causal masking and n != m; attention dropout's masks are redrawn
identically in the recomputation; and training keeps far less than one [b, h, n, m]."""

from __future__ import annotations

import pytest
import torch
from saved import kept_for_backward

import attnlab
from attnlab.mechanisms import _rowchunks
from attnlab.mechanisms.priors import REALFORMER_STATE_KEY, ResidualScores

TOL = {"atol": 1e-5, "rtol": 1e-5}
# (spec, whether it takes n != m)
CASES = [("gaussian_transformer(w_init=0.5, b_init=-0.5)", True), ("gaussian_prior", True),
         ("talking_heads(init='random')", True),
         ("synthesizer(kind='dense', factorized=True, a=8, mix=0.5)", True),
         ("synthesizer(kind='random', mix=0.5)", False),
         ("camtl_prior(tasks=3, blocks=4, task_dim=8, task=1)", False),
         ("disagreement", True), ("disagreement(terms=['output'])", True),
         ("pattern_loss(patterns=['prev', 'bow'])", True),
         ("pattern_loss(patterns=['next', 'first'])", True),
         ("pattern_loss(patterns=['none'])", True)]
SPECS = [spec for spec, _ in CASES]


def _build(spec: str, max_len: int = 64):
    """The mechanism in training mode, every parameter drawn at random (camtl_prior's
    prior starts at 0, the talking-heads mixes at I)."""
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(2, 8, max_len)).train()
    with torch.no_grad():
        for p in mech.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return mech


def _inputs(n: int, m: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2, n, 8, generator=g).requires_grad_()
    k, v = (torch.randn(3, 2, m, 8, generator=g).requires_grad_() for _ in range(2))
    return q, k, v


def _grads(mech, out, inputs, aux=None):
    """Gradients of q, k, v and the parameters of sum(out * G) (+ the auxiliary loss)."""
    params = [p for p in mech.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(9)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    if aux is not None:
        loss = loss + aux
    return torch.autograd.grad(loss, [*inputs, *params])


@pytest.mark.parametrize("spec, unequal", CASES)
@pytest.mark.parametrize("causal, n, m", [(False, 13, 13), (True, 13, 13), (True, 11, 13),
                                          (False, 11, 13)])
def test_chunks_equal_the_dense_form(monkeypatch, spec, unequal, causal, n, m):
    if n != m and not unequal:
        pytest.skip(f"{spec} indexes one sequence's positions (n == m)")
    monkeypatch.setattr(_rowchunks, "CHUNK_ELEMS", 3 * 2 * 3 * m)  # 3 rows a chunk
    assert _rowchunks.rows_per_chunk(3, 2, m) == 3
    mech = _build(spec)
    q, k, v = _inputs(n, m)
    key_mask = torch.arange(m)[None] < torch.tensor([m, m - 4, 5])[:, None]
    ctx = attnlab.AttnContext(key_mask=key_mask, causal=causal)
    chunked = mech(q, k, v, ctx)
    dense = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, causal=causal,
                                              need_weights=True))
    torch.testing.assert_close(chunked.out, dense.out, **TOL)
    assert (chunked.aux_loss is None) == (dense.aux_loss is None)
    if dense.aux_loss is not None:  # disagreement's -D, its position term from the chunks
        torch.testing.assert_close(chunked.aux_loss, dense.aux_loss, **TOL)
    for a, r in zip(_grads(mech, chunked.out, (q, k, v), chunked.aux_loss),
                    _grads(mech, dense.out, (q, k, v), dense.aux_loss), strict=True):
        torch.testing.assert_close(a, r, **TOL)


@pytest.mark.parametrize("spec", SPECS)
def test_dropout_masks_are_redrawn_identically(monkeypatch, spec):
    """The backward through the checkpoints equals the backward of the same chunks run
    without checkpoints (same seed, so the same dropout masks in the forward)."""
    monkeypatch.setattr(_rowchunks, "CHUNK_ELEMS", 3 * 2 * 4 * 13)
    mech = _build(spec)
    ctx = attnlab.AttnContext(dropout=0.3)
    results = []
    for plain in (False, True):
        if plain:
            monkeypatch.setattr(_rowchunks, "checkpoint",
                                lambda fn, *args, **kwargs: fn(*args))
        q, k, v = _inputs(13, 13)
        torch.manual_seed(5)
        out = mech(q, k, v, ctx).out
        results.append((out, _grads(mech, out, (q, k, v))))
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_training_keeps_less_than_one_score_tensor(spec):
    """What autograd keeps for the backward (unique storages) at n = 1024: under half of
    one [b, h, n, m] float32 tensor (the dense form keeps several)."""
    mech = _build(spec, max_len=1024)
    q, k, v = _inputs(1024, 1024)

    with kept_for_backward() as kept:
        out = mech(q, k, v, attnlab.AttnContext()).out
    one_scores = 3 * 2 * 1024 * 1024 * 4
    assert kept.bytes < one_scores / 2
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("causal", [False, True])
def test_realformer_chunks_pass_the_same_scores_up(monkeypatch, causal):
    """Two realformer layers: the chunked form passes the same S_l up (through ctx.state)
    and gives the same outputs and gradients as the dense form; of the [b, h, n, m]
    tensors the second layer keeps little more than the S_l it passes up."""
    from attnlab.mechanisms import priors

    monkeypatch.setattr(_rowchunks, "CHUNK_ELEMS", 3 * 2 * 3 * 13)
    monkeypatch.setattr(priors, "FACTORED_SHORT_WIDTH", 0)  # the explicit form at n = 13
    layers = [attnlab.build_mechanism("realformer", attnlab.HeadDims(2, 8, 64)).train()
              for _ in range(2)]
    key_mask = torch.arange(13)[None] < torch.tensor([13, 9, 5])[:, None]
    results = []
    for weights in (False, True):
        q, k, v = _inputs(13, 13)
        state: dict = {}
        out = q
        for i, layer in enumerate(layers):
            ctx = attnlab.AttnContext(key_mask=key_mask, causal=causal, layer_idx=i,
                                      state=state, need_weights=weights)
            out = layer(out, k, v, ctx).out
        scores = state[REALFORMER_STATE_KEY].scores
        g = torch.Generator().manual_seed(9)
        loss = (out * torch.randn(out.shape, generator=g)).sum() + scores.square().sum()
        results.append((out, scores, *torch.autograd.grad(loss, (q, k, v))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_realformer_keeps_the_scores_it_passes_up_and_no_more():
    """A second realformer layer in training keeps S_{l-1} (its input) and under half of
    one more [b, h, n, m]; the dense form keeps several."""
    n = 1024
    layer = attnlab.build_mechanism("realformer", attnlab.HeadDims(2, 8, n)).train()
    q, k, v = _inputs(n, n)
    prev = torch.randn(3, 2, n, n, requires_grad=True)
    state = {REALFORMER_STATE_KEY: ResidualScores(prev, 0)}

    with kept_for_backward() as kept:
        layer(q, k, v, attnlab.AttnContext(layer_idx=1, state=state))
    one_scores = 3 * 2 * n * n * 4
    assert kept.bytes < 1.5 * one_scores  # prev (an input) and a little more
