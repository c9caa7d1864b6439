"""Diff-Prune's fused training-time gate (``_NoisyDiff``) against the plain autograd form:
forward and gradients to 1e-6 (fp32) / 1e-12 (fp64), gates saturated at both ends included."""

import pytest
import torch

from attnlab.tuning.diff_prune import (
    DiffParametrization,
    DiffPruneConfig,
    _NoisyDiff,
    _reference_noisy_diff,
    logistic_noise,
)

CONSTS = [(2.0 / 3.0, -0.1, 1.1), (1.0, -1.5, 1.5)]  # the brief's and the official scripts'


@pytest.mark.parametrize("beta,gamma,zeta", CONSTS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_fused_gate_equals_reference(beta, gamma, zeta, dtype, tol):
    g = torch.Generator().manual_seed(0)
    shape = (64, 48)
    theta0 = torch.randn(shape, generator=g, dtype=dtype)
    w = torch.randn(shape, generator=g, dtype=dtype)
    # log_alpha from -8 to 8: gates closed (z = 0), open (z = 1) and in between
    log_alpha = torch.empty(shape, dtype=dtype).uniform_(-8, 8, generator=g)
    torch.manual_seed(1)
    noise = logistic_noise(log_alpha)
    grad = torch.randn(shape, generator=g, dtype=dtype)

    outs, grads = [], []
    for fn in (_NoisyDiff.apply, _reference_noisy_diff):
        w_, la_ = w.clone().requires_grad_(), log_alpha.clone().requires_grad_()
        out = fn(theta0, w_, la_, noise.clone(), beta, gamma, zeta)
        out.backward(grad)
        outs.append(out.detach())
        grads.append((w_.grad, la_.grad))
    zs = torch.sigmoid((noise + log_alpha) / beta) * (zeta - gamma) + gamma
    assert (zs < 0).any() and (zs > 1).any() and ((zs > 0) & (zs < 1)).any()
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert (grads[0][1] == 0).any() and (grads[0][1] != 0).any()  # the clamp cuts gradients


def test_parametrization_uses_the_fused_gate_with_the_same_noise():
    """Same RNG state -> the module's training output equals the reference's with the noise
    drawn the same way (one rand_like per access), so runs stay seed-reproducible."""
    cfg = DiffPruneConfig()
    theta0 = torch.randn(5, 7)
    p = DiffParametrization(theta0, cfg)
    with torch.no_grad():
        p.w.normal_()
        p.log_alpha.uniform_(-3, 3)
    p.train()
    torch.manual_seed(3)
    got = p(theta0)
    torch.manual_seed(3)
    want = _reference_noisy_diff(theta0, p.w, p.log_alpha, logistic_noise(p.log_alpha),
                                 cfg.beta, cfg.gamma, cfg.zeta)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    p.eval()  # deterministic gate: sigmoid(log_alpha) stretched and clamped
    z = (torch.sigmoid(p.log_alpha) * (cfg.zeta - cfg.gamma) + cfg.gamma).clamp(0, 1)
    torch.testing.assert_close(p(theta0), theta0 + z * p.w)
