"""CoNLL-2003: column parsing, IOB1 -> IOB2, first-sub-word labels, word-level metrics."""

from __future__ import annotations

import numpy as np
import pytest
from tasks_helpers import need_data, write

from attnlab.tasks import DataFormatError, get_task, iob1_to_iob2, read_conll

# IOB1 tags (as in the original eng.train); no blank line at the end of the file
IOB1 = """-DOCSTART- -X- -X- O

U.N. NNP I-NP I-ORG
official NN I-NP O
Ekeus NNP I-NP I-PER
heads VBZ I-VP O
for IN I-PP O
Baghdad NNP I-NP I-LOC
. . O O

-DOCSTART- -X- -X- O

Peter NNP I-NP I-PER
Blackburn NNP I-NP I-PER
Germany NNP I-NP I-LOC
France NNP I-NP B-LOC"""


def test_iob1_to_iob2():
    assert iob1_to_iob2(["I-PER", "I-PER", "O", "I-LOC"]) == ["B-PER", "I-PER", "O", "B-LOC"]
    # a type change starts a new entity; IOB1's B- (adjacent same type) is kept
    assert iob1_to_iob2(["I-PER", "I-LOC", "B-LOC", "I-LOC"]) == [
        "B-PER", "B-LOC", "B-LOC", "I-LOC"]
    iob2 = ["B-ORG", "I-ORG", "O", "B-MISC", "B-MISC"]
    assert iob1_to_iob2(iob2) == iob2  # IOB2 is a fixed point


def test_read_conll_skips_docstart_and_converts(tmp_path):
    rows = read_conll(write(tmp_path / "train.txt", IOB1))
    assert len(rows) == 2
    assert rows[0].tokens == ("U.N.", "official", "Ekeus", "heads", "for", "Baghdad", ".")
    assert rows[0].ner_tags == ("B-ORG", "O", "B-PER", "O", "O", "B-LOC", "O")
    assert rows[0].pos_tags[0] == "NNP" and rows[0].chunk_tags[:2] == ("B-NP", "I-NP")
    assert rows[1].ner_tags == ("B-PER", "I-PER", "B-LOC", "B-LOC")  # last line, no newline
    assert rows[0].guid == "train-3"  # line where the sentence starts


def test_task_load_from_root_or_folder(tmp_path):
    write(tmp_path / "conll2003" / "valid.txt", IOB1)
    task = get_task("conll2003")
    assert task.load("dev", tmp_path) == task.load("valid", tmp_path / "conll2003")
    with pytest.raises(ValueError, match="local files only"):
        task.load("train")


@pytest.mark.parametrize(
    "line, message",
    [("Baghdad NNP I-LOC", "expected 4 space-separated columns"),
     ("Baghdad NNP I-NP B-CITY", "bad NER tag 'B-CITY'"),
     ("Baghdad NNP I-NP LOC", "bad NER tag 'LOC'")],
)
def test_malformed_lines_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "train.txt", f"-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\n{line}\n")
    with pytest.raises(DataFormatError, match=message) as e:
        read_conll(path)
    assert (e.value.path, e.value.line) == (str(path), 4)
    assert str(e.value).startswith(f"{path}:4: ")


def test_first_subword_alignment(tmp_path, tokenizer):
    text = "EU NNP B-NP B-ORG\nunaffable JJ B-NP O\nGermans NNPS I-NP B-MISC\n"
    task = get_task("conll2003")
    rows = read_conll(write(tmp_path / "t.txt", text))
    (f,) = task.encode(rows, tokenizer, max_length=32)
    toks = tokenizer.convert_ids_to_tokens(f["input_ids"])
    assert toks[0] == "[CLS]" and toks[-1] == "[SEP]"
    assert "##" in "".join(toks)  # "unaffable" really splits into several sub-words
    lid = {n: i for i, n in enumerate(task.label_names)}
    expected = []
    for pos, wid in enumerate(f["word_ids"]):
        first = wid is not None and (pos == 0 or f["word_ids"][pos - 1] != wid)
        expected.append(lid[rows[0].ner_tags[wid]] if first else -100)
        assert first == (wid is not None and not toks[pos].startswith("##"))
    assert f["labels"] == expected
    assert f["labels"][0] == f["labels"][-1] == -100
    assert [x for x in f["labels"] if x != -100] == [lid["B-ORG"], lid["O"], lid["B-MISC"]]
    batch = task.collator(tokenizer)([f, f])
    assert batch["labels"].shape == batch["input_ids"].shape and "word_ids" not in batch


def test_word_level_metrics_and_truncation(tmp_path, tokenizer):
    task = get_task("conll2003")
    rows = read_conll(write(tmp_path / "t.txt", IOB1))
    feats = task.encode(rows, tokenizer, max_length=64)
    # predictions = the gold label at every first sub-word (anything elsewhere)
    perfect = [np.array([max(x, 0) for x in f["labels"]]) for f in feats]
    out = task.compute_metrics(perfect, feats, rows)
    assert out["f1"] == 1.0 and out["accuracy"] == 1.0
    # cut the second sentence before its last word: that LOC counts as missed (predicted O)
    short = task.encode(rows, tokenizer, max_length=5)
    perfect = [np.array([max(x, 0) for x in f["labels"]]) for f in short]
    pred = task.word_predictions(perfect, short, rows)
    assert pred[1][-1] == "O" and rows[1].ner_tags[-1] == "B-LOC"
    assert task.compute_metrics(perfect, short, rows)["recall"] < 1.0


def test_batch_predictions_drop_padding():
    import torch

    logits = torch.zeros(2, 4, 9)
    logits[0, :, 3] = 1.0
    logits[1, :2, 5] = 1.0
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = get_task("conll2003").batch_predictions({"logits": logits}, {"attention_mask": mask})
    assert [p.tolist() for p in out] == [[3, 3, 3, 3], [5, 5]]


def test_real_conll_counts_match_the_readme():
    task = get_task("conll2003")
    root = need_data("conll2003")
    train = task.load("train", root)
    assert len(train) == 14041
    assert sum(len(r.tokens) for r in train) == 203621
    ents = [t for r in train for t in r.ner_tags if t.startswith("B-")]
    assert ents.count("B-PER") == 6600 and ents.count("B-MISC") == 3438
    assert len(task.load("dev", root)) == 3250
