"""``attnlab tlm retrieve|train|finetune``: the pipeline from the command line on a tiny
random encoder and CoLA's shipped sample, and bad input as one line with exit status 2 (an
empty retrieval result included: reported, never trained on)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from attnlab.cli import app

runner = CliRunner()
TEXTS = ["the cat sat on the mat while the dog slept", "she gave him a book about old ships",
         "they will arrive late because of the snow", "we know that the river floods often"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _config(tmp: Path, external: str = "bm25", **retrieval) -> Path:
    """A tiny TLM config file in ``tmp`` (paths in it relative to it, as in configs/)."""
    (tmp / "hits.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    cfg = {
        "output_dir": str(tmp / "runs"), "external": external,
        "model": {"size": "tiny", "max_length": 16,
                  "config": {"hidden_size": 32, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "intermediate_size": 64}},
        "task": {"name": "cola", "data_dir": "builtin", "train_limit": 16, "eval_limit": 8},
        "retrieval": retrieval or {"hits": "hits.jsonl"},
        "stage1": {"steps": 4, "batch_size": 4, "rho1": 1, "lr": 1.0e-3, "save_every": 4},
        "stage2": {"batch_size": 8, "max_steps": 2, "eval_every": 2, "lr": 1.0e-3},
        "eval": {"batch_size": 8},
    }
    path = tmp / "tlm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _error_line(res) -> str:
    """The one ``error:`` line (progress bars of retrieval may come before it, on stderr)."""
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    errors = [ln[ln.index("error:"):] for ln in res.output.splitlines() if "error:" in ln]
    assert len(errors) == 1 and res.output.rstrip().endswith(errors[0].rstrip()), res.output
    return errors[0]


def test_help_lists_the_three_commands():
    res = runner.invoke(app, ["tlm", "--help"])
    assert res.exit_code == 0
    for command in ("retrieve", "train", "finetune"):
        assert command in res.output


def test_train_stage1_only_then_finetune(tmp_path):
    config = _config(tmp_path)
    res = runner.invoke(app, ["tlm", "train", str(config), "seed=1", "--stage1-only"])
    assert res.exit_code == 0, res.output
    run = tmp_path / "runs" / "tlm-cola" / "bm25" / "seed-1"
    assert "stage 1 done: 4 steps (2 task, 2 external)" in res.output
    assert "attnlab tlm finetune" in res.output
    assert (run / "stage1" / "model.safetensors").is_file()
    assert not (run / "summary.json").exists()
    res = runner.invoke(app, ["tlm", "finetune", str(run)])
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 4 + 2
    assert "best (stage 2)" in res.output
    # a new stage 2 with other stage-2 settings on the same stage 1; stage 1 stays fixed
    line = _error_line(runner.invoke(app, ["tlm", "finetune", str(run), "stage1.steps=9"]))
    assert "only stage2.* and eval.*" in line
    res = runner.invoke(app, ["tlm", "finetune", str(run), "stage2.max_steps=1"])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["steps"] == 4 + 1
    info = json.loads((run / "tlm.json").read_text())
    assert info["external"]["passages"] == len(TEXTS) * 3  # stage 1's set, still recorded
    assert yaml.safe_load((run / "config.yaml").read_text())["stage2"]["max_steps"] == 1
    # the finished run's encoder goes through head analysis like any model
    text = tmp_path / "s.txt"
    text.write_text("the cat sat on the mat\ndogs bark at night\n")
    res = runner.invoke(app, ["analyze", "heads", str(run), "--text-file", str(text),
                              "--out", str(tmp_path / "heads")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "heads" / "head_scores.json").is_file()
    # head importance needs a Hugging Face task head: refused in one line, nothing written
    line = _error_line(runner.invoke(app, ["analyze", "importance", str(run), "--out",
                                           str(tmp_path / "imp")]))
    assert "is a TLM run" in line and "attnlab analyze heads" in line
    assert not (tmp_path / "imp").exists()


def test_finetune_needs_a_finished_stage1(tmp_path):
    line = _error_line(runner.invoke(app, ["tlm", "finetune", str(tmp_path)]))
    assert "config.yaml" in line and "not found" in line


@pytest.mark.parametrize("args,expect", [
    (["external=bogus"], "external must be one of"),
    (["stage1.rho1=-3"], "rho1 must be an integer >= 0"),
    (["stage1.batchsize=3"], "batch_size"),
    (["retrieval.hits=null"], "needs retrieval.corpus"),
    (["--resume", "--overwrite"], "give one"),
])
def test_bad_input_is_one_line(tmp_path, args, expect):
    res = runner.invoke(app, ["tlm", "train", str(_config(tmp_path)), *args])
    assert expect in _error_line(res)
    assert not (tmp_path / "runs" / "tlm-cola").exists()  # nothing written


def test_a_missing_config_file_is_one_line(tmp_path):
    for command in ("retrieve", "train"):
        line = _error_line(runner.invoke(app, ["tlm", command, str(tmp_path / "no.yaml")]))
        assert "not found" in line


def test_empty_retrieval_is_reported_not_trained_on(tmp_path):
    """A corpus sharing no word with the task: BM25 finds nothing. ``retrieve`` and ``train``
    stop with the one-line EmptyRetrievalError; no training starts."""
    pytest.importorskip("attnlab.tlm.retrieve")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in
                              enumerate(["zqxv wplk", "vvrrtt qqmmzz", "xxyyzz kkjjhh"])))
    config = _config(tmp_path, corpus="docs.jsonl", k=3)
    line = _error_line(runner.invoke(app, ["tlm", "retrieve", str(config)]))
    assert "matched a passage" in line
    line = _error_line(runner.invoke(app, ["tlm", "train", str(config)]))
    assert "matched a passage" in line
    assert not list((tmp_path / "runs").glob("tlm-cola/*/*/stage1"))  # nothing trained


@pytest.mark.filterwarnings("ignore:.*matched no passage")
def test_retrieve_then_train_with_random_passages(tmp_path):
    pytest.importorskip("attnlab.tlm.retrieve")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                              for i, t in enumerate(TEXTS * 2 + ["unrelated words here"])))
    config = _config(tmp_path, corpus="docs.jsonl", k=2)
    res = runner.invoke(app, ["tlm", "retrieve", str(config)])
    assert res.exit_code == 0, res.output
    assert "bm25:" in res.output and "K = 2" in res.output
    res = runner.invoke(app, ["tlm", "train", str(config), "external=random", "--stage1-only"])
    assert res.exit_code == 0, res.output
    source = json.loads((tmp_path / "runs" / "tlm-cola" / "random" / "seed-0" /
                         "external.json").read_text())
    assert source["condition"] == "random" and source["passages"] >= 1


def test_a_run_config_given_to_tlm_is_named_as_one(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: {name: cola}\ntuning: {method: bitfit}\ntrain: {max_steps: 1}\n")
    for args in (["tlm", "retrieve", str(cfg)], ["tlm", "train", str(cfg)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        text = " ".join(res.output.split())
        assert "is a config of `attnlab run` (train, tuning: ...), not of `attnlab tlm`" in text


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_finetune_of_an_unfinished_stage1_changes_nothing_and_resume_still_works(tmp_path):
    """A refused ``tlm finetune`` had rewritten config.yaml with its overrides and written
    a "failed" summary.json, so the ``--resume`` its own message suggests was then refused
    ("it was run under another config")."""
    from attnlab.recipes.tlm import run_tlm
    from attnlab.recipes.tlm_config import load_tlm_config

    config = _config(tmp_path, external="none")
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
    config = _config(tmp_path, external="random" if "random" in setting else "bm25",
                     corpus=str(corpus))
    line = _error_line(runner.invoke(app, ["tlm", command, str(config),
                                           setting.format(tmp=tmp_path)]))
    assert expect in line
    runs = tmp_path / "runs"
    # no run folder; at most the corpus's index cache, which the next run reuses
    assert not runs.exists() or sorted(p.name for p in runs.iterdir()) == ["tlm-cache"]
    assert (tmp_path / "afile").read_text() == "keep me"
