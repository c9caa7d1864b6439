"""TLM's objective (attnlab.tlm.objective) on toy models: the stage-1 schedule, the loss
formula against a hand computation, the masked-position MLM fast path against the naive
all-positions form (fp32, 1e-6), the task head, its re-initialisation, and the batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.tlm.objective import (
    IGNORE,
    ExternalCollator,
    MaskedTaskCollator,
    TaskHead,
    TlmModel,
    TlmObjective,
    encode_passages,
    is_task_step,
    joint_loss,
    reference_mlm_loss,
    task_labels,
)

TOL = dict(atol=1e-6, rtol=1e-6)  # fp32, one forward pass computed two ways


def _toy(problem_type="single_label_classification", num_labels=3, token_level=False,
         rho2=20.0, seed=0):
    """A tiny random BertForMaskedLM (hidden 32, 2 layers, vocab 100, no dropout) + head."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    mlm = BertForMaskedLM(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    head = TaskHead(32, num_labels, token_level=token_level)
    return TlmModel(mlm, head, problem_type=problem_type, rho2=rho2).eval()


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (3, 10), generator=g)  # [b, n]
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    mlm = torch.full_like(ids, IGNORE)
    mlm[0, 2], mlm[0, 5], mlm[1, 1], mlm[2, 3] = 7, 11, 42, 99  # four masked positions
    return ids, mask, mlm


# ----------------------------------------------------------------------------- schedule


def test_schedule_rho1_3_first_twelve_steps():
    """Official Trainer._get_batch: ratio = rho1 + 1, a task batch iff (step + 1) % ratio == 0:
    the task batch is the LAST of each group of rho1 + 1 steps."""
    obj = TlmObjective(rho1=3, rho2=20)
    assert [s for s in range(12) if obj.is_task_step(s)] == [3, 7, 11]
    assert [obj.task_steps_before(s) for s in range(12)] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert [obj.external_steps_before(s) for s in (0, 3, 4, 12)] == [0, 3, 3, 9]


@pytest.mark.parametrize("rho1", [0, 1, 3, 7, 19, 99])
def test_schedule_matches_the_official_rule(rho1):
    ratio = rho1 + 1  # run.py: args.external_ratio += 1
    official = [ratio <= 1 or (s + 1) % ratio == 0 for s in range(400)]
    assert [is_task_step(s, rho1) for s in range(400)] == official
    obj = TlmObjective(rho1=rho1)
    # a stream's position is the count of its earlier steps
    assert all(obj.task_steps_before(s) == sum(official[:s]) for s in range(0, 400, 7))


def test_objective_defaults_are_the_official_script():
    obj = TlmObjective()
    assert (obj.rho1, obj.rho2) == (999, 20.0)  # train.sh: EXTERNAL_RATIO=999, MLM_WEIGHT=20


@pytest.mark.parametrize("kwargs,expect", [
    ({"rho1": -1}, "rho1 must be an integer >= 0"),
    ({"rho1": 2.5}, "rho1 must be an integer >= 0"),
    ({"rho2": -0.5}, "rho2 must be >= 0"),
])
def test_bad_rho_is_one_line_value_error(kwargs, expect):
    with pytest.raises(ValueError, match=expect) as e:
        TlmObjective(**kwargs)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- loss


def test_task_batch_loss_is_the_weighted_mean_by_hand():
    """(rho2 * L_mlm + L_task) / (rho2 + 1), each part recomputed from the model's pieces."""
    model = _toy(rho2=20.0)
    ids, mask, mlm = _batch()
    labels = torch.tensor([0, 2, 1])
    out = model(ids, mask, labels=labels, mlm_labels=mlm)
    hidden = model.mlm.bert(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, n, d]
    scores = model.mlm.cls(hidden)  # [b, n, V]: the official all-positions MLM head
    picked = [(0, 2), (0, 5), (1, 1), (2, 3)]
    l_mlm = torch.stack([-torch.log_softmax(scores[i, j], -1)[mlm[i, j]]
                         for i, j in picked]).mean()
    h = model.task_head
    logits = h.out(F.gelu(h.dense(hidden[:, 0])))  # Linear-GELU-Linear on [CLS]
    l_task = torch.stack([-torch.log_softmax(logits[i], -1)[labels[i]] for i in range(3)]).mean()
    torch.testing.assert_close(out.mlm_loss, l_mlm, **TOL)
    torch.testing.assert_close(out.task_loss, l_task, **TOL)
    torch.testing.assert_close(out.loss, (20.0 * l_mlm + l_task) / 21.0, **TOL)
    torch.testing.assert_close(out.logits, logits, **TOL)
    assert abs(out.loss.item() - out.mlm_loss.item()) > 1e-3  # the task part counts


def test_external_batch_loss_is_mlm_only_and_stage2_is_task_only():
    model = _toy(rho2=100.0)
    ids, mask, mlm = _batch()
    ext = model(ids, mask, mlm_labels=mlm)
    assert ext.task_loss is None
    torch.testing.assert_close(ext.loss, ext.mlm_loss, atol=0, rtol=0)
    labels = torch.tensor([1, 0, 2])
    ft = model(ids, mask, labels=labels)
    assert ft.mlm_loss is None
    torch.testing.assert_close(ft.loss, F.cross_entropy(ft.logits, labels), **TOL)
    assert model(ids, mask).loss is None


def test_rho2_zero_is_the_task_loss_and_joint_loss_formula():
    a, b = torch.tensor(2.0), torch.tensor(0.5)
    assert joint_loss(a, b, 0.0).item() == pytest.approx(0.5)
    assert joint_loss(a, b, 1000.0).item() == pytest.approx((2000.0 + 0.5) / 1001.0)
    model = _toy(rho2=0.0)
    ids, mask, mlm = _batch()
    out = model(ids, mask, labels=torch.tensor([0, 1, 2]), mlm_labels=mlm)
    torch.testing.assert_close(out.loss, out.task_loss, atol=0, rtol=0)


def test_masked_position_mlm_head_equals_the_naive_all_positions_loss():
    model = _toy()
    ids, mask, mlm = _batch()
    hidden = model.mlm.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    fast = model.masked_lm_loss(hidden, mlm)
    torch.testing.assert_close(fast, reference_mlm_loss(model, hidden, mlm), **TOL)
    # gradients agree too (fp32, 1e-6)
    h1 = hidden.detach().requires_grad_()
    h2 = hidden.detach().requires_grad_()
    model.masked_lm_loss(h1, mlm).backward()
    reference_mlm_loss(model, h2, mlm).backward()
    torch.testing.assert_close(h1.grad, h2.grad, **TOL)


def test_no_masked_token_gives_zero_not_nan():
    model = _toy()
    ids, mask, _ = _batch()
    out = model(ids, mask, mlm_labels=torch.full_like(ids, IGNORE))
    assert out.loss.item() == 0.0 and out.loss.requires_grad


def test_token_level_head_and_regression():
    model = _toy(num_labels=4, token_level=True)
    ids, mask, mlm = _batch()
    tags = torch.randint(0, 4, ids.shape)
    tags[:, 0] = IGNORE
    tags[2, 6:] = IGNORE
    out = model(ids, mask, labels=tags, mlm_labels=mlm)
    assert out.logits.shape == (3, 10, 4)  # the head on every position
    keep = tags != IGNORE
    by_hand = -torch.log_softmax(out.logits, -1)[keep].gather(-1, tags[keep][:, None]).mean()
    torch.testing.assert_close(out.task_loss, by_hand, **TOL)
    reg = _toy(problem_type="regression", num_labels=1)
    scores = torch.tensor([0.5, 3.0, 4.5])
    r = reg(ids, mask, labels=scores)
    torch.testing.assert_close(r.task_loss, ((r.logits[:, 0] - scores) ** 2).mean(), **TOL)


def test_task_head_is_linear_gelu_linear_with_torch_default_init():
    head = TaskHead(32, 5)
    assert [type(m) for m in head.children()] == [nn.Linear, nn.GELU, nn.Linear]
    assert (head.dense.in_features, head.dense.out_features, head.out.out_features) == (32, 32, 5)
    torch.manual_seed(3)
    ref = nn.Linear(32, 32)  # PyTorch's own init from one generator state ...
    head.reset_parameters(torch.Generator().manual_seed(3))  # ... reproduced from a generator
    torch.testing.assert_close(head.dense.weight, ref.weight, atol=0, rtol=0)
    torch.testing.assert_close(head.dense.bias, ref.bias, atol=0, rtol=0)


def test_reset_task_head_changes_only_the_head_and_is_seeded():
    model = _toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    model.reset_task_head(seed=5)
    assert torch.equal(rng, torch.get_rng_state())  # the global RNG is left alone
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"task_head.dense.weight", "task_head.dense.bias", "task_head.out.weight",
                       "task_head.out.bias"}
    again = {k: v.clone() for k, v in after.items()}
    model.reset_task_head(seed=5)
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_model_refuses_what_it_cannot_train():
    with pytest.raises(ValueError, match="problem_type"):
        TlmModel(_toy().mlm, TaskHead(32, 2), problem_type="multi_label", rho2=1.0)
    with pytest.raises(ValueError, match="BertForMaskedLM"):
        TlmModel(nn.Linear(2, 2), TaskHead(32, 2), problem_type="regression", rho2=1.0)


# ----------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def tok():
    from attnlab.recipes.tlm_train import load_tokenizer

    return load_tokenizer()


def _mlm_collate(tok, seed):
    from attnlab.tasks.mlm import MlmTask

    return MlmTask().collator(tok, seed=seed)


def test_masked_task_batches_keep_task_labels_and_mask_like_external_text(tok):
    from attnlab.tasks import get_task

    cola = get_task("cola")
    feats = cola.encode(cola.load("train", "builtin")[:16], tok, 32)
    collate = MaskedTaskCollator(_mlm_collate(tok, 7), frozenset(tok.all_special_ids))
    batch = collate(feats)
    assert batch["labels"].tolist() == [f["labels"] for f in feats]  # task labels untouched
    masked = batch["mlm_labels"] != IGNORE
    assert masked.any()
    orig = torch.nn.utils.rnn.pad_sequence([torch.tensor(f["input_ids"]) for f in feats],
                                           batch_first=True)
    assert torch.equal(batch["mlm_labels"][masked], orig[masked])  # targets: the true tokens
    special = torch.isin(orig, torch.tensor(tok.all_special_ids))
    assert not (masked & special).any()  # [CLS], [SEP], padding never chosen
    assert (batch["input_ids"][masked] == tok.mask_token_id).float().mean() > 0.5
    again = collate(feats)  # seeded by the batch's examples: same masks every time
    assert torch.equal(again["input_ids"], batch["input_ids"])


def test_token_labels_are_padded_with_ignore():
    t = task_labels([[1, 2, 3], [4]], width=5)
    assert t.tolist() == [[1, 2, 3, IGNORE, IGNORE], [4, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert task_labels([0.5, 2.0], 3).dtype == torch.float
    assert task_labels([1, 0], 3).dtype == torch.long
    with pytest.raises(ValueError, match="labels must match input_ids"):
        task_labels([[1, 2, 3, 4]], width=3)


def test_external_passages_are_encoded_line_by_line(tok):
    texts = ["a short passage .", "   ", "word " * 200]
    feats = encode_passages(texts, tok, 16)
    assert len(feats) == 2  # the blank one dropped
    assert [f["block_index"] for f in feats] == [0, 1]
    assert len(feats[1]["input_ids"]) == 16  # truncated, not packed with the next
    assert feats[0]["input_ids"][0] == tok.cls_token_id and feats[0]["input_ids"][-1] == \
        tok.sep_token_id
    batch = ExternalCollator(_mlm_collate(tok, 0))(feats)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "mlm_labels"}
