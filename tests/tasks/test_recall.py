"""MQAR (tasks/recall.py, Zoology's construction): labels checked independently of the
generator, byte-identical seeded files, the loader's file:line errors, encoding, metric."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tasks_helpers import write

from attnlab.tasks import DataFormatError, Task, get_task
from attnlab.tasks import recall as rc
from attnlab.tasks.symbols import number_names, symbol_tokenizer

TINY = {"num_train": 20, "num_dev": 5, "num_test": 5, "vocab_size": 64, "input_seq_len": 32,
        "num_kv_pairs": 4}


def test_labels_are_the_values_of_the_queried_keys():
    """Independent check: the context is k1 v1 .. kK vK; each labelled position holds a key
    of the context and its label is the value right after that key; nothing else is
    labelled; keys and values come from the two halves of the vocabulary."""
    v, n, k = 64, 48, 5
    inputs, labels = rc.multiquery_ar(30, vocab_size=v, input_seq_len=n, seed=1, num_kv_pairs=k)
    assert inputs.shape == labels.shape == (30, n)
    for row, lab in zip(inputs, labels, strict=True):
        keys, values = row[0:2 * k:2], row[1:2 * k:2]
        assert len(set(keys)) == k and all(1 <= x < v // 2 for x in keys)
        assert len(set(values)) == k and all(v // 2 <= x < v for x in values)
        answer = dict(zip(keys.tolist(), values.tolist(), strict=True))
        pos = np.flatnonzero(lab != rc.IGNORE)
        assert len(pos) == k and all(p >= 2 * k and (p - 2 * k) % 2 == 0 for p in pos)
        assert {int(row[p]) for p in pos} == set(answer)  # one query per key
        for p in pos:
            assert lab[p] == answer[int(row[p])]


def test_without_filler_the_layout_is_zoologys_example():
    # zoology's docstring example (there with vocab_size=12, which its own assertion V > n
    # refuses): keys and values, then queries on even slots, zeros elsewhere
    inputs, labels = rc.multiquery_ar(1, vocab_size=20, input_seq_len=16, num_kv_pairs=2,
                                      seed=0, random_non_queries=False)
    row, lab = inputs[0], labels[0]
    assert all(row[4:][lab[4:] == rc.IGNORE] == 0)  # everything but the queries is filler
    assert (lab[:4] == rc.IGNORE).all() and (lab != rc.IGNORE).sum() == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"input_seq_len": 33}, "even"),
    ({"vocab_size": 32}, "larger than input_seq_len"),
    ({"num_kv_pairs": 9}, "4 \\* num_kv_pairs"),
])
def test_zoologys_assertions_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rc.multiquery_ar(1, **{"vocab_size": 64, "input_seq_len": 32, "num_kv_pairs": 4,
                               **kwargs})


def test_seeded_files_are_byte_identical(tmp_path):
    a = rc.write_recall(tmp_path / "a", seed=3, **TINY)
    b = rc.write_recall(tmp_path / "b", seed=3, **TINY)
    c = rc.write_recall(tmp_path / "c", seed=4, **TINY)
    for split in ("train", "dev", "test"):
        assert a[split].read_bytes() == b[split].read_bytes()
        assert a[split].read_bytes() != c[split].read_bytes()
    assert a["train"].read_bytes() != a["dev"].read_bytes()  # splits use their own seeds
    examples = get_task("recall").load("train", tmp_path / "a")
    assert len(examples) == 20 and examples[0].vocab_size == 64


def _line(**change) -> str:
    rec = {"vocab_size": 16, "input": [3, 9, 5, 12, 0, 3, 7, 5], "queries": [[5, 9], [7, 12]]}
    return json.dumps({**rec, **change})


@pytest.mark.parametrize("bad, match", [
    ("{not json", "not valid JSON"),
    (_line(vocab_size=2), "vocab_size must be an int >= 4"),
    (_line(input=[3, 99]), "input ids must lie in 0..15"),
    (_line(queries=[[5, 3]]), "not a value id"),
    (_line(queries=[[4, 9]]), "not a key id"),
    (_line(queries=[[5, 12]]), "no '3 12' pair precedes it"),
    (_line(queries=[[5, 9], [5, 9]]), "out of range or repeated"),
    (json.dumps({"input": [1]}), "expected an object with the keys"),
])
def test_loader_names_file_and_line(tmp_path, bad, match):
    write(tmp_path / "dev.jsonl", _line() + "\n" + bad + "\n")
    with pytest.raises(DataFormatError, match=match) as err:
        get_task("recall").load("dev", tmp_path)
    assert f"{tmp_path / 'dev.jsonl'}:2:" in str(err.value)


def test_a_larger_vocabulary_than_the_task_is_refused(tmp_path):
    rc.write_recall(tmp_path, **{**TINY, "vocab_size": 128})
    small = rc.RecallTask(num_labels=64)
    with pytest.raises(DataFormatError, match="exceeds the task's 64 classes"):
        small.load("dev", tmp_path)


def test_encode_labels_and_metric(tmp_path):
    write(tmp_path / "dev.jsonl", _line() + "\n")
    task = get_task("recall")
    assert isinstance(task, Task) and task.head == "token-classification"
    examples = task.load("dev", tmp_path)
    tok = symbol_tokenizer(number_names(16))
    feats = task.encode(examples, tok, max_length=8)
    assert feats[0]["input_ids"] == [5 + t for t in [3, 9, 5, 12, 0, 3, 7, 5]]
    assert feats[0]["labels"] == [-100] * 5 + [9, -100, 12]
    perfect = [np.array([0, 0, 0, 0, 0, 9, 0, 12])]
    half = [np.array([0, 0, 0, 0, 0, 9, 0, 11])]
    assert task.compute_metrics(perfect, feats)["accuracy"] == 1.0
    assert task.compute_metrics(half, feats)["accuracy"] == 0.5
    cut = task.encode(examples, tok, max_length=6)  # the query at position 7 is cut off
    assert cut[0]["labels"] == [-100] * 5 + [9]
    batch = task.collator(tok)(feats + cut)
    assert batch["labels"].shape == (2, 8) and batch["labels"][1, -1] == -100
