"""LoRA and prefix tuning go through the peft library, with the task type of the head."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from tuning_helpers import bert_pair_batch, make_bert, make_roberta, roberta_pair_batch

from attnlab.tuning import TaskInfo, resolve_tuning
from attnlab.tuning.peft import peft_task_type


@pytest.mark.parametrize("spec,config_cls", [("lora(r=4, alpha=8)", peft.LoraConfig),
                                             ("prefix(num_virtual_tokens=5)",
                                              peft.PrefixTuningConfig)])
def test_wrapped_by_peft(spec, config_cls):
    tuner, cfg = resolve_tuning(spec)
    model = tuner.apply(make_bert(), cfg)
    assert isinstance(model, peft.PeftModel)
    peft_cfg = model.peft_config["default"]
    assert isinstance(peft_cfg, config_cls)
    assert peft_cfg.task_type == peft.TaskType.SEQ_CLS
    if config_cls is peft.LoraConfig:
        assert (peft_cfg.r, peft_cfg.lora_alpha) == (4, 8)
    else:
        assert peft_cfg.num_virtual_tokens == 5


@pytest.mark.parametrize("head,task", [("seq", "SEQ_CLS"), ("tok", "TOKEN_CLS"),
                                       ("qa", "QUESTION_ANS"), ("base", "FEATURE_EXTRACTION")])
def test_task_type_follows_the_head(head, task):
    assert peft_task_type(make_bert(head=head)) == task
    tuner, cfg = resolve_tuning("lora")
    model = tuner.apply(make_bert(head=head), cfg)
    assert model.peft_config["default"].task_type == task


@pytest.mark.parametrize("make,batch", [(make_bert, bert_pair_batch),
                                        (make_roberta, roberta_pair_batch)])
def test_prefix_tuning_works_with_padding(make, batch):
    """Transformers 5 BERT/RoBERTa take peft's prefix as past key/values; padded == alone."""
    base = make().eval()
    tuner, cfg = resolve_tuning("prefix(num_virtual_tokens=4)")
    model = tuner.apply(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.normal_()
    b = batch()
    with torch.no_grad():
        padded = model(**b).logits
        n = int(b["attention_mask"][0].sum())
        alone = model(**{k: v[:1, :n] for k, v in b.items()}).logits
        assert not torch.allclose(padded, base(**b).logits, atol=1e-4)
    torch.testing.assert_close(padded[:1], alone, rtol=0, atol=1e-5)  # fp32 reorderings only
    model.train()
    model(**b).logits.sum().backward()
    assert model.prompt_encoder["default"].embedding.weight.grad.abs().sum() > 0


def test_prefix_default_length_is_the_pasta_papers():
    tuner, cfg = resolve_tuning("prefix")
    model = tuner.apply(make_bert(), cfg, task=TaskInfo(kind="single"))
    assert model.peft_config["default"].num_virtual_tokens == 20  # PASTA paper's re-run
