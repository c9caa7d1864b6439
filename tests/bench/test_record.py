"""``attnlab bench record``: sections run into their folders, swap in only on success,
resume, render docs/benchmarks.md; the repository's manifest is valid and its Markdown is
what the recorded folders render to."""

from __future__ import annotations

import json
import shlex
from importlib import metadata
from pathlib import Path

import pytest
import torch

from attnlab.bench.record import RecordError, load_manifest, record, render, select
from attnlab.bench.suite import bench_spec
from attnlab.core import resolve_config
from attnlab.core.spec import split_top

REPO = Path(__file__).resolve().parents[2]

WRITE_TABLE = ("python -c \"import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
               "(p / 'table.md').write_text('| a |\\n|---|\\n| 1 |\\n'); "
               "(p / 'chart.png').write_bytes(b'png')\" {out}")
PRINT_TABLE = "python -c \"print('| b |'); print('|---|'); print('| 2 |')\""
FAIL = "python -c \"import sys; sys.exit(3)\""


def _manifest(tmp_path: Path, sections: list[dict]) -> Path:
    import yaml

    path = tmp_path / "bench" / "record.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"preamble": "How we measure.", "sections": sections}))
    return path


def _sec(id_: str, command: str, **kw) -> dict:
    return {"id": id_, "title": f"Title {id_}", "text": f"About {id_}.", "command": command,
            **kw}


def test_record_runs_renders_and_resumes(tmp_path):
    m = _manifest(tmp_path, [_sec("files", WRITE_TABLE, image="chart.png"),
                             _sec("printed", PRINT_TABLE, stdout=True)])
    out = tmp_path / "docs" / "benchmarks.md"
    res = record(m, out, notify=lambda _: None)
    assert res == {"ran": ["files", "printed"], "kept": [], "failed": [], "output": str(out)}
    for sid in ("files", "printed"):
        rec = json.loads((m.parent / sid / "record.json").read_text())
        # the installed distribution's version (a PyPI CUDA build's torch.__version__ adds
        # "+cu130", which its metadata does not carry)
        assert rec["id"] == sid and rec["versions"]["torch"] == metadata.version("torch")
        assert not (m.parent / f"{sid}.partial").exists()
    md = out.read_text()
    assert md.startswith("# Benchmarks") and "How we measure." in md
    assert "| a |" in md and "| 2 |" in md and "Not recorded yet" not in md
    assert "bench/files\n```" in md  # {out} shown as the section's folder
    assert "![Title files](../bench/files/chart.png)" in md
    assert md.index("Title files") < md.index("Title printed")
    # a second run measures nothing: both sections are recorded
    again = record(m, out, notify=lambda _: None)
    assert again["ran"] == [] and again["kept"] == ["files", "printed"]
    assert out.read_text() == md


def test_failed_section_keeps_previous_result(tmp_path):
    m = _manifest(tmp_path, [_sec("s", PRINT_TABLE, stdout=True)])
    out = tmp_path / "benchmarks.md"
    record(m, out, notify=lambda _: None)
    before = (m.parent / "s" / "table.md").read_text()
    m2 = _manifest(tmp_path, [_sec("s", FAIL)])
    lines: list[str] = []
    res = record(m2, out, only=["s"], rerun=True, notify=lines.append)
    assert res["failed"] == ["s"] and res["ran"] == []
    assert "exited with status 3" in " ".join(lines)
    assert (m.parent / "s" / "table.md").read_text() == before  # old result kept
    assert (m.parent / "s.partial").is_dir()  # kept for a resumed run
    assert "| 2 |" in out.read_text()


def test_section_without_table_fails(tmp_path):
    m = _manifest(tmp_path, [_sec("s", "python -c \"pass\"")])
    res = record(m, tmp_path / "b.md", notify=lambda _: None)
    assert res["failed"] == ["s"]
    assert "Not recorded yet: run `attnlab bench record --only s`" in (tmp_path / "b.md"
                                                                      ).read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_cuda_section_is_kept_without_gpu(tmp_path):
    m = _manifest(tmp_path, [_sec("g", FAIL, device="cuda")])
    res = record(m, tmp_path / "b.md", notify=lambda _: None)
    assert res["kept"] == ["g"] and res["failed"] == []
    assert "on a machine with a CUDA GPU" in (tmp_path / "b.md").read_text()


@pytest.mark.parametrize("sections, message", [
    ([_sec("a", "x"), _sec("a", "y")], "must be unique"),
    ([{**_sec("a", "x"), "colour": 1}], "unknown key(s) ['colour']"),
    ([{"id": "a", "command": "x"}], "missing ['text', 'title']"),
    ([_sec("a", "x", device="tpu")], "device must be"),
    ([], "no sections"),
])
def test_manifest_errors(tmp_path, sections, message):
    with pytest.raises(RecordError) as e:
        load_manifest(_manifest(tmp_path, sections))
    assert message in str(e.value)


def test_manifest_yaml_error_names_line(tmp_path):
    p = tmp_path / "record.yaml"
    p.write_text("preamble: ok\nsections:\n  - id: [unclosed\n")
    with pytest.raises(RecordError, match=r"record\.yaml:\d+: not valid YAML"):
        load_manifest(p)
    with pytest.raises(RecordError, match="no benchmark manifest"):
        load_manifest(tmp_path / "missing.yaml")


def test_unknown_section_is_named(tmp_path):
    _, secs = load_manifest(_manifest(tmp_path, [_sec("a", "x")]))
    with pytest.raises(RecordError, match=r"unknown section\(s\) \['b'\]; known: a"):
        select(secs, ["b"])


# ---------------------------------------------------------------- the repository's record

def test_repository_manifest_commands_name_real_mechanisms():
    """Every mechanism a section benchmarks resolves (a stale spec would fail mid-record)."""
    from attnlab.bench.peers import is_peer

    _, sections = load_manifest(REPO / "docs" / "bench" / "record.yaml")
    assert len({s.id for s in sections}) == len(sections) >= 10
    checked = 0
    for s in sections:
        argv = shlex.split(s.command)
        assert argv[0] in ("attnlab", "python"), s.id
        if "--mechanisms" in argv:
            for spec in split_top(argv[argv.index("--mechanisms") + 1], ","):
                spec = spec.strip()
                if not is_peer(spec):
                    resolve_config(spec if "(" in spec else bench_spec(spec))
                checked += 1
    assert checked >= 30


def test_repository_markdown_is_what_the_record_renders():
    """docs/benchmarks.md is the rendering of the manifest and the recorded folders:
    edited by hand it would drift from `attnlab bench record --render-only`."""
    bench = REPO / "docs" / "bench"
    preamble, sections = load_manifest(bench / "record.yaml")
    expected = render(preamble, sections, bench, REPO / "docs", root=REPO)
    assert (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8") == expected


def test_attnlab_runs_as_a_module_without_its_console_script(tmp_path, monkeypatch):
    from attnlab.bench import record as rec

    monkeypatch.setattr(rec.sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setattr(rec.shutil, "which", lambda name: None)
    s = rec.Section(id="x", title="x", text="", command="attnlab bench speed --out {out}")
    assert rec._argv(s, tmp_path) == [str(tmp_path / "python3"), "-m", "attnlab", "bench",
                                      "speed", "--out", str(tmp_path)]


def test_a_copied_tree_takes_its_commit_from_the_environment(monkeypatch):
    from attnlab.recipes import rundir

    monkeypatch.setenv("ATTNLAB_GIT_COMMIT", "abc1234")
    assert rundir.git_commit() == "abc1234"  # over whatever .git the copy sits in
    monkeypatch.setattr(rundir.Path, "exists", lambda self: False)
    assert rundir.git_commit() == "abc1234"
    monkeypatch.delenv("ATTNLAB_GIT_COMMIT")
    assert rundir.git_commit() is None
