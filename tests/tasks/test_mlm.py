"""Masked-LM: corpus readers, block packing, masking (never special tokens, 80/10/10), loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tasks_helpers import need_data, write

from attnlab.tasks import DataFormatError, get_task, read_texts

MLM = get_task("mlm")


def jsonl(docs) -> str:
    return "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs))


def test_read_jsonl_and_text(tmp_path):
    rows = read_texts(write(tmp_path / "c.jsonl", jsonl(["one doc.", "two doc."]) + "\n"))
    assert [(r.guid, r.text) for r in rows] == [("d0", "one doc."), ("d1", "two doc.")]
    rows = read_texts(write(tmp_path / "wiki.valid.tokens", " \n = Title = \n \n A line .\n"))
    assert [r.text for r in rows] == ["= Title =", "A line ."]


@pytest.mark.parametrize(
    "text, line, message",
    [('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', 3, "broken JSON"),
     ('{"text": "ok"}\n{"body": "no text"}\n', 2, 'expected an object with a "text" string'),
     ('{"text": "ok"}\n\n["a list"]\n', 3, "expected an object")],
)
def test_bad_jsonl_names_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path / "docs.jsonl", text)
    with pytest.raises(DataFormatError, match=message) as e:
        MLM.load("train", path)
    assert e.value.line == line and str(e.value).startswith(f"{path}:{line}: ")


def test_single_file_holdout_and_split_folders(tmp_path):
    path = write(tmp_path / "corpus_en" / "docs.jsonl", jsonl([f"doc {i}" for i in range(40)]))
    train, dev = MLM.load("train", path), MLM.load("dev", path)
    assert [d.text for d in dev] == ["doc 19", "doc 39"] and len(train) == 38
    assert MLM.load("dev", tmp_path) == dev  # a data root finds corpus_en/docs.jsonl
    with pytest.raises(ValueError, match="only train and dev"):
        MLM.load("test", path)
    write(tmp_path / "wt" / "wiki.valid.tokens", "a b\nc d\n")
    write(tmp_path / "wt" / "test.txt", "e f\n")
    assert [d.text for d in MLM.load("validation", tmp_path / "wt")] == ["a b", "c d"]
    assert [d.text for d in MLM.load("test", tmp_path / "wt")] == ["e f"]


def test_builtin_corpus():
    docs = MLM.load("train", "builtin")
    assert len(docs) > 150 and all(d.text.endswith((".", "?")) for d in docs)


def test_blocks_keep_every_token(tokenizer):
    docs = [f"document number {i} has a few words in it ." for i in range(30)]
    feats = MLM.encode(read_docs(docs), tokenizer, max_length=16)
    assert all(len(f["input_ids"]) <= 16 for f in feats)
    assert all(f["input_ids"][0] == tokenizer.cls_token_id for f in feats)
    assert all(f["input_ids"][-1] == tokenizer.sep_token_id for f in feats)
    inner = [t for f in feats for t in f["input_ids"][1:-1]]
    stream = []
    for d in docs:
        stream += tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
    assert inner == stream[:-1]  # documents joined by [SEP], nothing lost, nothing added
    assert all(m == int(t in tokenizer.all_special_ids)
               for f in feats for t, m in zip(f["input_ids"], f["special_tokens_mask"],
                                              strict=True))


def read_docs(texts):
    from attnlab.tasks import TextExample

    return [TextExample(guid=str(i), text=t) for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def masked(tokenizer):
    """A large masked sample: 240 blocks of <= 64 tokens (about 14k maskable tokens)."""
    words = ("the quick brown fox jumps over lazy dogs while seven wizards quietly hex "
             "unaffable zebras near ancient riverbanks").split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40 + i % 23))
            for i in range(400)]
    feats = MLM.encode(read_docs(docs), tokenizer, max_length=64)[:240]
    feats[-1] = {**feats[-1], **{k: v[:20] for k, v in feats[-1].items() if k != "block_index"}}
    batch = MLM.collator(tokenizer, seed=0)(feats)  # the short last row forces padding
    original = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(f["input_ids"]) for f in feats], batch_first=True, padding_value=0)
    return feats, batch, original


def test_masking_never_touches_special_or_padding(masked, tokenizer):
    _, batch, original = masked
    special = torch.isin(original, torch.tensor(tokenizer.all_special_ids))
    assert special.any() and (batch["attention_mask"] == 0).any()
    chosen = batch["labels"] != -100
    assert not (chosen & special).any()
    assert torch.equal(batch["input_ids"][special], original[special])
    assert torch.equal(batch["labels"][chosen], original[chosen])  # labels = original ids
    assert "special_tokens_mask" not in batch


def test_masking_proportions_15_and_80_10_10(masked, tokenizer):
    _, batch, original = masked
    special = torch.isin(original, torch.tensor(tokenizer.all_special_ids))
    chosen = batch["labels"] != -100
    n = int(chosen.sum())
    # binomial standard errors here: 0.003 (rate over ~14k), 0.009 / 0.007 (shares of ~2k);
    # tolerances are about 4.5 standard errors
    assert abs(n / int((~special).sum()) - 0.15) < 0.015
    to_mask = (batch["input_ids"] == tokenizer.mask_token_id) & chosen
    kept = (batch["input_ids"] == original) & chosen
    rand = chosen & ~to_mask & ~kept
    assert abs(int(to_mask.sum()) / n - 0.8) < 0.04
    assert abs(int(rand.sum()) / n - 0.1) < 0.03
    assert abs(int(kept.sum()) / n - 0.1) < 0.03


def test_masking_is_seeded(masked, tokenizer):
    feats, batch, _ = masked
    again = MLM.collator(tokenizer, seed=0)(feats)
    other = MLM.collator(tokenizer, seed=1)(feats)
    assert torch.equal(again["input_ids"], batch["input_ids"])
    assert torch.equal(again["labels"], batch["labels"])
    assert not torch.equal(other["labels"], batch["labels"])


def test_masks_do_not_depend_on_what_the_collator_saw_before(masked, tokenizer):
    """A batch gets the same masks as the first call of a collator and as a later one (a
    resumed run's first batch is a later batch of the uninterrupted run)."""
    feats, _, _ = masked
    first = MLM.collator(tokenizer, seed=0)(feats[:8])
    warm = MLM.collator(tokenizer, seed=0)
    warm(feats[8:16])
    later = warm(feats[:8])
    assert torch.equal(first["labels"], later["labels"])
    assert torch.equal(first["input_ids"], later["input_ids"])


def test_loss_and_perplexity_by_hand():
    # vocabulary of 4: uniform logits give NLL log 4 per masked token (argmax: id 0)
    logits = torch.zeros(2, 3, 4)
    logits[1, 0] = torch.tensor([0.0, 0.0, math.log(2.0), 0.0])  # p(label 2) = 2/5
    labels = torch.tensor([[-100, 2, 0], [2, -100, -100]])
    preds = MLM.batch_predictions({"logits": logits}, {"labels": labels})
    assert preds[0][1:] == (2, 1) and preds[1][1:] == (1, 1)  # (count, argmax correct)
    nll = 2 * math.log(4) + math.log(5 / 2)
    assert preds[0][0] + preds[1][0] == pytest.approx(nll, rel=1e-6)  # fp32 log-softmax
    out = MLM.compute_metrics(preds)
    assert out["loss"] == pytest.approx(nll / 3, rel=1e-6)
    assert out["perplexity"] == pytest.approx(math.exp(nll / 3), rel=1e-6)
    assert out["accuracy"] == pytest.approx(2 / 3) and out["masked_tokens"] == 3.0


def test_real_corpus_counts():
    root = need_data("corpus_en")
    train, dev = MLM.load("train", root.parent), MLM.load("dev", root.parent)
    assert len(train) + len(dev) == 2624 and len(dev) == 2624 // 20
    wt = get_task("wikitext2")
    assert len(wt.load("test", root.parent)) > 0
    with pytest.raises(FileNotFoundError, match="wiki.train.tokens"):
        wt.load("train", root.parent)  # the README: WikiText-2 train is not staged
