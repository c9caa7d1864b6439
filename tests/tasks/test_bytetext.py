"""Byte-level text from SST-2 (tasks/bytetext.py): the label is the marked sentence's SST-2
label (checked against the source file), lengths, no sentence shared across splits,
byte-identical seeded files, the loader's file:line errors, encoding."""

from __future__ import annotations

import json

import pytest
from tasks_helpers import need_data, write

from attnlab.tasks import DataFormatError, get_task
from attnlab.tasks import bytetext as bt
from attnlab.tasks.symbols import BYTE_NAMES, symbol_tokenizer


@pytest.fixture(scope="module")
def sst2():
    return need_data("glue", "SST-2")


def _sst2_rows(folder, split):
    """line number -> (stripped sentence, label), read directly from the TSV."""
    lines = (folder / f"{split}.tsv").read_text(encoding="utf-8").split("\n")
    out = {}
    for i, line in enumerate(lines[1:], start=2):
        if line:
            sentence, label = line.split("\t")
            out[i] = (sentence.strip(), int(label))
    return out


def test_label_is_the_marked_sentences_label(sst2):
    docs = bt.generate_text(sst2.parent.parent, 40, 40, min_bytes=300, max_bytes=600, seed=1)
    for split in ("train", "dev"):
        source = _sst2_rows(sst2, split)
        for doc in docs[split]:
            assert len(doc.text.encode("utf-8")) <= 600
            marked = bt.marked_segment(doc.text)
            src_split, line = doc.source.rsplit("-", 1)
            assert src_split == split and source[int(line)] == (marked, doc.label)
    labels = [d.label for d in docs["train"]]
    assert 0 < sum(labels) < len(labels)  # both labels occur
    starts = {d.text.index(bt.MARK_OPEN) for d in docs["train"]}
    assert len(starts) > 10 and min(starts) < 100 < max(starts)  # anywhere in the document


def test_no_sentence_is_shared_between_train_and_dev(sst2):
    sentences = bt.sst2_sentences(sst2.parent.parent)
    assert not {s.text for s in sentences["train"]} & {s.text for s in sentences["dev"]}
    assert len(sentences["dev"]) == 872


def test_seeded_files_are_byte_identical(sst2, tmp_path):
    root = sst2.parent.parent
    kw = {"num_train": 10, "num_dev": 5, "min_bytes": 200, "max_bytes": 400}
    a = bt.write_text(tmp_path / "a", root, seed=2, **kw)
    b = bt.write_text(tmp_path / "b", root, seed=2, **kw)
    c = bt.write_text(tmp_path / "c", root, seed=3, **kw)
    assert a["train"].read_bytes() == b["train"].read_bytes() != c["train"].read_bytes()
    assert a["dev"].read_bytes() == b["dev"].read_bytes()
    assert len(get_task("text").load("train", tmp_path / "a")) == 10


def _line(**change) -> str:
    rec = {"text": "dull . \x02a gorgeous film\x03 so so", "label": 1, "source": "dev-7"}
    return json.dumps({**rec, **change})


@pytest.mark.parametrize("bad, match", [
    ("[1, 2", "not valid JSON"),
    (_line(label=2), "bad label 2"),
    (_line(label=True), "bad label True"),
    (_line(text="no marks at all"), "exactly one marked segment"),
    (_line(text="\x03 closed before \x02 opened"), "comes before"),
    (_line(text="an empty \x02\x03 segment"), "marked segment is empty"),
    (json.dumps({"text": "x"}), "expected an object"),
])
def test_loader_names_file_and_line(tmp_path, bad, match):
    write(tmp_path / "train.jsonl", _line() + "\n" + bad + "\n")
    with pytest.raises(DataFormatError, match=match) as err:
        get_task("text").load("train", tmp_path)
    assert f"{tmp_path / 'train.jsonl'}:2:" in str(err.value)


def test_a_byte_that_is_not_utf8_names_file_and_line(tmp_path):
    # read_lines decodes line by line: the error names the line, not a block offset
    (tmp_path / "train.jsonl").write_bytes(
        (_line() + "\n").encode() * 3 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataFormatError, match=r"train.jsonl:4: byte 0xe9 at column 14 is "
                       "not UTF-8; save the file as UTF-8"):
        get_task("text").load("train", tmp_path)


def test_encode_is_cls_bytes_sep(tmp_path):
    write(tmp_path / "dev.jsonl", _line() + "\n")
    task = get_task("text")
    ex = task.load("dev", tmp_path)
    tok = symbol_tokenizer(BYTE_NAMES)
    raw = ex[0].text.encode("utf-8")
    feats = task.encode(ex, tok, max_length=512)
    assert feats[0]["input_ids"] == [2, *(5 + b for b in raw), 3]
    assert feats[0]["labels"] == 1
    with pytest.warns(UserWarning, match=r"1 of 1 documents lose \(part of\) their marked "
                      r"segment at max_length 10.*--max-bytes 8"):
        assert len(task.encode(ex, tok, max_length=10)[0]["input_ids"]) == 10


def test_encode_warns_only_when_a_marked_segment_is_cut(tmp_path, recwarn):
    text = "dull . \x02a gorgeous film\x03 so so"  # the closing mark is byte 23
    write(tmp_path / "dev.jsonl", _line(text=text) + "\n" + _line(text="\x02ok\x03") + "\n")
    task, tok = get_task("text"), symbol_tokenizer(BYTE_NAMES)
    ex = task.load("dev", tmp_path)
    task.encode(ex, tok, max_length=26)  # bytes 0..23 kept: the segment is whole
    assert not recwarn.list
    with pytest.warns(UserWarning, match="1 of 2 documents"):
        task.encode(ex, tok, max_length=25)
