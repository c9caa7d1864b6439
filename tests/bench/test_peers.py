"""Benchmark peers: transformers' attention modules wired to one input the way ours is fed,
so that a peer row times the same attention. Checked by equalities that only hold when the
wiring is right (tolerance 1e-5, fp32)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.bench.peers import PEERS, build_peer, ours_on_one_input
from attnlab.bench.speed import measure

H, D = 2, 8


def x(n: int, b: int = 2) -> torch.Tensor:
    return torch.randn(b, n, H * D, generator=torch.Generator().manual_seed(0))


def ours(spec: str):
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(H, D)).eval()
    return ours_on_one_input(mech, attnlab.AttnContext(), H, D)


def test_nystromformer_with_landmarks_n_is_softmax():
    n = 32  # num_landmarks == n: transformers computes exact softmax attention
    peer = build_peer(f"hf_nystromformer(num_landmarks={n})", H, D, n)
    torch.testing.assert_close(peer(x(n)), ours("softmax")(x(n)), atol=1e-5, rtol=1e-5)


def test_longformer_equals_band_of_the_same_one_sided_window():
    n, w = 64, 8  # transformers needs n to be a multiple of 2w
    peer = build_peer(f"hf_longformer(window={w})", H, D, n)
    torch.testing.assert_close(peer(x(n)), ours(f"band(window={w})")(x(n)), atol=1e-5,
                               rtol=1e-5)


def test_longformer_global_token_equals_ours():
    n, w = 64, 8
    peer = build_peer(f"hf_longformer(window={w}, global_tokens=1)", H, D, n)
    mine = ours(f"longformer(window={w}, global_tokens=(0,))")
    torch.testing.assert_close(peer(x(n)), mine(x(n)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(PEERS))
def test_every_peer_runs_forward_and_backward(name):
    spec = {"hf_bigbird": "hf_bigbird(block=16, random_blocks=1)",
            "hf_reformer_lsh": "hf_reformer_lsh(buckets=4, chunk=16)",
            "hf_longformer": "hf_longformer(window=8)",
            "hf_nystromformer": "hf_nystromformer(num_landmarks=8, conv_kernel=3)"}[name]
    inp = x(128).requires_grad_()
    out = build_peer(spec, H, D, 128)(inp)
    assert out.shape == inp.shape and torch.isfinite(out).all()
    out.sum().backward()
    assert inp.grad is not None and torch.isfinite(inp.grad).all()


def test_unknown_peer_and_parameter_are_clear_errors():
    with pytest.raises(ValueError, match="unknown peer 'hf_nope'"):
        build_peer("hf_nope", H, D, 64)
    with pytest.raises(ValueError, match="unknown parameter.*landmark"):
        build_peer("hf_nystromformer(landmarks=4)", H, D, 64)


def test_measure_times_a_peer():
    res = measure("hf_nystromformer(num_landmarks=8)", 128, heads=H, head_dim=D, repeats=1)
    assert res["fwd_ms"] > 0 and res["fwdbwd_ms"] > 0
