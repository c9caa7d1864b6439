"""PASTA against the official rule, written out here from its description in the official code
(github luka-group/PASTA,
``PASTA_modeling.py``: ``BertPastaEmbeddings`` finds [CLS]=101/[SEP]=102 and assigns the
vectors round-robin in ``nonzero()`` order with the count of the first example;
``BertPastaLayer`` adds ``dropout(e_i * onehot_i)`` for each i to the hidden states before
the layer) and its trainable set (``main_glue.py``: parameters named
``special_token_embedding`` or ``classifier``).

On batches where every example has the same number of special tokens (where the official
round-robin is the per-example order) the tuned model equals the port exactly in eval.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tuning_helpers import CLS, PAD, SEP, make_bert

from attnlab.tuning import TaskInfo, resolve_tuning
from attnlab.tuning.base import encoder_layers
from attnlab.tuning.pasta import pasta_module


def official_special_tensors(input_ids: torch.Tensor) -> torch.Tensor:
    """``BertPastaEmbeddings.forward``'s is_special_token_tensors [num_specials, b, L]."""
    positions = (input_ids == 101).long() + (input_ids == 102).long()
    num_specials = int(torch.sum(positions[0]).item())
    token_indices = positions.nonzero()
    out = torch.zeros_like(positions).unsqueeze(0).expand(num_specials, -1, -1).clone()
    for i in range(len(token_indices)):
        out[i % num_specials][token_indices[i][0], token_indices[i][1]] = 1
    return out


def official_forward(base, tables, batch):
    """The untuned model with the official per-layer additions (eval: dropout off)."""
    onehots = official_special_tensors(batch["input_ids"])
    handles = []
    for layer, table in zip(encoder_layers(base), tables, strict=True):
        def add(module, args, kwargs, table=table):
            hidden = args[0] if args else kwargs["hidden_states"]
            assert onehots.shape[0] <= table.shape[0]
            for i in range(onehots.shape[0]):
                index = onehots[i].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
                hidden = hidden + table[i] * index
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}
        handles.append(layer.register_forward_pre_hook(add, with_kwargs=True))
    try:
        with torch.no_grad():
            return base(**batch).logits
    finally:
        for h in handles:
            h.remove()


def pair_batch():
    ids = torch.tensor([
        [CLS, 5, 6, SEP, 7, 8, 9, SEP, PAD, PAD],
        [CLS, 5, SEP, 6, 7, SEP, PAD, PAD, PAD, PAD],
        [CLS, 5, 6, 7, 8, SEP, 9, 10, 11, SEP],
    ])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long()}


def single_batch():
    ids = torch.tensor([[CLS, 5, 6, 7, SEP, PAD], [CLS, 8, 9, 10, 11, SEP]])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long()}


@pytest.mark.parametrize("kind, batch, n", [("pair", pair_batch, 3), ("single", single_batch, 2)])
def test_tuned_model_equals_the_official_additions(kind, batch, n):
    base = make_bert().eval()
    tuner, cfg = resolve_tuning("pasta")
    model = tuner.apply(copy.deepcopy(base), cfg, task=TaskInfo(kind=kind)).eval()
    tables = [t.weight.detach() for t in pasta_module(model).vectors]
    assert all(t.shape == (n, 16) for t in tables)
    b = batch()
    with torch.no_grad():
        ours = model(**b).logits
    assert torch.equal(ours, official_forward(base, tables, b))
    with torch.no_grad():
        assert (ours - base(**b).logits).abs().max() > 1e-4


def test_trainable_set_is_the_official_optimizer_group():
    tuner, cfg = resolve_tuning("pasta")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="pair"))
    official_head = {name for name, _ in model.named_parameters() if "classifier" in name}
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {name for name in trained if "pasta" not in name} == official_head
    assert {name for name in trained if "pasta" in name} == {
        f"bert.pasta.vectors.{i}.weight" for i in range(2)}


def test_init_is_normal_with_the_initializer_range():
    """from_pretrained initialises the official ``nn.Embedding`` (a missing weight) with
    N(0, initializer_range^2) = N(0, 0.02^2); 2 x 3 x 512 draws: the sample std is within
    5% of 0.02 with probability > 0.999."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=120, hidden_size=512, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    tuner, pcfg = resolve_tuning("pasta")
    model = tuner.apply(BertForSequenceClassification(cfg), pcfg, task=TaskInfo(kind="pair"))
    values = torch.cat([t.weight.detach().flatten() for t in pasta_module(model).vectors])
    assert values.numel() == 2 * 3 * 512
    assert abs(values.std().item() / cfg.initializer_range - 1) < 0.05
    assert abs(values.mean().item()) < 0.02 * 4 / values.numel() ** 0.5
