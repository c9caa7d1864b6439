"""attnlab's own prefix tuning: peft's result with the same weights (recorded, and live where
peft still runs), independence from padding, training, and the reference formula per layer.

Tolerance: 1e-5 absolute on fp32 logits of magnitude ~1 (the two paths add the same terms
in another order: differences seen are ~1e-7).
"""

from __future__ import annotations

import copy

import pytest
import torch
from prefix_reference import CASES, REFERENCE, peft_logits, prefix_state
from safetensors import safe_open
from tuning_helpers import bert_pair_batch, make_bert

from attnlab import reference_attention
from attnlab.hf.prefix import ENCODER_ATTR, PrefixEncoder, extend_kv
from attnlab.tuning import TaskInfo, resolve_tuning
from attnlab.tuning.base import backbone_of


def _spec(name: str) -> str:
    _, _, p, mlp, mid = CASES[name]
    return (f"prefix(num_virtual_tokens={p}, prefix_projection={mlp}, "
            f"encoder_hidden_size={mid})")


def _ours(name: str, base: torch.nn.Module) -> torch.nn.Module:
    tuner, cfg = resolve_tuning(_spec(name))
    model = tuner.apply(copy.deepcopy(base), cfg).eval()
    getattr(backbone_of(model), ENCODER_ATTR).load_state_dict(prefix_state(name))
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_peft_recorded(name):
    """Logits recorded from peft 0.21.2 + transformers 5.23 (prefix_reference.py)."""
    with safe_open(str(REFERENCE), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys() if k.startswith(f"{name}/")}
    make = CASES[name][0]
    base = make().eval()
    base.load_state_dict({k.split("/", 2)[2]: v for k, v in saved.items()
                          if k.startswith(f"{name}/model/")})
    batch = {k.split("/", 2)[2]: v for k, v in saved.items() if k.startswith(f"{name}/batch/")}
    with torch.no_grad():
        logits = _ours(name, base)(**batch).logits
        assert not torch.allclose(logits, base(**batch).logits, atol=1e-3)  # the prefix acts
    torch.testing.assert_close(logits, saved[f"{name}/logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_peft_live(name):
    make, batch = CASES[name][:2]
    base = make().eval()
    try:
        expected = peft_logits(name, base)
    except ValueError as e:  # peft 0.21.2 on transformers >= 5.24 (cache argument renamed)
        pytest.skip(f"peft's prefix tuning does not run with this transformers: {e}")
    with torch.no_grad():
        logits = _ours(name, base)(**batch()).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_layer_attention_is_softmax_over_prefix_and_tokens():
    """Per layer: attention over [P_k; K] with the prefix always visible = the oracle."""
    enc = PrefixEncoder(num_layers=2, num_heads=2, head_dim=4, length=3, mid=5)

    class Attn(torch.nn.Module):
        pass

    from attnlab.hf.prefix import PREFIX_ATTR, PrefixRef

    attn = Attn()
    setattr(attn, PREFIX_ATTR, PrefixRef(enc, 1))
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    k2, v2, m2 = extend_kv(attn, k, v, mask)
    assert k2.shape == (2, 2, 9, 4) and m2[:, :3].all() and torch.equal(m2[:, 3:], mask)
    pk, pv = enc()[1]  # [h, p, d]
    torch.testing.assert_close(k2[:, :, :3], pk.expand(2, -1, -1, -1))
    torch.testing.assert_close(v2[:, :, 3:], v)
    out, probs = reference_attention(q, k2, v2, key_mask=m2)
    assert probs[1, :, :, -2:].abs().max() == 0 and probs[1, :, :, :3].sum() > 0
    assert torch.isfinite(out).all()


def test_padding_does_not_change_a_row_and_gradients_reach_the_prefix():
    base = make_bert().eval()
    tuner, cfg = resolve_tuning("prefix(num_virtual_tokens=4)")
    model = tuner.apply(copy.deepcopy(base), cfg).eval()
    enc = getattr(backbone_of(model), ENCODER_ATTR)
    with torch.no_grad():
        enc.embedding.weight.normal_()
    b = bert_pair_batch()
    with torch.no_grad():
        padded = model(**b).logits
        n = int(b["attention_mask"][0].sum())
        alone = model(**{k: v[:1, :n] for k, v in b.items()}).logits
    torch.testing.assert_close(padded[:1], alone, rtol=0, atol=1e-5)
    model.train()
    model(**b).logits.sum().backward()
    assert enc.embedding.weight.grad.abs().sum() > 0


def test_trains_and_round_trips(tmp_path):
    from attnlab.tuning import load_tuned_file, save_tuned

    tuner, cfg = resolve_tuning("prefix(num_virtual_tokens=2, prefix_projection=True)")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair")).train()
    opt = torch.optim.AdamW([p for _, p in tuner.trainable_parameters(model)], lr=1e-2)
    batch = {**bert_pair_batch(), "labels": torch.tensor([0, 1, 2])}
    losses = []
    for _ in range(5):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    save_tuned(model, tuner, tmp_path / "t.safetensors")
    again = tuner.apply(make_bert(seed=0), cfg).eval()
    load_tuned_file(again, tuner, tmp_path / "t.safetensors")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(**bert_pair_batch()).logits,
                                   model(**bert_pair_batch()).logits, rtol=0, atol=1e-6)


def test_unshifted_positions_differ_and_default_length_is_the_pasta_papers():
    tuner, cfg = resolve_tuning("prefix")
    assert cfg.num_virtual_tokens == 20 and cfg.shift_positions  # PASTA paper's re-run
    base = make_bert().eval()
    shifted = _ours("bert", base)
    tuner, cfg = resolve_tuning(_spec("bert").replace(")", ", shift_positions=False)"))
    plain = tuner.apply(copy.deepcopy(base), cfg).eval()
    getattr(backbone_of(plain), ENCODER_ATTR).load_state_dict(prefix_state("bert"))
    with torch.no_grad():
        assert not torch.allclose(plain(**bert_pair_batch()).logits,
                                  shifted(**bert_pair_batch()).logits, atol=1e-4)
