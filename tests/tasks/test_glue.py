"""GLUE loaders on tiny TSV fixtures in the glue_data layout, encoding, collation, metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tasks_helpers import need_data, write

from attnlab.tasks import DataFormatError, get_task

FIXTURES = {
    # CoLA: no header; dev has no trailing newline (as in GLUE)
    "CoLA/train.tsv": "gj04\t1\t\tThe cat sat.\ngj04\t0\t*\tCat the sat.\n",
    "CoLA/dev.tsv": "gj04\t1\t\tThe dog ran.\ncj99\t0\t*\tDog ran the.",
    "CoLA/test.tsv": "index\tsentence\n0\tBirds fly.\n",
    "SST-2/train.tsv": "sentence\tlabel\ngood film \t1\nbad film \t0\n",
    # MRPC: UTF-8 BOM before the header and bare double quotes in the text
    "MRPC/train.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                      '1\t1\t2\tHe said " yes .\tHe agreed .\n0\t3\t4\tA b .\tC d .\n',
    "STS-B/train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1"
                       "\tsentence2\tscore\n0\tg\tf\ty\t0\tn\tn\tA man.\tA person.\t4.250\n",
    "QQP/train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                     "0\t1\t2\tHow?\tWhy?\t0\n1\t3\t4\tWho?\tWho is?\t1\n",
    "MNLI/train.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                      "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\t"
                      "sentence2\tlabel1\tgold_label\n"
                      "0\t1\t1e\tgov\t(x)\t(y)\t(X)\t(Y)\tP one.\tH one.\tneutral\tneutral\n",
    "MNLI/dev_matched.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                            "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\t"
                            "sentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\t"
                            "gold_label\n0\t1\t1e\tgov\t(x)\t(y)\t(X)\t(Y)\tP.\tH.\t"
                            "contradiction\tcontradiction\tneutral\tcontradiction\t"
                            "contradiction\tcontradiction\n",
    "MNLI/dev_mismatched.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                               "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\t"
                               "sentence1\tsentence2\tlabel1\tgold_label\n"
                               "0\t1\t1e\tfic\t(x)\t(y)\t(X)\t(Y)\tP.\tH.\tentailment\t"
                               "entailment\n",
    "QNLI/dev.tsv": "index\tquestion\tsentence\tlabel\n0\tWhat?\tThis.\tnot_entailment\n",
    "RTE/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n",
    "WNLI/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\t1\n",
}


@pytest.fixture
def glue_root(tmp_path):
    for rel, text in FIXTURES.items():
        write(tmp_path / "glue" / rel, text)
    return tmp_path


@pytest.mark.parametrize(
    "task, split, expected",
    [
        ("cola", "train", [("The cat sat.", None, 1), ("Cat the sat.", None, 0)]),
        ("cola", "dev", [("The dog ran.", None, 1), ("Dog ran the.", None, 0)]),
        ("cola", "test", [("Birds fly.", None, None)]),
        ("sst2", "train", [("good film ", None, 1), ("bad film ", None, 0)]),
        ("mrpc", "train", [('He said " yes .', "He agreed .", 1), ("A b .", "C d .", 0)]),
        ("stsb", "train", [("A man.", "A person.", 4.25)]),
        ("qqp", "train", [("How?", "Why?", 0), ("Who?", "Who is?", 1)]),
        ("mnli", "train", [("P one.", "H one.", 1)]),
        ("mnli", "dev_matched", [("P.", "H.", 2)]),
        ("mnli", "dev_mismatched", [("P.", "H.", 0)]),
        ("qnli", "validation", [("What?", "This.", 1)]),  # alias of dev
        ("rte", "train", [("A.", "B.", 0)]),
        ("wnli", "train", [("A.", "B.", 1)]),
    ],
)
def test_every_glue_format_loads(glue_root, task, split, expected):
    rows = get_task(task).load(split, glue_root)
    assert [(r.text_a, r.text_b, r.label) for r in rows] == expected


def test_data_dir_may_be_the_glue_root_or_the_task_folder(glue_root):
    cola = get_task("cola")
    a = cola.load("train", glue_root / "glue")
    b = cola.load("train", glue_root / "glue" / "CoLA")
    assert a == b == cola.load("train", glue_root)


def test_missing_files_name_the_paths_tried(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"CoLA/train\.tsv"):
        get_task("cola").load("train", tmp_path)
    with pytest.raises(ValueError, match="available splits: train, dev_matched"):
        get_task("mnli").load("dev", tmp_path)


@pytest.mark.parametrize(
    "rel, text, line, message",
    [
        ("CoLA/train.tsv", "gj04\t1\t\tFine.\ngj04\t1\tToo few.\n", 2, "expected 4"),
        ("CoLA/train.tsv", "gj04\t1\t\tFine.\ngj04\t1\t\tOk.\ngj04\tyes\t\tBad.\n", 3,
         "bad label 'yes'"),
        ("RTE/train.tsv", "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tmaybe\n", 2,
         "bad label 'maybe'; expected one of \\['entailment', 'not_entailment'\\]"),
        ("STS-B/train.tsv", "index\tsentence1\tsentence2\tscore\n0\tA.\tB.\tfive\n", 2,
         "bad score 'five'"),
        ("SST-2/train.tsv", "sentence\tlabel\nok\t1\nan extra\tcolumn\t1\n", 3, "found 3"),
        ("QQP/train.tsv", "id\tquestion1\tquestion2\n0\ta\tb\n", 1, "no 'is_duplicate'"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, rel, text, line, message):
    path = write(tmp_path / rel, text)
    task = {"CoLA": "cola", "RTE": "rte", "STS-B": "stsb", "SST-2": "sst2", "QQP": "qqp"}[
        rel.split("/")[0]]
    with pytest.raises(DataFormatError, match=message) as e:
        get_task(task).load("train", tmp_path)
    assert e.value.line == line and e.value.path == str(path)
    assert str(e.value).startswith(f"{path}:{line}: ")


def test_builtin_cola_sample():
    cola = get_task("cola")
    train, dev = cola.load("train", "builtin"), cola.load("dev", "builtin")
    assert (len(train), len(dev)) == (400, 150)
    assert {r.label for r in train} == {0, 1}
    with pytest.raises(ValueError, match="only cola has"):
        get_task("sst2").load("train", "builtin")


def test_encode_pairs_truncate_and_collate(glue_root, tokenizer):
    task = get_task("mrpc")
    rows = task.load("train", glue_root)
    feats = task.encode(rows, tokenizer, max_length=8)
    assert all(len(f["input_ids"]) <= 8 for f in feats)
    assert 1 in feats[0]["token_type_ids"]  # the second sentence is segment 1
    assert [f["labels"] for f in feats] == [1, 0]
    batch = task.collator(tokenizer)(feats)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert batch["labels"].dtype == torch.long
    assert batch["input_ids"].shape == batch["attention_mask"].shape


def test_regression_labels_collate_as_float(glue_root, tokenizer):
    task = get_task("stsb")
    assert (task.num_labels, task.problem_type) == (1, "regression")
    feats = task.encode(task.load("train", glue_root), tokenizer, 32)
    batch = task.collator(tokenizer)(feats)
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == [4.25]


def test_test_split_has_no_labels(glue_root, tokenizer):
    task = get_task("cola")
    feats = task.encode(task.load("test", glue_root), tokenizer, 16)
    assert "labels" not in feats[0] and "labels" not in task.collator(tokenizer)(feats)
    with pytest.raises(ValueError, match="no labels"):
        task.compute_metrics([np.zeros(2)], feats, [])


def test_compute_metrics_from_logits():
    cola = get_task("cola")
    labels = [1, 1, 1, 0, 0, 1]
    preds = [1, 0, 1, 0, 1, 1]  # the hand-checked confusion matrix: MCC 0.25
    logits = [np.array([0.0, 1.0]) if p else np.array([1.0, 0.0]) for p in preds]
    feats = [{"labels": y} for y in labels]
    out = cola.compute_metrics(logits, feats, [])
    assert out["mcc"] == pytest.approx(0.25) and cola.main_metric in out
    stsb = get_task("stsb")
    out = stsb.compute_metrics([np.array([s]) for s in (1, 2, 3, 4)],
                               [{"labels": y} for y in (1.0, 3.0, 2.0, 4.0)], [])
    assert out["spearman"] == pytest.approx(0.8)


def test_batch_predictions_one_row_per_feature():
    logits = torch.tensor([[0.1, 0.9], [0.7, 0.3], [0.5, 0.5]])
    rows = get_task("sst2").batch_predictions({"logits": logits}, {})
    assert len(rows) == 3 and np.allclose(rows[1], [0.7, 0.3])


@pytest.mark.parametrize(
    "task, split, count",
    [("cola", "train", 8551), ("cola", "dev", 1043), ("cola", "test", 1063),
     ("mrpc", "train", 3668), ("mrpc", "dev", 408), ("rte", "train", 2490),
     ("rte", "dev", 277), ("stsb", "dev", 1500), ("qnli", "dev", 5463), ("wnli", "dev", 71)],
)
def test_real_glue_counts_match_the_readme(task, split, count):
    root = need_data("glue")
    rows = get_task(task).load(split, root)
    assert len(rows) == count


def test_real_cola_label_distribution():
    rows = get_task("cola").load("dev", need_data())
    assert sum(r.label == 0 for r in rows) == 322 and sum(r.label == 1 for r in rows) == 721
