"""Every registered mechanism trains one step in the `bench lra` encoder at lengths that
the common block, stride and compression sizes divide (36) and that none does (37), with
a padded row: a ListOps cell meets both, batch after batch."""

from __future__ import annotations

import pytest
import torch

from attnlab.bench.lra_cell import build_model
from attnlab.bench.suite import bench_spec
from attnlab.core import list_mechanisms

NAMES = list_mechanisms()
# four patterns need four heads; the encoder has two
NEEDS_MORE_HEADS = {"pattern_loss"}


@pytest.mark.parametrize("name", [n for n in NAMES if n not in NEEDS_MORE_HEADS])
def test_trains_one_step_at_divisible_and_odd_lengths_with_padding(name):
    torch.manual_seed(0)
    model = build_model(bench_spec(name), "sequence-classification", 10, 32, 64, 0).train()
    for n in (36, 37):
        ids = torch.randint(5, 32, (2, n))
        mask = torch.ones_like(ids)
        mask[1, n * 2 // 3:] = 0
        out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), (name, n)
        model.zero_grad()
