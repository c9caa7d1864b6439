"""Bad input to ``attnlab eval`` (a TLM run), ``attnlab bench lra|record``, ``attnlab data``,
``attnlab collect`` and ``attnlab analyze``: one line naming the problem and the fix, exit
status 2, and nothing written or changed on disk by the refused command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from attnlab.cli import app

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["the cat sat on the mat while the dog slept", "she gave him a book about old ships",
         "they will arrive late because of the snow", "we know that the river floods often"]


def _error_line(res) -> str:
    """The one ``error:`` line, last in the output (retrieval's progress bars may come first,
    on stderr); no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    errors = [ln[ln.index("error:"):] for ln in res.output.splitlines() if "error:" in ln]
    assert len(errors) == 1 and res.output.rstrip().endswith(errors[0].rstrip()), res.output
    return errors[0]


# ----------------------------------------------------------------------------- tlm


def test_eval_of_a_tlm_run_says_where_its_result_is(tmp_path):
    """It said "tuned.safetensors not found: is RUN a finished attnlab run?" of a finished
    TLM run (and "attnlab run ... --resume" of an interrupted one)."""
    run = tmp_path / "tlm-cola" / "bm25" / "seed-0"
    (run / "stage1").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    line = _error_line(runner.invoke(app, ["eval", str(run)]))
    assert "is a run of `attnlab tlm`" in line and "summary.json" in line
    assert "attnlab run" not in line


# ----------------------------------------------------------------------------- bench


def test_bench_lra_recall_too_short_names_the_option(tmp_path, monkeypatch):
    """It was the generator's "num_kv_pairs=8 needs 4 * num_kv_pairs <= input_seq_len=16"."""
    from attnlab.bench import lra

    def no_speed(*args, **kwargs):
        raise AssertionError("measured before the data was checked")

    monkeypatch.setattr(lra, "measure_isolated_step", no_speed)
    out = tmp_path / "lra"
    line = _error_line(runner.invoke(app, ["bench", "lra", "--mechanisms", "softmax", "--task",
                                           "recall", "--length", "31", "--out", str(out)]))
    assert "--length 31 is too short for the recall task" in line
    assert "give --length 32 or more" in line
    assert not out.exists()


@pytest.mark.parametrize("only", [",", " , "])
def test_bench_record_only_without_ids(tmp_path, only):
    """It was "unknown section(s) ['', '']"."""
    out = tmp_path / "benchmarks.md"
    line = _error_line(runner.invoke(app, ["bench", "record", "--render-only", "--only", only,
                                           "--output", str(out)]))
    assert f"--only {only!r} names no section" in line
    assert not out.exists()


# ----------------------------------------------------------------------------- analyze


@pytest.fixture
def no_model(monkeypatch):
    from attnlab.recipes import analyze

    def work_started(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(analyze, "load_model", work_started)


def test_analyze_heads_refuses_negative_examples(tmp_path, no_model):
    """``--examples -1`` was taken silently as 0."""
    out = tmp_path / "out"
    line = _error_line(runner.invoke(app, ["analyze", "heads", "--examples", "-1", "--out",
                                           str(out)]))
    assert line == "error: --examples -1: give 0 or more"
    assert not out.exists()


def test_analyze_heads_text_file_that_is_a_folder(tmp_path):
    """It said "text file DIR does not exist" of an existing folder."""
    out = tmp_path / "out"
    line = _error_line(runner.invoke(app, ["analyze", "heads", "--text-file", str(tmp_path),
                                           "--out", str(out)]))
    assert f"text file {tmp_path} is a folder; give a .txt file" in line
    assert not out.exists()


@pytest.mark.parametrize("args,expect", [
    (["--num-valid", "-1"], "--num-valid must be >= 0, got -1"),
    (["--max-depth", "0"], "--max-depth must be >= 1, got 0"),
    (["--max-args", "1"], "--max-args must be >= 2, got 1"),
])
def test_data_listops_names_the_option_at_fault(tmp_path, args, expect):
    line = _error_line(runner.invoke(app, ["data", "listops", "--out", str(tmp_path / "lo"),
                                           *args]))
    assert expect in line
    assert not (tmp_path / "lo").exists()


def test_a_file_where_a_folder_goes(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = _error_line(runner.invoke(app, ["collect", str(afile), "--out", str(tmp_path / "c")]))
    assert "afile: is a file, not a folder" in line
    line = _error_line(runner.invoke(app, ["data", "text", "--out", str(tmp_path / "tx"),
                                           "--data-dir", str(afile)]))
    assert "data_dir" in line and "afile is a file" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_analyze_links_names_batch_size(tmp_path):
    line = _error_line(runner.invoke(app, ["analyze", "links", "--batch-size", "0",
                                           "--out", str(tmp_path / "o")]))
    assert "--batch-size" in line
    assert not (tmp_path / "o").exists()
