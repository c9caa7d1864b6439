"""Diff-Prune's fused training-time gate (``_NoisyDiff``) against the plain autograd form:
forward and gradients to 1e-6 (fp32) / 1e-12 (fp64), gates saturated at both ends included;
and log_alpha's own learning rate against the official scripts' two optimizers (exact);
one diff for a weight several modules share (a plan's cross-layer ties, a masked-LM decoder
tied to the word embeddings), read by every use."""

import pytest
import torch

from attnlab.tuning.diff_prune import (
    DiffParametrization,
    DiffPruneConfig,
    _NoisyDiff,
    diff_modules,
    logistic_noise,
    reference_noisy_diff,
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
    for fn in (_NoisyDiff.apply, reference_noisy_diff):
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
    want = reference_noisy_diff(theta0, p.w, p.log_alpha, logistic_noise(p.log_alpha),
                                 cfg.beta, cfg.gamma, cfg.zeta)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    p.eval()  # deterministic gate: sigmoid(log_alpha) stretched and clamped
    z = (torch.sigmoid(p.log_alpha) * (cfg.zeta - cfg.gamma) + cfg.gamma).clamp(0, 1)
    torch.testing.assert_close(p(theta0), theta0 + z * p.w)


def _one_step(spec: str, official: bool) -> dict[str, torch.Tensor]:
    """One training step of a tiny BERT under ``spec``; ``official``: the official scripts'
    construction, AdamW(diffs + head, lr) beside AdamW(log_alphas, lr=0.1, no decay)."""
    from tuning_helpers import bert_pair_batch, make_bert

    from attnlab.train.optim import param_groups
    from attnlab.tuning.base import resolve_tuning

    tuner, cfg = resolve_tuning(spec)
    model = tuner.apply(make_bert(), cfg).train()
    lr = 1e-5
    if official:
        alphas = [g.log_alpha for g in diff_modules(model).values()]
        ids = {id(a) for a in alphas}
        main = [{**g, "params": [p for p in g["params"] if id(p) not in ids]}
                for g in param_groups(model, 0.01)]
        opts = [torch.optim.AdamW(main, lr=lr), torch.optim.AdamW(alphas, lr=0.1,
                                                                 weight_decay=0.0)]
    else:
        opts = [torch.optim.AdamW(param_groups(model, 0.01, tuner.param_options(model)), lr=lr)]
    torch.manual_seed(0)
    loss = model(**bert_pair_batch(), labels=torch.tensor([0, 1, 2])).loss + tuner.aux_loss(model)
    loss.backward()
    for opt in opts:
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_log_alpha_trains_at_its_own_lr_as_the_official_scripts():
    """Default alpha_lr=0.1: our one optimizer with a log_alpha group equals the official two
    optimizers exactly; alpha_lr=None (log_alpha at optim.lr, 1e-5) does not."""
    want = _one_step("diff_prune", official=True)
    got = _one_step("diff_prune", official=False)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    slow = _one_step("diff_prune(alpha_lr=None)", official=False)
    start = 5.0  # log_alpha_init
    alphas = [k for k in want if k.endswith("log_alpha")]
    assert alphas
    moved = max((want[k] - start).abs().max().item() for k in alphas)
    moved_slow = max((slow[k] - start).abs().max().item() for k in alphas)
    assert 0 < 1000 * moved_slow < moved  # lr 0.1 vs 1e-5 (fp32 steps near 5: 4.8e-7)
    with pytest.raises(ValueError, match="alpha_lr"):
        DiffPruneConfig(alpha_lr=0.0)


@pytest.mark.parametrize("spec", ["linformer(k=4, share='layerwise')", "luna(num_memory=3)"])
def test_a_weight_shared_across_layers_gets_one_diff(spec):
    """A plan that ties a weight across layers (one Parameter, several modules): one diff
    and gate on its first use, read by every use; before, diff_prune refused such a plan.
    With w set, the tuned model equals the plain planned model whose shared weight is
    theta_0 + gate * w (bit-identical in eval); a training step's gradient reaches the one
    w from every layer that reads it; the saved diff reloads."""
    import copy

    from tuning_helpers import bert_pair_batch, make_bert

    from attnlab.hf import apply_plan
    from attnlab.tuning import TaskInfo, resolve_tuning

    plain = make_bert()
    apply_plan(plain, f"all:all:{spec}", max_len=16)
    attr = "E" if spec.startswith("linformer") else "memory"
    uses = [m for m in plain.modules() if isinstance(getattr(m, attr, None), torch.nn.Parameter)]
    assert len(uses) == 2 and getattr(uses[0], attr) is getattr(uses[1], attr)  # tied
    pristine = copy.deepcopy(plain)
    tuner, cfg = resolve_tuning("diff_prune")
    model = tuner.apply(copy.deepcopy(plain), cfg, task=TaskInfo(kind="pair"))
    gates = {n: g for n, g in diff_modules(model).items() if n.endswith(f".{attr}")}
    assert len(gates) == 1  # one diff for the shared weight
    (gate,) = gates.values()
    with torch.no_grad():
        gate.w.normal_()
    model.eval()
    used = [m for m in model.modules() if hasattr(m, "parametrizations")
            and attr in m.parametrizations]
    assert len(used) == 2 and torch.equal(getattr(used[0], attr), getattr(used[1], attr))
    with torch.no_grad():
        getattr(uses[0], attr).copy_(getattr(used[0], attr))
    batch = bert_pair_batch()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, plain.eval()(**batch).logits)

    model.train()
    torch.manual_seed(0)
    model(**batch, labels=torch.tensor([0, 1, 2])).loss.backward()
    assert gate.w.grad is not None and gate.w.grad.abs().sum() > 0

    twin = tuner.apply(pristine, cfg, task=TaskInfo(kind="pair"))
    tuner.load_tuned(twin, tuner.state_dict_to_save(model))
    model.eval()
    with torch.no_grad():
        assert torch.equal(twin.eval()(**batch).logits, model(**batch).logits)


def test_a_head_tied_to_a_backbone_weight_reads_its_diff():
    """BertForMaskedLM: the decoder shares the word embeddings (a backbone weight); with
    the diff set, the tuned model equals the plain one whose shared weight is theta_0 +
    gate * w, in the embeddings and the decoder alike (before, the decoder kept theta_0)."""
    import copy

    from transformers import BertConfig, BertForMaskedLM

    from attnlab.tuning import TaskInfo, resolve_tuning

    torch.manual_seed(0)
    plain = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=32))
    emb = plain.bert.embeddings.word_embeddings
    assert plain.cls.predictions.decoder.weight is emb.weight
    tuner, cfg = resolve_tuning("diff_prune")
    model = tuner.apply(copy.deepcopy(plain), cfg, task=TaskInfo(kind="other")).eval()
    gate = diff_modules(model)["bert.embeddings.word_embeddings.weight"]
    with torch.no_grad():
        gate.w.normal_()
        emb.weight.copy_(model.bert.embeddings.word_embeddings.weight)  # decoder too: tied
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain.eval()(input_ids=ids).logits)
