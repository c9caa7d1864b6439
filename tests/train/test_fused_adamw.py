"""The fused AdamW kernel (on by default where torch has it) against the per-tensor loop."""

import copy

import torch

from attnlab.train.optim import param_groups, use_fused_adamw


def _steps(model, fused, n=5):
    groups = param_groups(model, 0.01)
    opt = torch.optim.AdamW(groups, lr=1e-2, fused=fused)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def test_fused_adamw_equals_the_loop():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4))
    a = _steps(copy.deepcopy(base), fused=True)
    b = _steps(copy.deepcopy(base), fused=False)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert not torch.equal(p, dict(base.named_parameters())[name])  # it trained
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)


def test_default_is_fused_on_cpu_and_the_setting_wins():
    groups = param_groups(torch.nn.Linear(3, 3), 0.0)
    assert use_fused_adamw(groups, None) is True
    assert use_fused_adamw(groups, False) is False
    meta = param_groups(torch.nn.Linear(3, 3, device="meta"), 0.0)
    assert use_fused_adamw(meta, None) is None  # torch's own choice where no kernel exists
    assert use_fused_adamw([{"params": []}], None) is None
