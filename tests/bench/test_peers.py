"""Benchmark peers: transformers' attention modules wired to one input the way ours is fed,
so that a peer row times the same attention. Checked by equalities that only hold when the
wiring is right (tolerance 1e-5, fp32)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.bench.peers import PEERS, build_peer, forward_only, ours_for, ours_on_one_input
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


@pytest.mark.parametrize(("peer", "mine"), [
    ("flex_band(window=8, compiled=0)", "band(window=8)"),
    ("flex_longformer(window=8, global_tokens=2, compiled=0)",
     "longformer(window=8, global_tokens=(0, 1))"),
])
def test_flex_peers_equal_our_pattern(peer, mine):
    # eager FlexAttention (compiled=0: the same kernel semantics, no compile in the tests);
    # n = 200 is not a multiple of FlexAttention's 128-block
    n = 200
    with torch.no_grad():
        torch.testing.assert_close(build_peer(peer, H, D, n)(x(n)), ours(mine)(x(n)),
                                   atol=1e-5, rtol=1e-5)
    assert ours_for(peer) == mine


def test_ours_for_names_the_same_key_sets():
    assert ours_for("hf_longformer(window=64)") == "band(window=64)"
    assert ours_for("hf_longformer") == "band(window=64)"  # the peer's default window
    assert ours_for("hf_bigbird(block=16, random_blocks=1)") == (
        "bigbird(block=16, num_random_blocks=1, last_global=True)")
    assert ours_for("hf_nystromformer") == "nystrom(num_landmarks=64, conv_kernel=0)"
    assert ours_for("hf_reformer_lsh") == "lsh(buckets=64, chunk=64, num_hashes=1)"
    assert ours_for("band") is None
    for peer in PEERS:  # every peer has an attnlab counterpart that builds
        attnlab.build_mechanism(ours_for(peer), attnlab.HeadDims(H, D, max_len=128))


def test_flex_is_forward_only_on_cpu():
    assert forward_only("flex_band", "cpu") and not forward_only("flex_band", "cuda")
    assert not forward_only("hf_longformer", "cpu") and not forward_only("band", "cpu")
    res = measure("flex_band(window=8, compiled=0)", 256, heads=H, head_dim=D, repeats=1,
                  part="memory")
    assert set(res) == {"peak_fwd_mb"}  # no backward was attempted
    res = measure("flex_band(window=8, compiled=0)", 256, heads=H, head_dim=D, repeats=1)
    assert res["forward_only"] and res["fwd_ms"] > 0 and "fwdbwd_ms" not in res


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(p for p in PEERS if p.startswith("hf_")))
def test_every_peer_runs_forward_and_backward(name, dtype):
    # in float64 too: the peer's module (the Nystromformer conv) and masks follow the input
    # (build_peer's device and dtype, as bench speed passes them; a GPU run moves them alike)
    spec = {"hf_bigbird": "hf_bigbird(block=16, random_blocks=1)",
            "hf_reformer_lsh": "hf_reformer_lsh(buckets=4, chunk=16)",
            "hf_longformer": "hf_longformer(window=8, global_tokens=1)",
            "hf_nystromformer": "hf_nystromformer(num_landmarks=8, conv_kernel=3)"}[name]
    inp = x(128).to(dtype).requires_grad_()
    torch.manual_seed(0)  # the Nystromformer conv's initialisation
    out = build_peer(spec, H, D, 128, dtype=dtype)(inp)
    assert out.shape == inp.shape and out.dtype == dtype and torch.isfinite(out).all()
    out.sum().backward()
    assert inp.grad is not None and torch.isfinite(inp.grad).all()
    if dtype == torch.float64 and name != "hf_reformer_lsh":  # (it draws its hash rotations
        torch.manual_seed(0)  # in x's dtype): the same numbers as in float32 (1e-4: fp32 sums)
        torch.testing.assert_close(build_peer(spec, H, D, 128)(x(128)), out.detach().float(),
                                   atol=1e-4, rtol=1e-4)


def test_unknown_peer_and_parameter_are_clear_errors():
    with pytest.raises(ValueError, match="unknown peer 'hf_nope'"):
        build_peer("hf_nope", H, D, 64)
    with pytest.raises(ValueError, match="unknown parameter.*landmark"):
        build_peer("hf_nystromformer(landmarks=4)", H, D, 64)


def test_measure_times_a_peer():
    res = measure("hf_nystromformer(num_landmarks=8)", 128, heads=H, head_dim=D, repeats=1)
    assert res["fwd_ms"] > 0 and res["fwdbwd_ms"] > 0
