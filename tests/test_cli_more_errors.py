"""Bad input to ``attnlab tlm ...``, ``attnlab bench lra|record``, ``attnlab eval`` and
``attnlab analyze heads``: one line naming the problem and the fix, exit status 2, and
nothing written or changed on disk by the refused command."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
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


def _tlm_config(tmp: Path, external: str = "bm25", **retrieval) -> Path:
    """A tiny TLM config in ``tmp`` (a 1-layer encoder, CoLA's shipped sample)."""
    cfg = {
        "output_dir": str(tmp / "runs"), "external": external,
        "model": {"size": "tiny", "max_length": 16,
                  "config": {"hidden_size": 32, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "intermediate_size": 64}},
        "task": {"name": "cola", "data_dir": "builtin", "train_limit": 8, "eval_limit": 8},
        "retrieval": retrieval,
        "stage1": {"steps": 3, "batch_size": 4, "rho1": 1, "lr": 1.0e-3, "save_every": 1},
        "stage2": {"batch_size": 8, "max_steps": 1, "eval_every": 1, "lr": 1.0e-3},
        "eval": {"batch_size": 8},
    }
    path = tmp / "tlm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- tlm


def test_finetune_of_an_unfinished_stage1_changes_nothing_and_resume_still_works(tmp_path):
    """A refused ``tlm finetune`` had rewritten config.yaml with its overrides and written
    a "failed" summary.json, so the ``--resume`` its own message suggests was then refused
    ("it was run under another config")."""
    from attnlab.recipes.tlm import run_tlm
    from attnlab.recipes.tlm_config import load_tlm_config

    config = _tlm_config(tmp_path, external="none")
    cfg = load_tlm_config(config)
    assert run_tlm(cfg, stop_after=1, progress=False)["status"] == "interrupted"
    before = _digests(cfg.run_dir)
    line = _error_line(runner.invoke(app, ["tlm", "finetune", str(cfg.run_dir),
                                           "stage2.lr=0.01"]))
    assert "has no finished stage 1" in line and "--resume" in line
    assert _digests(cfg.run_dir) == before  # no summary.json, config.yaml as it was
    res = runner.invoke(app, ["tlm", "train", str(config), "--resume"])
    assert res.exit_code == 0, res.output
    assert json.loads((cfg.run_dir / "summary.json").read_text())["status"] == "finished"


def test_finetune_of_a_file_names_the_folder_to_give(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    line = _error_line(runner.invoke(app, ["tlm", "finetune", str(tmp_path / "config.yaml")]))
    assert "config.yaml is a file; give the TLM run folder" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("setting,expect", [
    # each was a ValueError traceback from the BM25 index (after reading the task data)
    ("retrieval.k1=-1", "retrieval.k1 must be >= 0"),
    ("retrieval.b=2", "retrieval.b must be in [0, 1]"),
    ("retrieval.corpus={tmp}/corpus.csv", "corpus files must be .jsonl"),
    ("retrieval.corpus={tmp}/blank.jsonl", "blank.jsonl: the corpus holds no documents"),
    # a FileExistsError traceback after the index was built in memory
    ("retrieval.cache_dir={tmp}/afile/cache", "afile is a file, not a folder"),
    # the tiny corpus has 4 passages: a ValueError traceback after retrieval
    ("retrieval.random_count=9", "retrieval.random_count 9 is more than the corpus's 4"),
])
@pytest.mark.parametrize("command", ["retrieve", "train"])
def test_bad_retrieval_settings_are_one_line(tmp_path, command, setting, expect):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "corpus.csv").write_text(corpus.read_text())
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "afile").write_text("keep me")
    config = _tlm_config(tmp_path, external="random" if "random" in setting else "bm25",
                         corpus=str(corpus))
    line = _error_line(runner.invoke(app, ["tlm", command, str(config),
                                           setting.format(tmp=tmp_path)]))
    assert expect in line
    runs = tmp_path / "runs"
    # no run folder; at most the corpus's index cache, which the next run reuses
    assert not runs.exists() or sorted(p.name for p in runs.iterdir()) == ["tlm-cache"]
    assert (tmp_path / "afile").read_text() == "keep me"


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
