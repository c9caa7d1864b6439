"""``attnlab bench record``'s provenance: a section shows the command its numbers came
from, and a resumed section states its first start and every commit its cells ran on."""

from __future__ import annotations

import json
from pathlib import Path

from attnlab.bench.record import Section, made_by, record

# fails on its first run after leaving a finished "cell"; the next run resumes and finishes
RESUMABLE = ("python -c \"import pathlib, sys; p = pathlib.Path(sys.argv[1]); c = p / 'cell'; "
             "(p / 'table.md').write_text('| a |\\n|---|\\n| 1 |\\n') if c.exists() else "
             "sys.exit(c.write_text('1') and 3)\" {out}")


def _manifest(tmp_path: Path, command: str) -> Path:
    import yaml

    path = tmp_path / "bench" / "record.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    section = {"id": "s", "title": "S", "text": "About.", "command": command}
    if "{out}" not in command:
        section["stdout"] = True  # the table is what it prints
    path.write_text(yaml.safe_dump({"preamble": "How.", "sections": [section]}))
    return path


def _printer(value: int) -> str:
    return f"python -c \"print('| v |'); print('|---|'); print('| {value} |')\""


def test_made_by_matches_the_command_from_any_working_folder():
    s = Section(id="s", title="", text="", command="x --out {out} --json {out}/r.json")
    assert made_by("x --out docs/bench/s --json docs/bench/s/r.json", s)
    assert made_by("x --out ../main/docs/bench/s --json ../main/docs/bench/s/r.json", s)
    assert not made_by("x --out a --json b/r.json", s)  # two folders: not this command
    assert not made_by("x --n 8 --out docs/bench/s --json docs/bench/s/r.json", s)
    assert not made_by(None, s)
    plain = Section(id="p", title="", text="", command="python -m x --n 4")
    assert made_by("python -m x --n 4", plain) and not made_by("python -m x --n 8", plain)


def test_a_changed_command_is_measured_again_and_flagged_until_then(tmp_path):
    out = tmp_path / "benchmarks.md"
    m = _manifest(tmp_path, _printer(1))
    record(m, out, notify=lambda _: None)
    m = _manifest(tmp_path, _printer(2) + " --flag")  # the manifest edited afterwards
    record(m, out, render_only=True, notify=lambda _: None)
    md = out.read_text()
    assert "These numbers come from another command" in md and "| 1 |" in md
    lines: list[str] = []
    res = record(m, out, notify=lines.append)  # no --rerun: its record is of another command
    assert res["ran"] == ["s"] and "recorded with another command" in " ".join(lines)
    md = out.read_text()
    assert "| 2 |" in md and "another command" not in md
    assert record(m, out, notify=lambda _: None)["kept"] == ["s"]


def test_a_resumed_section_states_its_first_start_and_every_commit(tmp_path, monkeypatch):
    m = _manifest(tmp_path, RESUMABLE)
    out = tmp_path / "benchmarks.md"
    monkeypatch.setenv("ATTNLAB_GIT_COMMIT", "a" * 40)
    assert record(m, out, notify=lambda _: None)["failed"] == ["s"]
    partial = m.parent / "s.partial"
    first = [json.loads(line) for line in (partial / "attempts.jsonl").read_text().splitlines()]
    assert [a["commit"] for a in first] == ["a" * 40]
    monkeypatch.setenv("ATTNLAB_GIT_COMMIT", "b" * 39 + "1-dirty")  # committed meanwhile
    assert record(m, out, notify=lambda _: None)["ran"] == ["s"]
    rec = json.loads((m.parent / "s" / "record.json").read_text())
    assert rec["started"] == first[0]["started"] and rec["runs"] == 2
    assert rec["commit"].startswith("aaaaaaa then bbbbbbb with uncommitted changes")
    assert not (m.parent / "s" / "attempts.jsonl").exists()
    assert "in the last of 2 runs" in out.read_text()


def test_a_section_run_once_on_one_commit_says_just_that(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_GIT_COMMIT", "c" * 40)
    m = _manifest(tmp_path, _printer(3))
    record(m, tmp_path / "b.md", notify=lambda _: None)
    rec = json.loads((m.parent / "s" / "record.json").read_text())
    assert rec["commit"] == "ccccccc" and "runs" not in rec and "resumed_unknown" not in rec
