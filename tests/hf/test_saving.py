"""save_pretrained / load_pretrained round trips (outputs reproduced exactly)."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab import load_pretrained, save_pretrained
from attnlab.hf import Plan, SurgeryError, applied_report, apply_plan
from attnlab.hf.plan import PlanError


def _round_trip(model, batch, path, plan, **kw):
    report = apply_plan(model, plan, **kw)
    with torch.no_grad():
        # perturb mechanism parameters so that a reload from init would not match
        for name, p in model.named_parameters():
            if ".attnlab." in name:
                p.add_(0.01 * torch.randn_like(p))
    ref = model(**batch)
    save_pretrained(model, path)
    loaded = load_pretrained(path)
    assert type(loaded) is type(model)
    assert loaded.config._attn_implementation == "attnlab"
    out = loaded(**batch)
    return report, ref, out, loaded


def test_round_trip_with_parametrised_mechanisms(bert_factory, padded_batch, tmp_path):
    model = bert_factory("BertForSequenceClassification", num_labels=3)
    plan = ["all:0,2:linformer(k=4)", "1:all:talking_heads"]
    report, ref, out, loaded = _round_trip(model, padded_batch, tmp_path, plan, max_len=32)
    assert torch.equal(out.logits, ref.logits)
    assert applied_report(loaded).plan == report.plan == Plan.parse(plan)
    assert applied_report(loaded).max_len == 32
    saved = json.loads((tmp_path / "surgery.json").read_text())
    assert saved["table"] == report.table and saved["max_len"] == 32
    assert Plan.from_json((tmp_path / "plan.json").read_text()) == report.plan
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_round_trip_with_mqa_and_tied_embeddings(bert_factory, padded_batch, tmp_path):
    model = bert_factory("BertForMaskedLM")
    _, ref, out, loaded = _round_trip(model, padded_batch, tmp_path, ["0:all:mqa",
                                                                      "2:1:linear_elu"])
    assert torch.equal(out.logits, ref.logits)
    assert loaded.bert.encoder.layer[0].attention.self.key.out_features == 8
    emb = loaded.bert.embeddings.word_embeddings.weight
    assert loaded.cls.predictions.decoder.weight.data_ptr() == emb.data_ptr()


def test_unplanned_model_round_trips(tiny_bert, padded_batch, tmp_path):
    save_pretrained(tiny_bert, tmp_path)
    assert Plan.from_json((tmp_path / "plan.json").read_text()) == Plan()
    loaded = load_pretrained(tmp_path)
    torch.testing.assert_close(loaded(**padded_batch).last_hidden_state,
                               tiny_bert(**padded_batch).last_hidden_state, atol=1e-6, rtol=0)


@pytest.mark.parametrize("plan", [
    {"plan": [{"layers": "all", "heads": "all", "mechanism": {"name": "my_scaled", "t": 3}}]},
    {"plan": [{"layers": "all", "heads": "all", "mechanism": "my_scaled(t=3.0)"}]},
    {"plan": ["all:all:my_scaled(t=3.0)"]},
    [{"layers": "all", "heads": "all", "mechanism": {"name": "my_scaled"}}],
])
def test_a_mechanism_not_registered_here_is_named_with_the_fix(tiny_bert, tmp_path, plan):
    """A saved plan with a user's own mechanism (registered outside attnlab), loaded where
    its module was not imported: the error keeps its usual text and adds the import to
    make (before: only "did you mean 'multiscale'?")."""
    apply_plan(tiny_bert, "1:all:talking_heads")
    save_pretrained(tiny_bert, tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(PlanError, match=r"unknown mechanism 'my_scaled'.* If 'my_scaled' is "
                                        r"a mechanism of your own, import the module"):
        load_pretrained(tmp_path)


def test_a_plan_error_that_names_no_unknown_mechanism_is_left_as_it_is(tiny_bert, tmp_path):
    save_pretrained(tiny_bert, tmp_path)
    rules = [{"layers": "all", "heads": "all", "mechanism": {"name": "band", "nope": 1}}]
    (tmp_path / "plan.json").write_text(json.dumps({"plan": rules}))
    with pytest.raises(PlanError, match="nope") as err:
        load_pretrained(tmp_path)
    assert "of your own" not in str(err.value)


def test_tampered_plan_is_caught(tiny_bert, tmp_path):
    apply_plan(tiny_bert, "1:all:talking_heads")
    save_pretrained(tiny_bert, tmp_path)
    (tmp_path / "plan.json").write_text(Plan.parse("softmax").to_json())
    with pytest.raises(SurgeryError, match="unexpected .*talking|unexpected .*attnlab"):
        load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "nowhere")


def test_folder_without_plan_json_warns_and_loads_plain(tiny_bert, padded_batch, tmp_path):
    """Hugging Face's own model.save_pretrained writes no plan.json: loading says so (the
    plan is lost) instead of silently returning a plain-softmax model."""
    apply_plan(tiny_bert, "1:0:band(window=1)")
    tiny_bert.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"no plan.json.*attnlab.save_pretrained"):
        loaded = load_pretrained(tmp_path)
    assert not any("attnlab" in name for name, _ in loaded.named_modules())
