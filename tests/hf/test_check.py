"""check_model_config, and `attnlab validate` refusing exactly what `attnlab run` refuses.

Models are tiny configs saved to tmp folders (a random ModernBERT with the embedded MiniLM
tokenizer beside it, so `run` can train it; a BigBird config alone), never downloads. Runs
are one optimizer step on 16 builtin CoLA examples.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.config import load_config
from attnlab.hf import PlanError, UnsupportedModelError, check_model_config

runner = CliRunner()

GOOD_PLAN = "1:0,2:band(window=2)"  # a local layer of the tiny ModernBERT
TOO_DEEP = "0-5:all:band(window=2)"  # the tiny ModernBERT has 4 layers
HALF_LAYER = "1:0:talking_heads"  # a layer-scope mechanism on one head


def modernbert_config(**overrides):
    from transformers import ModernBertConfig

    values = dict(
        vocab_size=30522, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, global_attn_every_n_layers=2, local_attention=4,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=101, eos_token_id=102,
        cls_token_id=101, sep_token_id=102,
    )
    values.update(overrides)
    return ModernBertConfig(**values)


@pytest.fixture(scope="module")
def modernbert_dir(tmp_path_factory):
    """A tiny random ModernBERT (MLM head) with the embedded MiniLM tokenizer beside it."""
    from transformers import ModernBertForMaskedLM

    import attnlab

    folder = tmp_path_factory.mktemp("modernbert")
    torch.manual_seed(0)
    ModernBertForMaskedLM(modernbert_config()).save_pretrained(folder)
    attnlab.load_default_model("base")[1].save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bigbird_dir(tmp_path_factory):
    """A tiny BigBird: config.json only (neither command may need more to refuse it)."""
    from transformers import BigBirdConfig

    folder = tmp_path_factory.mktemp("bigbird")
    BigBirdConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=16).save_pretrained(folder)
    return folder


def args_for(tmp_path, model, plan=None):
    args = [f"name=check-{tmp_path.name}", f"output_dir={tmp_path / 'runs'}",
            f"model.name={model}", "model.max_length=16", "task.data_dir=builtin",
            "task.train_limit=16", "task.eval_limit=8", "train.max_steps=1",
            "train.batch_size=4"]
    return args + ([f"plan={plan}"] if plan else [])


def error_line(output: str) -> str:
    """The CLI's error message, with rich's line wrapping undone."""
    assert "error:" in output, output
    return " ".join(output.split("error:", 1)[1].split())


# ---------------------------------------------------------------- check_model_config


def test_supported_models_and_plans_pass():
    check_model_config("default", "band(window=4)")
    check_model_config("scratch:tiny", "0-1:all:band(window=4)")
    check_model_config(modernbert_config(), GOOD_PLAN)
    check_model_config(modernbert_config(), "all:all:mqa")  # fused host: no K/V shrink
    check_model_config(modernbert_config())  # no plan: the model alone


def test_reads_only_the_config(tmp_path):
    """A folder with config.json and no weights is enough (nothing is loaded)."""
    modernbert_config().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    check_model_config(str(tmp_path), GOOD_PLAN)


@pytest.mark.parametrize("plan, error, match", [
    (TOO_DEEP, PlanError, "layer index 4 is out of range.*Fix the rule's layers"),
    (HALF_LAYER, PlanError, "scope 'layer'.*Give it heads: all"),
    ("band(window=-1)", PlanError, "window must be >= 0"),
])
def test_plans_the_model_cannot_take(plan, error, match):
    with pytest.raises(error, match=match) as info:
        check_model_config(modernbert_config(), plan)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("model, match", [
    ("scratch:huge", "cannot read the config.*unknown size"),
    ("/no/such/folder", "cannot read the config"),
])
def test_unreadable_models(model, match):
    with pytest.raises(UnsupportedModelError, match=match) as info:
        check_model_config(model)
    assert "\n" not in str(info.value) and "set model.name to" in str(info.value)


def test_unsupported_architectures_are_refused_even_without_a_plan(bigbird_dir):
    from transformers import GPT2Config, LongformerConfig

    for model in (str(bigbird_dir), LongformerConfig(num_hidden_layers=1)):
        with pytest.raises(UnsupportedModelError, match="does not route through") as info:
            check_model_config(model)
        assert "\n" not in str(info.value) and "set model.name to" in str(info.value)
    with pytest.raises(UnsupportedModelError, match="found no self-attention modules"):
        check_model_config(GPT2Config(n_layer=1, n_embd=16, n_head=2))


# ------------------------------------------------------------------ validate == run


def test_modernbert_validates_and_runs(tmp_path, modernbert_dir):
    args = args_for(tmp_path, modernbert_dir, GOOD_PLAN)
    res = runner.invoke(app, ["validate", *args])
    assert res.exit_code == 0 and "config is valid" in res.output, res.output
    res = runner.invoke(app, ["run", *args])
    assert res.exit_code == 0, res.output
    summaries = list((tmp_path / "runs").glob("**/summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["steps"] == 1 and summary["surgery"]["model_type"] == "modernbert"
    assert summary["surgery"]["table"][1] == ["band(window=2)", "softmax"] * 2


@pytest.mark.parametrize("plan", [TOO_DEEP, HALF_LAYER])
def test_modernbert_plan_refused_alike(tmp_path, modernbert_dir, plan):
    args = args_for(tmp_path, modernbert_dir, plan)
    checked = runner.invoke(app, ["validate", *args])
    ran = runner.invoke(app, ["run", *args])
    assert checked.exit_code == ran.exit_code == 2, (checked.output, ran.output)
    assert error_line(checked.output) == error_line(ran.output)
    assert re.search(r"Fix the rule's layers|Give it heads: all", error_line(ran.output))
    assert not list((tmp_path / "runs").glob("**/summary.json"))  # refused before training


def test_unsupported_architecture_refused_alike(tmp_path, bigbird_dir):
    args = args_for(tmp_path, bigbird_dir)  # no plan at all
    checked = runner.invoke(app, ["validate", *args])
    ran = runner.invoke(app, ["run", *args])
    assert checked.exit_code == ran.exit_code == 2, (checked.output, ran.output)
    line = error_line(checked.output)
    assert line == error_line(ran.output)
    assert "does not route through" in line and "set model.name to" in line
    assert "'bigbird' mechanism on a BERT host" in line  # the fix


def test_run_experiment_refuses_before_touching_data_or_disk(tmp_path, bigbird_dir):
    from attnlab.recipes.finetune import run_experiment

    cfg = load_config(None, args_for(tmp_path, bigbird_dir))
    with pytest.raises(UnsupportedModelError, match="does not route through"):
        run_experiment(cfg)
    assert not (tmp_path / "runs").exists()
