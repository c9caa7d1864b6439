"""What ``bench speed``'s and ``bench lra``'s tables say about their own cells: the range
the exponents are fitted over, and the commits a resumed run's cells were measured on."""

from __future__ import annotations

import json

import pytest

from attnlab.bench import lra, suite
from attnlab.bench.speed import commits_note, short_commit


def t_is_n(method, n, **kw):
    """time = n / 1000 ms (exponent 1); SDPA twice as slow and heavy."""
    k = 2.0 if method == "sdpa" else 1.0
    return {"fwd_ms": k * n / 1e3, "fwdbwd_ms": k * n / 1e3, "peak_fwd_mb": k,
            "peak_mem_mb": k}


def test_the_table_states_the_range_of_the_fit(tmp_path):
    res = suite.run_suite(tmp_path, ["band"], (512, 1024, 2048, 4096), fit_from=1024,
                          progress=False, measure=t_is_n, paired_rounds=0)
    assert res["exponents"]["band(window=128)"] == pytest.approx(1.0)
    assert "slope of log time on log n over the lengths n >= 1024" in (
        tmp_path / "table.md").read_text()


def test_no_length_reaches_fit_from_no_exponent_and_the_table_says_why(tmp_path):
    res = suite.run_suite(tmp_path, ["band"], (512, 1024), fit_from=2048, progress=False,
                          measure=t_is_n, paired_rounds=0)
    assert res["exponents"] == {"sdpa": None, "band(window=128)": None}
    table = (tmp_path / "table.md").read_text()
    assert "| `band(window=128)` | 0.512 (2.00x) | 1.02 (2.00x) | - |" in table
    assert "n >= 2048 ('-' with fewer than two of them)" in table


def test_a_run_resumed_on_another_commit_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "code_commit", lambda: "a" * 40)
    suite.run_suite(tmp_path, ["band"], (1024,), progress=False, measure=t_is_n,
                    paired_rounds=0)
    assert "more than one commit" not in (tmp_path / "table.md").read_text()
    monkeypatch.setattr(suite, "code_commit", lambda: "b" * 40 + "-dirty")
    res = suite.run_suite(tmp_path, ["band"], (1024, 2048), progress=False, measure=t_is_n,
                          paired_rounds=0)
    assert [r["commit"][0] for r in res["rows"]] == ["a", "a", "b", "b"]
    assert ("measured on more than one commit (a resumed run): aaaaaaa (2 cells), bbbbbbb "
            "with uncommitted changes (2 cells)") in (tmp_path / "table.md").read_text()
    logged = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(logged) == 4  # the first run's cells were reused, not measured again


def test_lra_cells_of_two_commits_are_named(tmp_path, monkeypatch):
    def measure(spec, length, batch_size, **kw):
        return {"step_ms": 10.0, "steps_per_s": 100.0, "peak_mem_mb": 5.0, "kernels": []}

    settings = lra.LraSettings(length=32, batch_size=2)
    monkeypatch.setattr(lra, "code_commit", lambda: "c" * 40)
    lra.run_lra(tmp_path, ["softmax"], settings=settings, progress=False, measure=measure,
                speed_only=True)
    assert "more than one commit" not in (tmp_path / "lra.md").read_text()
    monkeypatch.setattr(lra, "code_commit", lambda: "d" * 40)
    lra.run_lra(tmp_path, ["band(window=4)"], settings=settings, progress=False,
                measure=measure, speed_only=True)
    assert "ccccccc (1 cell), ddddddd (1 cell)" in (tmp_path / "lra.md").read_text()


def test_commit_helpers():
    assert short_commit(None) == "unknown" and short_commit("0123456789") == "0123456"
    assert short_commit("0123456789-dirty") == "0123456 with uncommitted changes"
    assert commits_note([{"commit": "x" * 40}, {"commit": "x" * 40}]) == ""
    assert commits_note([{}, {}]) == ""  # rows from before commits were recorded
    assert "xxxxxxx (1 cell), unknown (1 cell)" in commits_note([{"commit": "x" * 40}, {}])
