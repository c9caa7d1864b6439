"""`attnlab analyze heads` and `attnlab report` end to end, on tiny saved runs and models.

Two tiny runs (scratch:tiny, 2 layers x 2 heads, one training step; run A has a band plan
in layer 0) are made once per module; sentences come from a small text file or the built-in
CoLA sample. Every output goes under tmp_path.
"""

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.recipes.analyze import parse_heads

runner = CliRunner()

SENTENCES = [
    "The cat sat on the mat.",
    "Dogs bark.",
    "Birds sing at dawn.",
    "She read the book quickly.",
    "He left.",
]
SCORE_FILES = ["vertical", "vertical_tlm", "vertical_pasta", "diagonal", "block", "entropy",
               "special_mass", "prev_mass", "next_mass"]
BASE = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "train.max_steps=1", "train.batch_size=4", "task.train_limit=8", "task.eval_limit=4"]


def _text(res) -> str:
    """CLI output with rich's line wrapping undone."""
    return " ".join(res.output.split())


def _invoke(args):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from attnlab.config import load_config
    from attnlab.recipes.finetune import run_experiment

    root = tmp_path_factory.mktemp("runs")
    plans = {"ra": ["plan=['0:all:band(window=2)']"], "rb": []}
    for seed, (name, plan) in enumerate(plans.items()):
        cfg = load_config(None, [*BASE, *plan, f"name={name}", f"seed={seed}",
                                 f"output_dir={root}"])
        run_experiment(cfg)
    text = root / "sentences.txt"
    text.write_text("\n".join(SENTENCES) + "\n\n")  # a blank line is skipped
    return root / "ra", root / "rb", text


def test_parse_heads():
    assert parse_heads("0:3, 2:7,0:3") == [(0, 3), (2, 7)]
    assert parse_heads(None) == [] and parse_heads(" ") == []
    for bad in ("0-3", "a:b", "0:", "1:2:3"):
        with pytest.raises(ValueError, match="LAYER:HEAD"):
            parse_heads(bad)


def test_heads_on_a_run_writes_tables_and_figures(runs):
    ra, _, text = runs
    _invoke(["analyze", "heads", ra, "--text-file", text, "--heads", "0:1,1:0",
             "--batch-size", "2"])
    out = ra / "analysis"  # the default for a run directory
    for name in ("head_scores.csv", "head_scores.json", "layer_summary.csv",
                 "layer_summary.md", "head_maps.json", "examples.json"):
        assert (out / name).is_file(), name
    figures = ["classes", "class_counts", "head_L0_H1", "head_L1_H0",
               *(f"score_{s}" for s in SCORE_FILES)]
    for stem in figures:
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        assert "<svg" in (out / f"{stem}.svg").read_text()[:500], stem
    doc = json.loads((out / "head_scores.json").read_text())
    assert (doc["layers"], doc["heads"]) == (2, 2)
    assert doc["meta"]["examples"] == len(SENTENCES)
    assert doc["meta"]["mechanisms"]["0"] == ["band"]  # the run's plan was re-applied
    assert len(doc["classes"]) == 2 and all(len(r) == 2 for r in doc["classes"])
    assert len((out / "head_scores.csv").read_text().splitlines()) == 1 + 2 * 2
    md = (out / "layer_summary.md").read_text()
    assert "n_vertical" in md and "mean_vertical_pasta" in md and "| all |" in md

    maps = json.loads((out / "head_maps.json").read_text())
    lengths = [len(t) for t in _tokens(ra, SENTENCES)]
    mode = max(set(lengths), key=lambda n: (lengths.count(n), n))
    assert maps["length"] == mode and maps["examples"] == lengths.count(mode)
    assert maps["tokens"][0] == "[CLS]" and maps["tokens"][-1] == "[SEP]"
    for key in ("0:1", "1:0"):
        m = torch.tensor(maps["maps"][key])
        assert m.shape == (mode, mode)
        # every row is a softmax over the real tokens, so the mean rows sum to 1; 1e-5 covers
        # float32 sums and the 6-decimal rounding of the file (mode * 5e-7)
        torch.testing.assert_close(m.sum(-1), torch.ones(mode), atol=1e-5, rtol=0)
    # band(window=2) in layer 0: no query attends farther than 2 positions
    band = torch.tensor(maps["maps"]["0:1"])
    far = (torch.arange(mode)[:, None] - torch.arange(mode)[None, :]).abs() > 2
    assert float(band[far].abs().max()) == 0.0


def _tokens(run, sentences):
    from attnlab.recipes.analyze import load_model

    tok = load_model(str(run)).tokenizer
    return [tok.convert_ids_to_tokens(ids) for ids in tok(sentences)["input_ids"]]


def test_batched_scores_equal_one_sentence_at_a_time(runs):
    """Sorting, padding and cropping in the batched pipeline change nothing."""
    from attnlab.analysis import score_heads, token_infos
    from attnlab.hf.capture import capture_attention
    from attnlab.recipes.analyze import load_model

    _, rb, text = runs
    _invoke(["analyze", "heads", rb, "--text-file", text, "--batch-size", "3"])
    doc = json.loads((rb / "analysis" / "head_scores.json").read_text())
    loaded = load_model(str(rb))
    per_sentence = []
    for s in SENTENCES:
        batch = loaded.tokenizer([s], return_tensors="pt")
        cache = capture_attention(loaded.model, batch)
        infos = token_infos(batch["input_ids"], batch["attention_mask"],
                            batch["token_type_ids"], loaded.tokenizer)
        per_sentence.append(score_heads(cache, infos))
    for label in ("vertical", "vertical_tlm", "vertical_pasta", "diagonal", "entropy",
                  "special_mass", "prev_mass", "next_mass"):
        want = torch.stack([s[label] for s in per_sentence]).mean(0)
        got = torch.tensor(doc["scores"][label], dtype=torch.float64)
        # 1e-5: the file keeps 6 decimals, and padded vs unpadded float32 softmax differ ~1e-7
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=label)
    assert all(x is None for row in doc["scores"]["block"] for x in row)  # single sentences


def test_embedded_model_on_builtin_cola(tmp_path):
    out = tmp_path / "minilm"
    res = _invoke(["analyze", "heads", "--task", "cola", "--data-dir", "builtin", "--limit", "6",
                   "--batch-size", "4", "--max-length", "64", "--out", out])
    doc = json.loads((out / "head_scores.json").read_text())
    assert (doc["layers"], doc["heads"]) == (6, 12)
    assert doc["meta"]["examples"] == 6 and doc["meta"]["text"] == "cola dev from builtin"
    classes = [c for row in doc["classes"] for c in row]
    assert len(classes) == 72
    assert classes.count("vertical") > 0  # MiniLM has [CLS]/[SEP] heads (the PASTA premise)
    assert "6 examples of cola dev from builtin" in _text(res)


def test_compare_two_runs(runs, tmp_path):
    ra, rb, text = runs
    out = tmp_path / "cmp"
    _invoke(["analyze", "heads", "--compare", ra, rb, "--text-file", text, "--out", out])
    for stem in ("compare_classes", "compare_vertical"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.svg").is_file()
    a = json.loads((out / "a-ra" / "head_scores.json").read_text())
    b = json.loads((out / "b-rb" / "head_scores.json").read_text())
    doc = json.loads((out / "compare.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"{c} in compare.json"))
    assert doc["mean_scores"]["a"]["block"] is None  # NaN (single sentences) -> null
    want = [{"layer": layer, "head": head, "a": a["classes"][layer][head],
             "b": b["classes"][layer][head]}
            for layer in range(2) for head in range(2)
            if a["classes"][layer][head] != b["classes"][layer][head]]
    assert doc["changed"] == want
    assert doc["a"]["model_name"] == "ra" and doc["b"]["model_name"] == "rb"


def test_compare_models_of_different_shapes_by_class_share(runs, tmp_path):
    """A 2 x 2 run against the embedded 6 x 12 MiniLM (TLM's comparison of a small
    task-driven model with a pretrained one): class shares by relative depth."""
    ra, _, text = runs
    out = tmp_path / "cmp-shapes"
    res = _invoke(["analyze", "heads", "--compare", ra, "default", "--text-file", text,
                   "--out", out])
    assert (out / "compare_class_shares.png").is_file()
    doc = json.loads((out / "compare.json").read_text())
    assert doc["shapes"] == {"a": [2, 2], "b": [6, 12]}
    b = json.loads((out / "b-default" / "head_scores.json").read_text())
    flat = [c for row in b["classes"] for c in row]
    for c, share in doc["class_shares"]["b"].items():
        assert share == pytest.approx(flat.count(c) / 72, abs=1e-6)
    assert sum(doc["class_shares"]["a"].values()) == pytest.approx(1.0)
    assert "class shares" in _text(res)


def test_saved_model_folder_goes_to_runs_analysis(tmp_path, monkeypatch):
    import attnlab
    from attnlab.hf.saving import save_pretrained
    from attnlab.models import encoder_config, load_default_model

    torch.manual_seed(0)
    from transformers import BertModel

    model = BertModel(encoder_config("tiny"))
    attnlab.apply_plan(model, attnlab.Plan.parse(["1:0:band(window=1)"]))
    _, tok = load_default_model("base")
    save_pretrained(model, tmp_path / "tinybert", tokenizer=tok)
    (tmp_path / "s.txt").write_text("\n".join(SENTENCES[:3]))
    monkeypatch.chdir(tmp_path)
    _invoke(["analyze", "heads", "tinybert", "--text-file", "s.txt"])
    doc = json.loads((tmp_path / "runs" / "analysis-tinybert" / "head_scores.json").read_text())
    assert doc["meta"]["mechanisms"]["1"] == ["band", "softmax"]  # plan.json re-applied
    assert doc["meta"]["examples"] == 3


def _report_data(path):
    text = path.read_text(encoding="utf-8")
    assert "<link" not in text and "https://" not in text
    assert all(s.startswith("data:") for s in re.findall(r'\bsrc="([^"]*)"', text))
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', text,
                  re.S)
    return text, json.loads(m.group(1))


def test_report_from_a_sample_then_from_the_analysis(runs, tmp_path):
    import shutil

    run = tmp_path / "rb"
    shutil.copytree(runs[1], run, ignore=shutil.ignore_patterns("analysis", "checkpoints"))
    res = _invoke(["report", run, "--sample", "4"])
    text, data = _report_data(run / "report.html")
    assert "computed now on a sample: 4 examples of cola dev from builtin" in _text(res)
    assert (data["layers"], data["heads"]) == (2, 2) and len(data["examples"]) == 4
    assert "attnlab run rb: cola (full(freeze_embeddings=False))" in text
    assert "best dev mcc" in text
    assert not (run / "analysis").exists()  # the sample is not saved as an analysis

    _invoke(["analyze", "heads", run, "--text-file", runs[2], "--heads", "1:1"])
    res = _invoke(["report", run, "--out", tmp_path / "r2.html"])
    text, data = _report_data(tmp_path / "r2.html")
    assert f"{run / 'analysis'} (5 examples of text file" in _text(res)
    saved = json.loads((run / "analysis" / "head_scores.json").read_text())
    assert data["classes"] == saved["classes"]
    assert data["examples"][0]["tokens"][0] == "[CLS]" and len(data["examples"]) == 4
    assert "average map, head_L1_H1" in text


@pytest.mark.parametrize("old_plan_form", [False, True])
def test_report_of_a_run_draws_its_curves_and_marks_its_plan(runs, tmp_path, old_plan_form):
    import shutil

    run = tmp_path / "ra"
    shutil.copytree(runs[0], run, ignore=shutil.ignore_patterns("analysis", "checkpoints"))
    if old_plan_form:  # runs before provenance: the plan a JSON string inside the JSON
        summary = json.loads((run / "summary.json").read_text())
        text = json.dumps({"plan": [{"layers": [0], "heads": "all",
                                     "mechanism": {"name": "band", "window": 2}}]})
        summary["plan"] = text
        for key in ("status", "attnlab_version", "git_commit", "versions", "device",
                    "started", "finished", "wall_seconds", "surgery"):
            summary.pop(key, None)
        (run / "summary.json").write_text(json.dumps(summary))
        (run / "plan.json").write_text(json.dumps(text))
    _invoke(["report", run, "--sample", "2"])
    text, data = _report_data(run / "report.html")
    assert 'id="training-curves"' in text and data["history"]["loss"]  # metrics.jsonl
    assert "1 logged loss values, 1 evaluations (cola, scratch:tiny)" in text
    assert data["replaced"] == [["band(window=2)"] * 2, [None, None]]
    for group in ("metrics-task", "metrics-cost", "metrics-attention"):
        assert f'id="{group}"' in text
    assert "time per optimizer step (s)" in text and "2 of 4" in text


@pytest.mark.parametrize(("args", "message"), [
    (["analyze", "heads", "{tmp}/nope", "--text-file", "{text}"], "does not exist"),
    (["analyze", "heads", "{ra}", "--heads", "0-1"], "expected LAYER:HEAD"),
    (["analyze", "heads", "{ra}", "--text-file", "{text}", "--heads", "0:1,5:0"],
     "head 5:0 is out of range: the model has layers 0-1 and heads 0-1"),
    (["analyze", "heads", "{ra}", "--text-file", "{tmp}/none.txt"], "does not exist"),
    (["analyze", "heads", "{ra}", "--compare", "{ra}", "{rb}"], "either MODEL or --compare"),
    (["analyze", "heads", "{ra}", "--task", "cola", "--split", "tran"], "no split 'tran'"),
    (["report", "{tmp}/nope"], "run directory"),
    (["report", "{text}"], "is not an attnlab run directory"),
])
def test_bad_input_gives_a_clear_error(runs, tmp_path, args, message):
    ra, rb, text = runs
    filled = [a.format(tmp=tmp_path, ra=ra, rb=rb, text=text) for a in args]
    res = runner.invoke(app, filled)
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and message in _text(res)
