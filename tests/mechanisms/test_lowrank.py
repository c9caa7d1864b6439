"""linformer: the sliced projections against a naive reference that zero-pads to max_len.

Tolerances: fp32 at 1e-5 (same products, different order).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.core import RegistryError, resolve_config

H, D, MAXLEN, K = 3, 8, 32, 6


def naive_linformer(q, k, v, E, Fm, key_mask=None, scale=None):
    """The paper's form: pad K, V with zeros to max_len rows, project with the full E, F.

    E, Fm: [k, N] (shared) or [h, k, N] (per head). Padded keys are zeroed first.
    Per-head, per-batch loops keep it obviously correct.
    """
    b, h, m, d = k.shape
    N = E.shape[-1]
    scale = d**-0.5 if scale is None else scale
    if key_mask is not None:
        k = k * key_mask[:, None, :, None]
        v = v * key_mask[:, None, :, None]
    kpad = torch.cat([k, k.new_zeros(b, h, N - m, d)], dim=2)  # [b,h,N,d]
    vpad = torch.cat([v, v.new_zeros(b, h, N - m, v.shape[-1])], dim=2)
    out = torch.empty(b, h, q.shape[2], v.shape[-1])
    for bi in range(b):
        for hi in range(h):
            e = E if E.dim() == 2 else E[hi]
            f = Fm if Fm.dim() == 2 else Fm[hi]
            kp, vp = e @ kpad[bi, hi], f @ vpad[bi, hi]  # [k,d]
            p = torch.softmax(q[bi, hi] @ kp.T * scale, dim=-1)
            out[bi, hi] = p @ vp
    return out


def build(spec="linformer(k=6)", h=H, max_len=MAXLEN):
    torch.manual_seed(0)
    return attnlab.build_mechanism(spec, attnlab.HeadDims(h, D, max_len)).eval()


def rand(b, n, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, H, x, D, generator=g) for x in (n, m, m))


@pytest.mark.parametrize("share", ["headwise", "kv", "none"])
@pytest.mark.parametrize("m", [1, 20, MAXLEN])
def test_slicing_equals_zero_padding_reference(share, m):
    mech = build(f"linformer(k={K}, share={share!r})")
    q, k, v = rand(3, 11, m, seed=m)
    key_mask = torch.arange(m)[None, :] < torch.tensor([m, max(1, m - 7), 1])[:, None]
    out = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask)).out
    ref = naive_linformer(q, k, v, mech.E.detach(), mech.value_proj.detach(), key_mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sharing_modes_own_the_right_parameters():
    hw, kv, none = (build(f"linformer(k={K}, share={s!r})") for s in ("headwise", "kv", "none"))
    assert hw.E.shape == hw.F.shape == (K, MAXLEN) and hw.E is not hw.F
    assert [n for n, _ in kv.named_parameters()] == ["E"] and kv.value_proj is kv.E
    assert none.E.shape == none.F.shape == (H, K, MAXLEN)
    # per-head matrices really differ across heads
    assert not torch.allclose(none.E[0], none.E[1])


@pytest.mark.parametrize("share", ["headwise", "kv", "none"])
def test_gradients_reach_projections(share):
    mech = build(f"linformer(k={K}, share={share!r})").train()
    q, k, v = rand(2, 9, 9)
    mech(q, k, v, attnlab.AttnContext()).out.square().sum().backward()
    for name, p in mech.named_parameters():
        assert p.grad is not None and p.grad[..., :9].abs().sum() > 0, name
        # columns beyond the sequence length take no part and get no gradient
        assert (p.grad[..., 9:] == 0).all(), name


def test_init_follows_fairseq_xavier_gain():
    mech = build("linformer(k=64)", max_len=512)
    bound = math.sqrt(6.0 / (64 + 512)) / math.sqrt(2.0)
    for p in (mech.E, mech.F):
        assert p.abs().max() <= bound
        # uniform(-a, a) has std a / sqrt(3); 32k samples put it within 2%
        assert abs(p.std().item() - bound / math.sqrt(3)) < 0.02 * bound


def test_too_long_sequence_names_both_lengths_and_the_fix():
    mech = build(max_len=16)
    q, k, v = rand(1, 17, 17)
    with pytest.raises(ValueError, match=r"17 keys.*max_len=16.*larger max_len.*truncate"):
        mech(q, k, v, attnlab.AttnContext())


def test_not_causal():
    assert attnlab.core.mechanism_class("linformer").caps.causal_ok is False
    q, k, v = rand(1, 5, 5)
    with pytest.raises(ValueError, match="cannot be causal"):
        build()(q, k, v, attnlab.AttnContext(causal=True))


def test_needs_max_len():
    caps = attnlab.core.mechanism_class("linformer").caps
    assert caps.needs_max_len and caps.family == "lowrank"
    with pytest.raises(ValueError, match="max_len"):
        attnlab.build_mechanism("linformer", attnlab.HeadDims(H, D, None))


def test_effective_weights_reproduce_the_output():
    mech = build()
    q, k, v = rand(2, 10, 10, seed=4)
    key_mask = torch.arange(10)[None, :] < torch.tensor([10, 4])[:, None]
    res = mech(q, k, v, attnlab.AttnContext(key_mask=key_mask, need_weights=True))
    assert res.probs.shape == (2, H, 10, 10)
    assert (res.probs[1, :, :, 4:] == 0).all()
    torch.testing.assert_close(res.probs @ v, res.out, atol=1e-5, rtol=1e-5)


def test_dropout_only_in_training():
    mech = build()
    q, k, v = rand(1, 10, 10, seed=2)
    c = attnlab.AttnContext(dropout=0.5)
    assert torch.equal(mech(q, k, v, c).out, mech(q, k, v, c).out)
    mech.train()
    torch.manual_seed(1)
    a = mech(q, k, v, c).out
    assert not torch.allclose(a, mech.eval()(q, k, v, c).out)


def test_spec_strings_parse_and_validate():
    cfg = resolve_config("linformer(k=16, share='kv')")
    assert (cfg.k, cfg.share) == (16, "kv")
    assert resolve_config(cfg.spec()) == cfg
    assert resolve_config("linformer") == resolve_config("linformer(k=64, share='headwise')")
    with pytest.raises(RegistryError, match="share must be one of"):
        resolve_config("linformer(share='layerwise')")
    with pytest.raises(RegistryError, match="k .*must be >= 1"):
        resolve_config("linformer(k=0)")


def test_k_not_below_max_len_warns():
    """k >= max_len does not shorten the keys: say so, with the bound to use."""
    with pytest.warns(UserWarning, match=f"use k < {MAXLEN}"):
        build(f"linformer(k={MAXLEN})")
