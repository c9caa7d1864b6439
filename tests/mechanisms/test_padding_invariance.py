"""Right padding does not change a row: a sequence alone and the same sequence padded in a
batch give the same outputs on its real tokens (eval mode, deterministic mechanisms).

Covers the prototype, memory and content families whose result has no random draw that
depends on the padded length: ``routing`` (window 0 keeps ceil(L_b / k) per cluster of the
row's own length), ``poolingformer`` (a slot's span ends at its last real token),
``probsparse`` at u = n, ``clustered`` at C >= n, ``mca``, ``isab``, ``luna``, ``sac`` and
``lsh`` without wrap (with wrap the first chunk looks back at the padded tail, as trax/HF).
Also checks ``probsparse``'s per-row sizes under padding. Tolerance 1e-5 (fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab

H, D = 2, 8
TOL = dict(atol=1e-5, rtol=1e-5)

SPECS = [
    "routing(num_clusters=3)",
    "routing(num_clusters=4, window=0)",
    "poolingformer(window=1, window2=4, pool_size=3)",
    "poolingformer(window=2, window2=6, pool_size=4, stride=3, pool='max')",
    "poolingformer(window=1, window2=5, pool_size=3, pool='conv', stacked=False)",
    "probsparse(factor=100)",
    "clustered(clusters=64)",
    "improved_clustered(clusters=64, topk=3)",
    "mca(compression=3)",
    "mca(compression=2, local_block=4)",
    "isab(num_inducing=4)",
    "luna(num_memory=4)",
    "sac(k=3, hidden=8)",
    "lsh(buckets=4, chunk=4, num_hashes=2, wrap=False)",
]


def _qkv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, n, D, generator=g) for _ in range(3))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("real,n", [(11, 24), (7, 8), (20, 61)])
def test_right_padding_leaves_the_real_tokens_unchanged(spec, causal, real, n):
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(H, D, 128)).eval()
    if causal and not mech.caps.causal_ok:
        pytest.skip(f"{spec} is not causal")
    q, k, v = _qkv(n, seed=real * 100 + n)
    if mech.caps.shared_qk:
        k = q
    mask = torch.arange(n)[None, :] < real  # [1,n]
    padded = mech(q, k, v, attnlab.AttnContext(key_mask=mask, causal=causal, state={})).out
    alone = mech(q[:, :, :real], k[:, :, :real], v[:, :, :real],
                 attnlab.AttnContext(causal=causal, state={})).out
    torch.testing.assert_close(padded[:, :, :real], alone, **TOL)


def test_probsparse_padded_rows_use_their_own_sizes_in_one_batch():
    """Rows of 40, 20 and 2 real tokens padded to 40 (factor 1): u_b = ceil(ln L_b) active
    queries per head (4, 3, 1), the rest exactly the mean of the row's real values."""
    mech = attnlab.build_mechanism("probsparse(factor=1)", attnlab.HeadDims(H, D, 64)).eval()
    n, lengths = 40, [40, 20, 2]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, H, n, D, generator=g) for _ in range(3))
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    res = mech(q, k, v, attnlab.AttnContext(key_mask=mask, need_weights=True))
    for b, length in enumerate(lengths):
        uniform = mask[b].float() / length
        lazy = (res.probs[b, :, :length] - uniform).abs().amax(-1) < 1e-7  # [h,length]
        assert ((~lazy).sum(-1) == min(math.ceil(math.log(length)), length)).all()
    torch.testing.assert_close(res.out, res.probs @ v, **TOL)
