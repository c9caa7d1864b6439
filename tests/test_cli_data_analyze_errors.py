"""Bad input to ``attnlab data ...``, ``attnlab analyze ...`` and ``attnlab report``: one
line naming the problem and the fix, exit status 2, checked before any work, and nothing
(no empty ``--out`` folder either) left on disk."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.tasks import listops as lo
from attnlab.tasks import recall as rc

runner = CliRunner()
SMALL_RECALL = ["--num-train", "4", "--num-dev", "2", "--num-test", "2"]
SQUAD_CTX = ("Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
             "pi rho sigma tau upsilon phi chi psi omega one two three four five six seven.")


class WorkStarted(Exception):
    """Raised by a stand-in for the command's first piece of work."""


def _work_started(*args, **kwargs):
    raise WorkStarted("the command started its work before checking its options")


def _invoke(args):
    return runner.invoke(app, [str(a) for a in args])


def _error_line(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert "Traceback" not in res.output
    return " ".join(res.output.split())


def _sst2(root, dev_label="1"):
    folder = root / "glue" / "SST-2"
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text("sentence\tlabel\na fine film\t1\na dull film\t0\n")
    (folder / "dev.tsv").write_text(f"sentence\tlabel\ngood\t{dev_label}\nbad\t0\n")
    return root


# ----------------------------------------------------------------------------- data: --out


@pytest.mark.parametrize("args,expect", [
    # the generators' argument names are given as the options the user typed
    (["recall", "--length", "7"], "--length must be even"),
    (["recall", "--vocab-size", "10"], "--vocab-size (10) must be larger than --length (64)"),
    (["listops", "--max-depth", "0"], "--max-depth must be >= 1"),
    (["text", "--min-bytes", "50", "--max-bytes", "10", "--data-dir", "{sst}"],
     "--min-bytes <= --max-bytes"),
    (["text", "--data-dir", "{bad_sst}"], "bad label '7'"),
])
def test_bad_data_options_leave_no_out_folder(tmp_path, args, expect):
    _sst2(tmp_path / "sst")
    _sst2(tmp_path / "bad_sst", dev_label="7")
    out = tmp_path / "new" / "out"
    args = [a.format(sst=tmp_path / "sst", bad_sst=tmp_path / "bad_sst") for a in args]
    line = _error_line(_invoke(["data", *args, "--out", out]))
    assert expect in line
    assert not (tmp_path / "new").exists()  # neither --out nor the folder above it


@pytest.mark.parametrize("command", ["recall", "listops", "text"])
@pytest.mark.parametrize("below", ["", "sub"])
def test_data_out_that_is_a_file(tmp_path, monkeypatch, command, below):
    from attnlab.tasks import bytetext as bt

    for module, names in ((rc, ("generate_recall", "write_recall")),
                          (lo, ("generate_listops", "write_listops")),
                          (bt, ("generate_text", "write_text"))):
        for name in names:
            monkeypatch.setattr(module, name, _work_started)
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    data = ["--data-dir", _sst2(tmp_path / "sst")] if command == "text" else []
    line = _error_line(_invoke(["data", command, "--out", afile / below, *data]))
    assert f"{afile} is a file, not a folder; give a folder path" in line
    assert afile.read_text() == "keep me"


def test_interrupted_listops_leaves_no_folder(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lo, "generate_listops", interrupted)
    res = _invoke(["data", "listops", "--out", tmp_path / "new" / "lo"])
    assert res.exit_code != 0
    assert not (tmp_path / "new").exists()


def test_a_failed_write_removes_what_the_command_made(tmp_path, monkeypatch):
    real = rc.write_jsonl
    calls = []

    def second_fails(examples, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C between two splits
        return real(examples, path)

    monkeypatch.setattr(rc, "write_jsonl", second_fails)
    res = _invoke(["data", "recall", "--out", tmp_path / "new" / "rc", *SMALL_RECALL])
    assert res.exit_code != 0 and len(calls) == 2
    assert not (tmp_path / "new").exists()  # train.jsonl went, then the folders

    # a folder that was there stays, and so do files the command did not make
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    calls.clear()

    def disk_full(examples, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(examples, path)

    monkeypatch.setattr(rc, "write_jsonl", disk_full)
    line = _error_line(_invoke(["data", "recall", "--out", kept, *SMALL_RECALL]))
    assert "disk full" in line
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]


def test_data_recall_still_writes(tmp_path):
    out = tmp_path / "a" / "b"
    res = _invoke(["data", "recall", "--out", out, *SMALL_RECALL])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["dev.jsonl", "test.jsonl", "train.jsonl"]
    assert len((out / "train.jsonl").read_text().splitlines()) == 4


# ----------------------------------------------------------------------------- squad-windows


@pytest.fixture
def squad_dir(tmp_path):
    question, answer = "Which letter?", "pi rho"
    doc = {"version": "1.1", "data": [{"title": "A", "paragraphs": [{
        "context": SQUAD_CTX, "qas": [{"id": "1", "question": question, "answers": [
            {"text": answer, "answer_start": SQUAD_CTX.index(answer)}]}]}]}]}
    (tmp_path / "dev-v1.1.json").write_text(json.dumps(doc))
    return tmp_path


@pytest.mark.parametrize("args,expect", [
    (["--stride", "500"], "--stride 500 must be >= 0 and below --max-length 256"),
    (["--stride", "-1"], "--stride -1 must be >= 0 and below --max-length 256"),
    (["--max-length", "0"], "--max-length 0: give 1 or more"),
    (["--max-length", "24", "--stride", "20"], "stride 20 must be smaller than the context "
                                                "room"),  # the task's own check, no table
    (["--splits", "dev:-1"], "LIMIT >= 1"),
])
def test_squad_windows_checks_before_printing(squad_dir, args, expect):
    res = _invoke(["data", "squad-windows", "--data-dir", squad_dir, "--splits", "dev:1",
                   *args])
    line = _error_line(res)  # no half table before it
    assert expect in line


# ----------------------------------------------------------------------------- analyze, report


@pytest.fixture
def no_work(monkeypatch):
    from attnlab.recipes import analyze, connections, run_report

    monkeypatch.setattr(analyze, "load_model", _work_started)
    monkeypatch.setattr(connections, "load_ner_model", _work_started)
    monkeypatch.setattr(run_report, "run_report", _work_started)


@pytest.mark.parametrize("args,kind", [
    (["analyze", "heads", "--out", "{path}"], "folder"),
    (["analyze", "heads", "--compare", "default", "default", "--out", "{path}"], "folder"),
    (["analyze", "importance", "somerun", "--out", "{path}"], "folder"),
    (["analyze", "connections", "--out", "{path}"], "folder"),
    (["analyze", "overlap", "default", "--out", "{path}"], "file"),
    (["analyze", "links", "--out", "{path}"], "file"),
    (["report", "somerun", "--out", "{path}"], "file"),
])
def test_analysis_outputs_are_checked_before_any_work(tmp_path, no_work, args, kind):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    path = afile / "x.json" if kind == "file" else afile
    line = _error_line(_invoke([a.format(path=path) for a in args]))
    assert f"{afile} is a file, not a folder" in line
    if kind == "file":  # and a folder where a file goes
        line = _error_line(_invoke([a.format(path=tmp_path) for a in args]))
        assert "a folder is there; give a file name" in line
    assert afile.read_text() == "keep me"


@pytest.mark.parametrize("option", ["--sample", "--batch-size"])
def test_report_names_the_option_given(tmp_path, no_work, option):
    line = _error_line(_invoke(["report", tmp_path, option, "0"]))
    assert f"{option} 0: give 1 or more" in line and "--limit" not in line


def test_importance_refuses_a_metric_without_the_ablation(no_work):
    line = _error_line(_invoke(["analyze", "importance", "somerun", "--metric", "nosuch",
                                "--no-ablation"]))
    assert "--metric nosuch" in line and "--no-ablation" in line
