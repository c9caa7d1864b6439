"""Tuners on hosts other than BERT: masked-LM heads tied to the word embeddings, ModernBERT's
two-module head and bias-free layers, DistilBERT's and ModernBERT's LoRA targets."""

from __future__ import annotations

import pytest
import torch
from tuning_helpers import make_family

from attnlab.hf import UnsupportedModelError
from attnlab.tuning import (
    TaskInfo,
    TuningError,
    count_parameters,
    resolve_tuning,
    tuning_record,
)

D, I, VOCAB, LAYERS = 16, 32, 60, 2  # tuning_helpers.TINY
XLMR_BACKBONE = (VOCAB + 40 + 1 + 2) * D + LAYERS * (4 * (D * D + D) + 2 * D * I + D + I
                                                     + 4 * D)  # 6,096
LM_HEAD = D * D + D + 2 * D + VOCAB  # dense, LayerNorm, decoder bias (decoder weight: tied)


# ---------------------------------------------------- masked-LM heads tied to the embeddings


@pytest.mark.parametrize("family", ["xlm-roberta", "camembert"])
@pytest.mark.parametrize("name", ["bitfit", "pasta", "adapter", "prefix(num_virtual_tokens=2)"])
def test_partial_tuners_leave_tied_word_embeddings_frozen(family, name):
    """XLM-R and CamemBERT register lm_head before the encoder: named_parameters calls the
    tied matrix lm_head.decoder.weight, and it is the backbone's all the same."""
    model = make_family(family, "ForMaskedLM")
    embeddings = model.get_input_embeddings().weight
    assert model.lm_head.decoder.weight is embeddings
    tuner, cfg = resolve_tuning(name)
    model = tuner.apply(model, cfg, task=TaskInfo(kind="single"))
    assert not embeddings.requires_grad
    assert "lm_head.decoder.weight" not in dict(tuner.trainable_parameters(model))
    assert "lm_head.decoder.weight" not in tuner.state_dict_to_save(model)
    assert tuning_record(model).head == ("lm_head",)


@pytest.mark.parametrize("family", ["xlm-roberta", "camembert", "roberta"])
@pytest.mark.parametrize("name,without_head", [
    ("bitfit", LAYERS * (7 * D + I) + D),  # q, k, v, two dense, two LN, FFN; embedding LN
    ("full", XLMR_BACKBONE),  # the word embeddings included
])
def test_counts_put_tied_word_embeddings_in_the_backbone(family, name, without_head):
    tuner, cfg = resolve_tuning(name)
    model = tuner.apply(make_family(family, "ForMaskedLM"), cfg, task=TaskInfo(kind="single"))
    counts = count_parameters(model, tuner)
    assert counts["backbone_total"] == XLMR_BACKBONE
    assert counts["trainable_without_head"] == without_head
    assert counts["trainable_total"] == without_head + LM_HEAD


# ------------------------------------------------------------------ LoRA: head and targets


TARGETS = {"roberta": ("query", "value"), "distilbert": ("q_lin", "v_lin"),
           "modernbert": ("Wqkv",)}


def _head_copies(model) -> set[str]:
    """The names peft gives the trained copy of every head parameter."""
    backbone = {id(p) for p in model.base_model.parameters()}
    out = set()
    for name, p in model.named_parameters():
        if id(p) not in backbone:
            top, rest = name.split(".", 1)
            out.add(f"base_model.model.{top}.modules_to_save.default.{rest}")
    return out


@pytest.mark.parametrize("family,head,modules", [
    ("roberta", "ForSequenceClassification", {"classifier"}),  # dense + out_proj
    ("distilbert", "ForSequenceClassification", {"pre_classifier", "classifier"}),
    ("distilbert", "ForQuestionAnswering", {"qa_outputs"}),
    ("modernbert", "ForSequenceClassification", {"head", "classifier"}),
    ("modernbert", "ForTokenClassification", {"head", "classifier"}),
    ("modernbert", "ForQuestionAnswering", {"head", "classifier"}),  # peft: qa_outputs
])
def test_lora_trains_every_module_of_the_task_head(family, head, modules):
    model = make_family(family, head)
    expected = _head_copies(model)
    assert {n.split(".")[2] for n in expected} == modules
    tuner, cfg = resolve_tuning(f"lora(r=2, target_modules={TARGETS[family]!r})")
    model = tuner.apply(model, cfg)
    trainable = {n for n, _ in tuner.trainable_parameters(model)}
    assert {n for n in trainable if "lora_" not in n} == expected
    saved = tuner.state_dict_to_save(model)
    assert all(any(k.startswith(f"base_model.model.{m}.") for k in saved) for m in modules)
    counts = count_parameters(model, tuner)
    head_size = sum(p.numel() for n, p in model.named_parameters() if n in expected)
    assert counts["trainable_total"] - counts["trainable_without_head"] == head_size


@pytest.mark.parametrize("family,targets", [
    ("distilbert", {"q_lin", "v_lin"}),
    ("modernbert", {"Wqkv"}),  # Q, K and V in one projection
    ("camembert", {"query", "value"}),
])
def test_lora_has_default_targets_for_families_peft_lacks(family, targets):
    tuner, cfg = resolve_tuning("lora(r=2)")
    model = tuner.apply(make_family(family), cfg)
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == targets
    assert set(model.peft_config["default"].target_modules) == targets


def test_lora_without_default_targets_names_the_option():
    tuner, cfg = resolve_tuning("lora")
    with pytest.raises(UnsupportedModelError, match=r"data2vec-text.*lora\(target_modules="
                       ) as err:
        tuner.apply(make_family("data2vec-text"), cfg)
    assert "\n" not in str(err.value)
    tuner, cfg = resolve_tuning("lora(r=2, target_modules=('query', 'value'))")
    model = tuner.apply(make_family("data2vec-text"), cfg)
    assert any(".lora_A." in n for n, _ in model.named_parameters())


def test_lora_target_modules_must_name_modules_of_the_model():
    """An empty name is a config error; a name no module ends with is refused in one line
    naming the model's linear layers (peft's own error is a multi-line traceback)."""
    for spec in ("lora(target_modules='')", "lora(target_modules=())",
                 "lora(target_modules=('query', ' '))"):
        with pytest.raises(Exception, match="target_modules must name modules"):
            resolve_tuning(spec)
    tuner, cfg = resolve_tuning("lora(r=2, target_modules=('qury',))")
    with pytest.raises(TuningError, match=r"named 'qury'.*query") as err:
        tuner.apply(make_family("roberta"), cfg)
    assert "\n" not in str(err.value)


def test_lora_refuses_a_backbone_module_peft_would_take_for_the_head():
    """peft trains in full every module whose name ends with a head module's name."""
    for name in ("pre_classifier", "pre_head"):  # ours; peft's own for SEQ_CLS
        model = make_family("modernbert")
        model.model.add_module(name, torch.nn.Linear(2, 2))
        tuner, cfg = resolve_tuning("lora(r=2, target_modules=('Wqkv',))")
        with pytest.raises(UnsupportedModelError, match=f"backbone module '{name}'") as err:
            tuner.apply(model, cfg)
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------- bitfit without biases


def test_bitfit_refuses_a_model_without_biases():
    """ModernBERT's default config turns off every bias outside the classifier."""
    model = make_family("modernbert")
    tuner, cfg = resolve_tuning("bitfit")
    with pytest.raises(UnsupportedModelError, match=(
            r"bitfit: ModernBertForSequenceClassification has no bias terms outside the task "
            r"head \(its config sets attention_bias, mlp_bias, norm_bias to False\); use lora"
    )) as err:
        tuner.apply(model, cfg)
    assert "\n" not in str(err.value)
    assert tuning_record(model) is None
    assert all(p.requires_grad for p in model.parameters())


def test_bitfit_without_layernorm_refuses_a_model_with_only_layernorm_biases():
    tuner, cfg = resolve_tuning("bitfit(include_layernorm=False)")
    with pytest.raises(UnsupportedModelError, match="set include_layernorm=True") as err:
        tuner.apply(make_family("modernbert", norm_bias=True), cfg)
    assert "\n" not in str(err.value)


def test_bitfit_trains_the_biases_a_modernbert_config_turns_on():
    tuner, cfg = resolve_tuning("bitfit")
    model = tuner.apply(make_family("modernbert", attention_bias=True), cfg)
    backbone = {id(p) for p in model.base_model.parameters()}
    trained = [n for n, p in tuner.trainable_parameters(model) if id(p) in backbone]
    assert sorted(trained) == [f"model.layers.{i}.attn.{m}.bias"
                               for i in range(LAYERS) for m in ("Wo", "Wqkv")]
    loss = model(input_ids=torch.tensor([[1, 5, 6, 2]]), labels=torch.tensor([1])).loss
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trained)
