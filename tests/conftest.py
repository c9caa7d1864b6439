"""Shared fixtures: tiny random Hugging Face encoders (fast, offline, seeded)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny shapes run faster on one thread, with no OpenMP spinning on a shared 2-core CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_bert_config(**overrides):
    from transformers import BertConfig

    values = dict(
        vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    values.update(overrides)
    return BertConfig(**values)


def make_tiny_bert(cls_name: str = "BertModel", seed: int = 0, **overrides):
    """A tiny random BERT (hidden 32, 3 layers, 4 heads, vocab 100, max length 64), eval mode."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, cls_name)(tiny_bert_config(**overrides)).eval()


@pytest.fixture
def tiny_bert():
    return make_tiny_bert()


@pytest.fixture
def padded_batch():
    """input_ids [3, 12] with lengths 12, 7, 3 (pad id 0) and the matching attention mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 12), generator=g)
    lengths = torch.tensor([12, 7, 3])
    mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.fixture
def bert_factory():
    """``bert_factory(cls_name="BertModel", seed=0, **config_overrides)`` -> tiny BERT."""
    return make_tiny_bert
