"""Head-group slicing (core/slicing.py) changes nothing but the size of intermediates:
outputs, weights and gradients equal the one-group computation (float64, 1e-10: in float32
the kernels a backend picks per batch shape, e.g. oneDNN's for a pooling convolution, reorder
sums by more than 1e-6 on some CPUs, which would hide nothing but make the test depend on
the machine)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.core import slicing
from attnlab.core.slicing import head_slices


def test_head_slices_cover_every_head_once_within_the_budget():
    assert head_slices(12, 3 << 20, 8 << 20) == [slice(0, 2), slice(2, 4), slice(4, 6),
                                                  slice(6, 8), slice(8, 10), slice(10, 12)]
    assert head_slices(5, 100 << 20, 8 << 20) == [slice(i, i + 1) for i in range(5)]
    assert head_slices(4, 1, 8 << 20) == [slice(0, 4)]


@pytest.mark.parametrize("spec,causal", [
    (spec, causal) for spec in ("performer(num_features=16)", "linear_relu", "linear_elu")
    for causal in (False, True)] + [(spec, False) for spec in (
        "lsh(buckets=4, chunk=4, num_hashes=2)", "nystrom(num_landmarks=4)",
        "nystrom(num_landmarks=5, pinv_init='exact')", "csalr(num_landmarks=4)",
        "linformer(k=8)", "linformer(k=8, share='headwise')", "linformer(k=8, share='kv')",
        "clustered(clusters=4, bits=8, iterations=4)",
        "improved_clustered(clusters=4, bits=8, iterations=4, topk=3)",
        "poolingformer(window=2, window2=8, pool_size=3)",
        "poolingformer(window=2, window2=8, pool_size=3, pool='conv')",
        "poolingformer(window=2, window2=8, pool_size=2, pool='max', stacked=False)")] + [
    ("bp_tree(window=1, k=1)", False), ("bp_tree(window=2, k=1)", True)])
def test_sliced_heads_equal_one_group(monkeypatch, spec, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 17:] = False
    mech = attnlab.build_mechanism(spec, attnlab.HeadDims(4, 8, 32)).double().eval()

    weights = not spec.startswith("bp_tree")  # its weights come from the dense reference

    def run(budget):
        monkeypatch.setattr(slicing, "SLICE_BYTES", budget)
        ctx = attnlab.AttnContext(key_mask=mask, causal=causal, need_weights=weights)
        res = mech(q, k, v, ctx)
        grads = torch.autograd.grad((res.out * torch.arange(8.0, dtype=torch.float64)).sum(),
                                    (q, k, v),
                                    allow_unused=True)  # lsh: shared QK, k unused
        return res, grads

    whole, whole_grads = run(1 << 30)
    calls = []
    monkeypatch.setattr(slicing, "head_slices", lambda *a: calls.append(1) or [
        slice(i, i + 1) for i in range(4)])
    sliced, sliced_grads = run(1)  # one head per group
    assert calls, "the mechanism does not go through over_head_groups"
    torch.testing.assert_close(sliced.out, whole.out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(sliced.probs, whole.probs, atol=1e-10, rtol=1e-10)
    for a, b in zip(sliced_grads, whole_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
