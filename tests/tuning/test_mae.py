"""MAE (Peng et al., ACL 2020): the per-head-weight form against the naive mixture of h
experts, the uniform gate against the host model, the block-coordinate phases, saving."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tuning_helpers import bert_pair_batch

import attnlab
from attnlab.tuning import TaskInfo, resolve_tuning
from attnlab.tuning.mae import gates_of, phase_of_step, set_phase

H = 4  # heads: experts drop one of 4, so every expert mixes 3 heads


def make_bert4(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=120, hidden_size=16, num_hidden_layers=2, num_attention_heads=H,
                     intermediate_size=32, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(seed)
    return BertForSequenceClassification(cfg).eval()


def mae_model(spec: str = "mae", seed: int = 0, random_gate: bool = True):
    tuner, cfg = resolve_tuning(spec)
    model = tuner.apply(make_bert4(seed), cfg, task=TaskInfo(kind="pair")).eval()
    if random_gate:  # the gate starts uniform; make it input-dependent
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for g in gates_of(model):
                for p in g.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
    return tuner, model


def _hand_gate(gate, x, mask2d, pool):
    """g by hand: pooled layer input -> Linear -> ReLU -> Linear -> softmax."""
    if pool == "cls":
        pooled = x[:, 0]
    else:
        keep = mask2d.to(x.dtype)
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
    z = F.relu(F.linear(pooled, gate.hidden.weight, gate.hidden.bias))
    return torch.softmax(F.linear(z, gate.out.weight, gate.out.bias), dim=-1)


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_per_head_weights_equal_the_naive_mixture_of_h_experts(pool):
    """sum_i g_i (h/(h-1) sum_{j != i} H_j + b_O), computed expert by expert, equals the
    layer's W_O output (fp32, atol 1e-6), with padding in the batch."""
    _, model = mae_model(f"mae(pool={pool!r})")
    batch = bert_pair_batch()
    seen = {}
    handles = []
    for layer_idx, layer in enumerate(model.bert.encoder.layer):
        w_o = layer.attention.output.dense
        handles += [
            layer.attention.self.register_forward_pre_hook(
                lambda m, a, kw, i=layer_idx: seen.__setitem__(("x", i), a[0] if a else
                                                                 kw["hidden_states"]),
                with_kwargs=True, prepend=True),
            w_o.register_forward_pre_hook(
                lambda m, a, i=layer_idx: seen.__setitem__(("ctx", i), a[0]), prepend=True),
            w_o.register_forward_hook(
                lambda m, a, out, i=layer_idx: seen.__setitem__(("out", i), out)),
        ]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    for layer_idx, layer in enumerate(model.bert.encoder.layer):
        w_o = layer.attention.output.dense
        g = _hand_gate(layer.attention.self.mae_gate, seen[("x", layer_idx)],
                       batch["attention_mask"], pool)  # [b, h]
        assert not torch.allclose(g, torch.full_like(g, 1 / H), atol=1e-3)  # input-dependent
        ctx = seen[("ctx", layer_idx)]  # [b, n, h*dv], before the gate scales it
        dv = ctx.shape[-1] // H
        mixture = torch.zeros_like(seen[("out", layer_idx)])
        for i in range(H):  # expert i: head i dropped, the others times h/(h-1)
            keep = torch.ones(H * dv)
            keep[i * dv:(i + 1) * dv] = 0
            expert = F.linear(ctx * keep * (H / (H - 1)), w_o.weight, w_o.bias)
            mixture += g[:, i, None, None] * expert
        torch.testing.assert_close(seen[("out", layer_idx)], mixture, rtol=0, atol=1e-6)


def test_uniform_gate_is_the_host_model():
    """Zero-initialised gate: g = 1/h, w_j = h (1 - 1/h) / (h - 1) = 1, so the logits equal
    the untouched model's (fp32, atol 1e-6: w_j is 1 up to rounding)."""
    host = make_bert4()
    _, model = mae_model(random_gate=False)
    batch = bert_pair_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, host(**batch).logits, rtol=0,
                                   atol=1e-6)


def test_mean_pool_ignores_padding():
    _, model = mae_model()
    gate = gates_of(model)[0]
    x = torch.randn(1, 5, 16)
    padded = torch.cat([x, torch.randn(1, 3, 16)], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    with torch.no_grad():
        torch.testing.assert_close(gate.responsibilities(padded, mask),
                                   gate.responsibilities(x, None), rtol=0, atol=1e-6)


def _grads_after_step(model, tuner, step):
    model.train()
    tuner.before_step(model, step)
    model.zero_grad(set_to_none=True)
    model(**bert_pair_batch(), labels=torch.tensor([0, 1, 2])).loss.backward()
    gate_ids = {id(p) for g in gates_of(model) for p in g.parameters()}
    named = list(model.named_parameters())
    return ({n: p.grad for n, p in named if id(p) in gate_ids},
            {n: p.grad for n, p in named if id(p) not in gate_ids})


def test_g_steps_train_only_the_gates_and_f_steps_everything_else():
    tuner, model = mae_model("mae(g_steps=1, f_steps=1)")
    gate, rest = _grads_after_step(model, tuner, 0)  # step 0: a G step
    assert all(g is not None for g in gate.values())
    assert any(g.abs().sum() > 0 for g in gate.values())
    assert all(g is None for g in rest.values()), [n for n, g in rest.items() if g is not None]
    gate, rest = _grads_after_step(model, tuner, 1)  # step 1: an F step
    assert all(g is None for g in gate.values())
    assert all(g is not None for g in rest.values()), [n for n, g in rest.items() if g is None]


def test_f_steps_run_one_sampled_expert_per_sequence():
    """Training F step: per sequence and layer exactly one head weighs 0 and the others
    h/(h-1); in eval the mixture's weights come back."""
    tuner, model = mae_model()
    model.train()
    tuner.before_step(model, 1)
    torch.manual_seed(0)
    with torch.no_grad():
        model(**bert_pair_batch())
    for gate in gates_of(model):
        w = gate.last_weights
        assert ((w == 0).sum(1) == 1).all()
        assert torch.allclose(w[w != 0], torch.full_like(w[w != 0], H / (H - 1)))
    model.eval()
    with torch.no_grad():
        model(**bert_pair_batch())
    assert all((g.last_weights > 0).all() for g in gates_of(model))


def test_schedule_alternates_and_joint_trains_everything():
    _, cfg = resolve_tuning("mae(g_steps=2, f_steps=3)")
    assert [phase_of_step(cfg, s) for s in range(6)] == ["gate"] * 2 + ["experts"] * 3 + ["gate"]
    _, joint = resolve_tuning("mae(schedule='joint')")
    assert {phase_of_step(joint, s) for s in range(4)} == {"joint"}
    tuner, model = mae_model("mae(schedule='joint')")
    gate, rest = _grads_after_step(model, tuner, 0)
    assert all(g is not None for g in [*gate.values(), *rest.values()])
    set_phase(model, "experts", expert_step="mixture")  # F steps on the mixture: all train
    assert all(p.requires_grad for p in model.parameters())


def test_bad_settings_are_one_line_errors():
    from attnlab.core import RegistryError

    with pytest.raises(RegistryError, match=r"mae.pool must be one of \['mean', 'cls'\]"):
        resolve_tuning("mae(pool='max')")
    with pytest.raises(RegistryError, match="f_steps must be >= 1"):
        resolve_tuning("mae(f_steps=0)")


def test_mae_model_saves_and_reloads_through_save_pretrained(tmp_path):
    """attnlab.save_pretrained writes rebuild.json; load_pretrained adds the gates again and
    loads every weight strictly: the same logits (bitwise), and a re-save keeps the record."""
    _, model = mae_model()
    batch = bert_pair_batch()
    attnlab.save_pretrained(model, tmp_path / "m")
    assert (tmp_path / "m" / "rebuild.json").exists()
    loaded = attnlab.load_pretrained(tmp_path / "m")
    assert len(gates_of(loaded)) == 2
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)
    attnlab.save_pretrained(loaded, tmp_path / "again")
    assert (tmp_path / "again" / "rebuild.json").read_text() == (
        tmp_path / "m" / "rebuild.json").read_text()


def test_reloading_without_the_rebuilder_names_the_fix(tmp_path, monkeypatch):
    from attnlab.hf import saving

    _, model = mae_model()
    attnlab.save_pretrained(model, tmp_path / "m")
    monkeypatch.delitem(saving._REBUILDERS, "mae")  # imported, yet registers nothing
    with pytest.raises(saving.SurgeryError, match="added by 'mae', and importing "
                       "'attnlab.tuning.mae' did not register"):
        attnlab.load_pretrained(tmp_path / "m")


def test_a_fresh_process_reloads_without_importing_the_tuner(tmp_path):
    _, model = mae_model()
    attnlab.save_pretrained(model, tmp_path / "m")
    code = ("import sys, attnlab; m = attnlab.load_pretrained(sys.argv[1]); "
            "print('attnlab.tuning.mae' in sys.modules, type(m).__name__)")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", type(model).__name__]


def test_a_deep_copy_hooks_its_own_gates():
    _, model = mae_model()
    twin = copy.deepcopy(model)
    batch = bert_pair_batch()
    with torch.no_grad():
        before = model(**batch).logits
        for g in gates_of(twin):
            g.out.weight.zero_()
            g.out.bias.zero_()
        assert torch.equal(model(**batch).logits, before)
        assert not torch.equal(twin(**batch).logits, before)


def test_runner_calls_the_schedule_per_step_and_reloads(tmp_path, monkeypatch):
    """`attnlab run` with tuning mae: the loop calls before_step before every micro-batch
    with its optimizer step (2 micro-batches per step here), the gates leave their uniform
    start, and the saved run evaluates to its recorded metrics."""
    from safetensors.torch import load_file

    from attnlab.config import load_config
    from attnlab.recipes.finetune import evaluate_run, run_experiment
    from attnlab.tuning.mae import MaeTuner

    steps: list[int] = []
    original = MaeTuner.before_step

    def spy(self, model, step):
        steps.append(step)
        original(self, model, step)

    monkeypatch.setattr(MaeTuner, "before_step", spy)
    cfg = load_config(None, ["task.data_dir=builtin", "model.name=scratch:tiny",
                             "model.max_length=16", "train.batch_size=4", "train.grad_accum=2",
                             "train.max_steps=4", "task.train_limit=32", "task.eval_limit=8",
                             "optim.lr=1e-2", "name=mae", f"output_dir={tmp_path}",
                             "tuning.method=mae"])
    summary = run_experiment(cfg)
    assert steps == [0, 0, 1, 1, 2, 2, 3, 3]
    saved = load_file(tmp_path / "mae" / "tuned.safetensors")
    outs = [v for k, v in saved.items() if k.endswith("mae_gate.out.weight")]
    assert outs and any(v.abs().sum() > 0 for v in outs)  # the G steps moved them
    assert evaluate_run(tmp_path / "mae") == pytest.approx(summary["best_eval"], abs=1e-6)
