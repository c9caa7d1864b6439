"""One home for the "a mechanism in a plan on a tiny BERT" test steps the mechanism test
files share: apply the plan, run forward, train one SGD step (finite gradients that move
the touched weights), then check eval is deterministic and finite."""

from __future__ import annotations

import torch

from attnlab.hf import apply_plan


def train_one_step(model: torch.nn.Module, plan: list[dict], batch: dict, lr: float = 0.1):
    """(report, output before the step, eval output after it). Asserts on the way: finite
    output and gradients, the query projections of the planned layers get a non-zero
    gradient, and eval-mode outputs are finite and repeat exactly."""
    report = apply_plan(model, plan)
    model.train()
    out = model(**batch).last_hidden_state  # [b,n,hidden]
    assert torch.isfinite(out).all()
    # a fixed random read-out: the squared mean of a LayerNorm output is nearly constant
    readout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * readout * batch["attention_mask"][..., None]).sum().backward()
    for p in model.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
    planned = sorted({li for li, row in enumerate(report.table)
                      for spec in row if not spec.startswith("softmax")})
    for li in planned:
        grad = model.encoder.layer[li].attention.self.query.weight.grad
        assert grad is not None and grad.abs().sum() > 0, f"layer {li}: no query gradient"
    torch.optim.SGD(model.parameters(), lr=lr).step()
    model.eval()
    with torch.no_grad():
        a = model(**batch).last_hidden_state
        b = model(**batch).last_hidden_state
    assert torch.isfinite(a).all() and torch.equal(a, b)
    return report, out.detach(), a
