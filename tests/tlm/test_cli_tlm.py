"""``attnlab tlm retrieve|train|finetune``: the pipeline from the command line on a tiny
random encoder and CoLA's shipped sample, and bad input as one line with exit status 2 (an
empty retrieval result included: reported, never trained on)."""

from __future__ import annotations

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


def _config(tmp: Path, **retrieval) -> Path:
    """A tiny TLM config file in ``tmp`` (paths in it relative to it, as in configs/)."""
    (tmp / "hits.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    cfg = {
        "output_dir": str(tmp / "runs"), "external": "bm25",
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
