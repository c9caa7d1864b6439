"""Head importance (Michel et al. 2019) and ablation, on tiny random BERTs (float64 where a
finite-difference check needs it), and `attnlab analyze importance` on a tiny saved model."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.analysis.importance import (
    ablate,
    by_class,
    by_class_markdown,
    class_masks,
    example_weights,
    head_importance,
    layer_normalize,
)
from attnlab.hf import head_mask

HEAD_DIM = 8  # tiny BERT: hidden 32, 4 heads, 3 layers


def _classifier(bert_factory):
    # a larger init than BERT's 0.02 gives the gradients a size worth comparing
    return bert_factory("BertForSequenceClassification", num_labels=3,
                        initializer_range=0.3).double()


def _batch(padded_batch, **labels):
    return {**padded_batch, **labels}


def _split(batch):
    return [{k: v[i:i + 1] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]


def test_gradient_importance_equals_finite_differences(bert_factory, padded_batch):
    model = _classifier(bert_factory)
    batch = _batch(padded_batch, labels=torch.tensor([0, 2, 1]))
    got = head_importance(model, [batch], normalize=False)
    assert got.n_examples == 3
    eps = 1e-5
    fd = torch.zeros(3, 4, dtype=torch.float64)
    for one in _split(batch):
        for layer in range(3):
            for head in range(4):
                losses = []
                for sign in (1.0, -1.0):
                    xi = torch.ones(3, 4, dtype=torch.float64)
                    xi[layer, head] += sign * eps
                    with torch.no_grad(), head_mask(model, xi):
                        losses.append(float(model(**one).loss))
                fd[layer, head] += abs(losses[0] - losses[1]) / (2 * eps) / 3
    assert float(fd.min()) > 1e-4  # every head matters a little in a random model
    # central differences in float64: truncation ~eps^2, rounding ~1e-16/eps = 1e-11
    torch.testing.assert_close(got.raw, fd, rtol=1e-6, atol=1e-9)


def test_per_example_gradients_of_a_batch_equal_one_example_at_a_time(bert_factory,
                                                                      padded_batch):
    # sentence labels: every example weighs 1/b in the batch loss
    model = _classifier(bert_factory)
    batch = _batch(padded_batch, labels=torch.tensor([0, 2, 1]))
    batched = head_importance(model, [batch], normalize=False)
    alone = head_importance(model, _split(batch), normalize=False)
    torch.testing.assert_close(batched.raw, alone.raw, rtol=1e-10, atol=0)  # float64
    # token labels: weights by labelled tokens (-100 ignored); an example without one has no
    # loss and is left out
    tagger = bert_factory("BertForTokenClassification", num_labels=5,
                          initializer_range=0.3).double()
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 5, (3, 12), generator=g)
    labels[padded_batch["attention_mask"] == 0] = -100
    labels[0, ::2] = -100
    labels[2] = -100
    tokens = _batch(padded_batch, labels=labels)
    assert example_weights(tokens).tolist() == pytest.approx([6 / 13, 7 / 13, 0.0])
    batched = head_importance(tagger, [tokens], normalize=False)
    alone = head_importance(tagger, _split(tokens)[:2], normalize=False)
    assert batched.n_examples == 2
    torch.testing.assert_close(batched.raw, alone.raw, rtol=1e-10, atol=0)


def test_a_head_whose_wo_block_is_zero_has_importance_zero_and_no_ablation_effect(
        bert_factory, padded_batch):
    model = _classifier(bert_factory)
    dense = model.bert.encoder.layer[1].attention.output.dense
    with torch.no_grad():
        dense.weight[:, 2 * HEAD_DIM:3 * HEAD_DIM] = 0.0
    batch = _batch(padded_batch, labels=torch.tensor([0, 2, 1]))
    imp = head_importance(model, [batch])
    assert float(imp.raw[1, 2]) == 0.0 and float(imp.importance[1, 2]) == 0.0
    assert float(imp.raw.abs().min()) == 0.0 and int((imp.raw == 0).sum()) == 1

    def evaluate(m):
        with torch.no_grad():
            return {"loss": float(m(**batch).loss)}

    abl = ablate(model, evaluate, "loss", greater_is_better=False)
    assert abl.delta is not None and float(abl.delta[1, 2]) == 0.0
    assert int((abl.delta == 0).sum()) == 1  # every other head changes the loss


def test_ablation_masks_single_heads_and_groups(bert_factory, padded_batch):
    model = _classifier(bert_factory)
    batch = _batch(padded_batch, labels=torch.tensor([0, 2, 1]))

    def evaluate(m):
        with torch.no_grad():
            return {"logit_sum": float(m(**batch).logits.sum())}

    group = torch.zeros(3, 4, dtype=torch.bool)
    group[0, 1] = group[2, 3] = True
    abl = ablate(model, evaluate, "logit_sum", groups={"pair": group})

    def masked(mask):
        with head_mask(model, mask):
            return evaluate(model)["logit_sum"]

    assert abl.baseline == masked(torch.ones(3, 4, dtype=torch.float64))
    one = torch.ones(3, 4, dtype=torch.float64)
    one[2, 1] = 0.0
    assert abl.heads is not None and float(abl.heads[2, 1]) == masked(one)
    assert abl.groups["pair"] == masked((~group).double()) and abl.group_sizes["pair"] == 2
    with pytest.raises(ValueError, match="gives no metric 'mcc'"):
        ablate(model, evaluate, "mcc", per_head=False)


def test_layer_normalisation_and_the_class_table():
    raw = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    norm = layer_normalize(raw)
    torch.testing.assert_close(norm, torch.tensor([[0.6, 0.8], [0.0, 0.0]],
                                                  dtype=torch.float64))
    from attnlab.analysis.importance import Ablation, HeadImportance

    imp = HeadImportance(raw, norm, True, 10)
    abl = Ablation("acc", True, 0.5, torch.tensor([[0.4, 0.5], [0.3, 0.5]],
                                                  dtype=torch.float64),
                   {"vertical": 0.2, "heterogeneous": 0.45}, {"vertical": 2, "heterogeneous": 2})
    classes = [["vertical", "heterogeneous"], ["vertical", "heterogeneous"]]
    assert list(class_masks(classes)) == ["vertical", "heterogeneous"]
    rows = by_class(classes, imp, abl)
    assert rows[0] == pytest.approx({"class": "vertical", "heads": 2, "mean_importance": 0.3,
                                     "mean_raw_importance": 1.5, "mean_head_delta": -0.15,
                                     "class_delta": -0.3})
    assert rows[1]["mean_importance"] == pytest.approx(0.4)
    md = by_class_markdown(rows, "acc")
    assert "| vertical | 2 | 0.3000 | 1.5000 | -0.1500 | -0.3000 |" in md


def test_a_model_without_a_loss_is_refused(tiny_bert, padded_batch):
    with pytest.raises(ValueError, match="returned no loss: .*task head"):
        head_importance(tiny_bert, [_batch(padded_batch, labels=torch.tensor([0, 1, 0]))])


# ----------------------------------------------------------------------------- the command

runner = CliRunner()


def _invoke(args):
    from attnlab.cli import app

    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny BERT classifiers saved with attnlab.save_pretrained and the embedded tokenizer:
    one with a plan (band in layer 0, heads 0-1), and a base model without a task head."""
    import transformers

    def tiny_bert_config(**overrides):  # the shape of tests/conftest.py's tiny BERT
        return transformers.BertConfig(**{
            "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0, **overrides})

    from attnlab import save_pretrained
    from attnlab.hf import apply_plan
    from attnlab.models import default_model_path

    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    clf = transformers.BertForSequenceClassification(
        tiny_bert_config(vocab_size=tok.vocab_size, num_labels=2)).eval()
    apply_plan(clf, "0:0-1:band(window=2)")
    save_pretrained(clf, root / "clf", tokenizer=tok)
    base = transformers.BertModel(tiny_bert_config(vocab_size=tok.vocab_size)).eval()
    save_pretrained(base, root / "base", tokenizer=tok)
    return root


DATA = ["--task", "cola", "--data-dir", "builtin", "--limit", "8", "--batch-size", "4",
        "--max-length", "16"]


def test_the_command_writes_tables_and_heat_maps(saved):
    out = saved / "out"
    res = _invoke(["analyze", "importance", saved / "clf", *DATA, "--out", out])
    text = " ".join(res.output.split())
    assert "head importance (per-layer l2-normalised) by class" in text
    assert "mcc with every head" in text and "most important heads" in text
    doc = json.loads((out / "importance.json").read_text())
    assert (doc["layers"], doc["heads"]) == (3, 4) and doc["meta"]["examples"] == 8
    imp = torch.tensor(doc["importance"], dtype=torch.float64)
    # each layer's row has unit l2 norm (8 significant digits in the file)
    torch.testing.assert_close(imp.pow(2).sum(-1), torch.ones(3, dtype=torch.float64),
                               rtol=0, atol=1e-6)
    abl = doc["ablation"]
    assert abl["metric"] == "mcc" and len(abl["delta"]) == 3
    assert len(doc["classes"]) == 3 and doc["by_class"]
    assert sum(r["heads"] for r in doc["by_class"]) == 12
    assert set(abl["classes"]) == {r["class"] for r in doc["by_class"]}
    assert len((out / "importance.csv").read_text().splitlines()) == 1 + 12
    md = (out / "importance.md").read_text()
    assert "## Importance by head class" in md and "## The 10 most important heads" in md
    for stem in ("importance", "ablation"):
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        assert "<svg" in (out / f"{stem}.svg").read_text()[:500], stem


def test_the_command_reads_classes_from_a_saved_analysis(saved):
    from attnlab.analysis import to_json

    heads = saved / "heads"  # a head_scores.json as `attnlab analyze heads` writes it
    classes = [["vertical", "diagonal", "heterogeneous", "block"]] * 3
    to_json(heads / "head_scores.json", {"vertical": torch.zeros(3, 4)}, classes, {})
    out = saved / "out2"
    _invoke(["analyze", "importance", saved / "clf", *DATA, "--analysis", heads,
             "--metric", "accuracy", "--no-normalize", "--out", out])
    doc = json.loads((out / "importance.json").read_text())
    assert doc["importance"] == doc["importance_raw"] and doc["normalized"] is False
    assert doc["meta"]["classes_from"].endswith("head_scores.json")
    assert doc["classes"] == classes
    assert [r["class"] for r in doc["by_class"]] == ["vertical", "diagonal", "block",
                                                    "heterogeneous"]
    abl = doc["ablation"]
    assert abl["metric"] == "accuracy" and abl["greater_is_better"] is None
    assert {k: v["heads"] for k, v in abl["classes"].items()} == {
        "vertical": 3, "diagonal": 3, "block": 3, "heterogeneous": 3}
    out = saved / "out3"
    _invoke(["analyze", "importance", saved / "clf", *DATA, "--analysis", heads,
             "--no-ablation", "--out", out])
    doc = json.loads((out / "importance.json").read_text())
    assert doc["ablation"] is None and not (out / "ablation.png").exists()
    assert (out / "importance.png").is_file()


def test_the_command_refuses_a_model_without_a_task_head(saved):
    from attnlab.cli import app

    res = runner.invoke(app, ["analyze", "importance", str(saved / "base"), *DATA])
    assert res.exit_code == 2
    assert "returned no loss" in " ".join(res.output.split())


def test_overlap_command_tabulates_each_model_and_writes_json(saved):
    from attnlab.analysis.overlap import model_overlap
    from attnlab.recipes.analyze import load_model

    out = saved / "overlap.json"
    res = _invoke(["analyze", "overlap", saved / "clf", saved / "base", "--out", out])
    assert "W_O subspace overlap" in res.output and "wrote" in res.output
    doc = json.loads(out.read_text())
    assert list(doc) == [str(saved / "clf"), str(saved / "base")]
    want = model_overlap(load_model(str(saved / "clf")).model)
    assert doc[str(saved / "clf")]["per_layer"] == pytest.approx(want["per_layer"])
    assert doc[str(saved / "base")]["chance"] == pytest.approx(8 / 32)  # dv / D


def test_overlap_command_names_a_missing_model(saved):
    from attnlab.cli import app

    res = runner.invoke(app, ["analyze", "overlap", str(saved / "nope")])
    assert res.exit_code == 2 and "does not exist" in res.output
