"""Atomic writes (attnlab.io) and the writers that use them: whole files, usual permissions."""

from __future__ import annotations

import os
import stat

import pytest

from attnlab.io import atomic_path, atomic_write, write_json


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_write_text_bytes_and_json(tmp_path, umask_022):
    text = atomic_write(tmp_path / "a" / "b.txt", "héllo\n")  # parents are made
    assert text.read_text(encoding="utf-8") == "héllo\n"
    assert atomic_write(tmp_path / "c.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    assert write_json(tmp_path / "d.json", {"x": 1}).read_text() == '{\n  "x": 1\n}'
    for p in (text, tmp_path / "c.bin", tmp_path / "d.json"):
        assert _mode(p) == 0o644, oct(_mode(p))  # not mkstemp's private 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c.bin", "d.json"]


def test_atomic_path_keeps_the_suffix_and_cleans_up_on_error(tmp_path):
    target = tmp_path / "plot.png"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path and tmp.name.startswith(".")
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"  # the old file stays whole
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]  # no temporary left


def test_listops_tsv_is_written_atomically_with_usual_mode(tmp_path, umask_022):
    from attnlab.tasks.listops import write_tsv

    path = write_tsv([("[MAX 2 9 ]", 9), ("[MIN 4 1 ]", 1)], tmp_path / "basic_train.tsv")
    assert path.read_text().splitlines() == ["Source\tTarget", "[MAX 2 9 ]\t9", "[MIN 4 1 ]\t1"]
    assert _mode(path) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["basic_train.tsv"]


def test_saved_plan_files_have_usual_mode(tiny_bert, tmp_path, umask_022):
    import attnlab

    attnlab.apply_plan(tiny_bert, "all:0:band(window=2)")
    attnlab.save_pretrained(tiny_bert, tmp_path)
    for name in ("plan.json", "surgery.json"):
        assert _mode(tmp_path / name) == 0o644, name
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_jsonl_reads_past_a_cut_line_and_appends_after_it(tmp_path):
    from attnlab.io import append_jsonl, read_jsonl

    log = tmp_path / "rows.jsonl"
    assert read_jsonl(log) == []
    append_jsonl(log, {"a": 1})
    log.write_text(log.read_text() + '{"b": 2, "cut')  # an append killed mid-line
    append_jsonl(log, {"c": 3})
    assert read_jsonl(log) == [{"a": 1}, {"c": 3}]
    assert log.read_text().splitlines() == ['{"a": 1}', '{"b": 2, "cut', '{"c": 3}']
