"""Right padding does not change a sequence's result, for every registered mechanism.

A sequence of ``real`` tokens alone, and the same sequence right-padded to n in a batch of two
(the other row a full sequence of n tokens; ``key_mask`` marks the real tokens), give the same
outputs on the real tokens in eval mode, causal and not (where ``caps.causal_ok``). Each
mechanism is built from its class's ``example`` and run as three consecutive layers sharing
one ``ctx.state`` (the layer-scope mechanisms pass scores or probabilities up the stack).
Tolerance 1e-5 (fp32).

A mechanism whose dependence on the padded length is part of its published method is listed
in ``INHERENT`` with the reason; its class docstring says so ("Padding: ..."), and its test
is a strict xfail, so the list stays exact. Every other registered mechanism, a new one
included, is checked by default. ``test_padding_invariance.py`` covers further
configurations of the prototype, memory and content families.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.core import mechanism_class

H, D, MAXLEN = 4, 8, 64
TOL = dict(atol=1e-5, rtol=1e-5)
LENGTHS = [(11, 24), (7, 8), (20, 61), (1, 5)]  # (real, padded n)
LAYERS = 3

INHERENT = {
    "bigbird": "the random blocks are drawn per (seed, layer, n) over the padded block count "
               "(and with last_global the padded last block is global), as google-research's "
               "and transformers' ITC code",
    "clustered": "the eval draws (hyperplanes, initial centroids) are seeded by the padded "
                 "length n",
    "improved_clustered": "the eval draws (hyperplanes, initial centroids) are seeded by the "
                          "padded length n",
    "lsh": "wrap=True (default, trax/HF): the first chunk looks back at the last chunk, the "
           "padded tail",
    "nystrom": "segments over the padded length, padded positions zeroed into the segment "
               "means (the official code and transformers)",
    "probsparse": "the eval key sample is seeded by, and drawn for, the padded length",
    "random": "the pattern is drawn by a generator seeded by the padded length n",
}

# configurations whose padding-dependent part is off (random blocks), or that exercise
# per-row sizes (csalr's landmark count capped at the row's real length)
VARIANTS = [
    "bigbird(block=4, window_blocks=3, num_random_blocks=0, global_blocks=2)",
    "csalr(num_landmarks=3)",
    "csalr(num_landmarks=16)",
    "csalr(num_landmarks=5, eps=0.3)",
]


def _cases():
    for name in attnlab.list_mechanisms():
        cls = mechanism_class(name)
        marks = ([pytest.mark.xfail(strict=True, raises=AssertionError, reason=INHERENT[name])]
                 if name in INHERENT else [])
        for causal in (False, True) if cls.caps.causal_ok else (False,):
            yield pytest.param(cls.example, causal, marks=marks, id=f"{name}-causal={causal}")
    for spec in VARIANTS:
        cls = mechanism_class(attnlab.core.parse_spec(spec)[0])
        for causal in (False, True) if cls.caps.causal_ok else (False,):
            yield pytest.param(spec, causal, id=f"{spec}-causal={causal}")


def _check(spec: str, causal: bool, real: int, n: int) -> None:
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, MAXLEN)).eval()
    shared_qk = mechanism_class(attnlab.core.parse_spec(spec)[0]).caps.shared_qk
    g = torch.Generator().manual_seed(real * 100 + n)
    mask = torch.arange(n)[None, :] < torch.tensor([[real], [n]])  # [2,n]: padded, full
    padded_state: dict = {}
    alone_state: dict = {}
    for layer in range(LAYERS):
        q, k, v = (torch.randn(2, H, n, D, generator=g) for _ in range(3))
        if shared_qk:
            k = q
        padded = mech(q, k, v, attnlab.AttnContext(
            key_mask=mask, causal=causal, layer_idx=layer, state=padded_state)).out
        alone = mech(q[:1, :, :real], k[:1, :, :real], v[:1, :, :real], attnlab.AttnContext(
            causal=causal, layer_idx=layer, state=alone_state)).out
        where = f"real={real}, n={n}, layer {layer}"
        torch.testing.assert_close(padded[:1, :, :real], alone, **TOL,
                                   msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.parametrize("spec,causal", list(_cases()))
def test_right_padding_leaves_the_real_tokens_unchanged(spec, causal):
    for real, n in LENGTHS:
        _check(spec, causal, real, n)


def test_inherent_exceptions_are_registered_and_documented():
    names = attnlab.list_mechanisms()
    for name in INHERENT:
        assert name in names, f"{name} is listed as an exception but not registered"
        doc = mechanism_class(name).__doc__ or ""
        assert "Padding:" in doc, f"{name}'s docstring must say how padding changes a row"


def test_csalr_rows_of_one_batch_each_match_their_sequence_alone():
    """Rows of 19, 12, 5, 3 and 0 real tokens padded to 19 (4 landmarks): each row's real
    outputs equal its sequence alone (a row of 3 has 3 landmarks, one per token); padded
    query rows and the empty row output zeros; padded keys get no weight."""
    mech = attnlab.build_mechanism("csalr(num_landmarks=4)", attnlab.HeadDims(H, D)).eval()
    n, lengths = 19, [19, 12, 5, 3, 0]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(len(lengths), H, n, D, generator=g) for _ in range(3))
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    res = mech(q, k, v, attnlab.AttnContext(key_mask=mask, need_weights=True))
    for b, length in enumerate(lengths):
        if length:
            alone = mech(q[b:b + 1, :, :length], k[b:b + 1, :, :length],
                         v[b:b + 1, :, :length], attnlab.AttnContext(need_weights=True))
            torch.testing.assert_close(res.out[b:b + 1, :, :length], alone.out, **TOL)
            torch.testing.assert_close(res.probs[b:b + 1, :, :length, :length], alone.probs,
                                       **TOL)
        assert (res.out[b, :, length:] == 0).all()
        assert (res.probs[b, :, length:] == 0).all() and (res.probs[b, :, :, length:] == 0).all()
    torch.testing.assert_close(res.probs @ v, res.out, **TOL)
