"""LoRA goes through the peft library, with the task type of the head."""

from __future__ import annotations

import peft
import pytest
from tuning_helpers import make_bert

from attnlab.tuning import resolve_tuning
from attnlab.tuning.peft import peft_task_type


def test_lora_wrapped_by_peft():
    tuner, cfg = resolve_tuning("lora(r=4, alpha=8)")
    model = tuner.apply(make_bert(), cfg)
    assert isinstance(model, peft.PeftModel)
    peft_cfg = model.peft_config["default"]
    assert isinstance(peft_cfg, peft.LoraConfig)
    assert peft_cfg.task_type == peft.TaskType.SEQ_CLS
    assert (peft_cfg.r, peft_cfg.lora_alpha) == (4, 8)


@pytest.mark.parametrize("head,task", [("seq", "SEQ_CLS"), ("tok", "TOKEN_CLS"),
                                       ("qa", "QUESTION_ANS"), ("base", "FEATURE_EXTRACTION")])
def test_task_type_follows_the_head(head, task):
    assert peft_task_type(make_bert(head=head)) == task
    tuner, cfg = resolve_tuning("lora")
    model = tuner.apply(make_bert(head=head), cfg)
    assert model.peft_config["default"].task_type == task
