"""The TLM recipe (attnlab.recipes.tlm, tlm_train) on a tiny random encoder, CoLA's shipped
sample and a hand-written external set, CPU: which stage-1 steps are task batches in the real
loop, exact resume mid stage 1 (weights equal), stage 2 re-initialising only the task head,
the summary ``attnlab collect`` reads, the conditions, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.config import ConfigError
from attnlab.recipes.tlm import run_tlm
from attnlab.recipes.tlm_config import load_tlm_config

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
TINY_MODEL = ["model.size=tiny", "model.max_length=16",
              "model.config={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
              "intermediate_size: 64}"]
TEXTS = ["the cat sat on the mat while the dog slept", "she gave him a book about old ships",
         "they will arrive late because of the snow", "a student read the long letter twice",
         "we know that the river floods every spring", "he seems to like the new teacher"]


pytestmark = pytest.mark.usefixtures("one_thread")


def write_hits(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def tiny(tmp: Path, *extra: str):
    """A tiny TLM config: 32 CoLA sample examples, batch 4, stage 1 8 steps (rho1 3)."""
    hits = write_hits(tmp / "hits.jsonl", TEXTS * 3)
    return load_tlm_config(None, [
        *TINY_MODEL, "task.name=cola", "task.data_dir=builtin", "task.train_limit=32",
        "task.eval_limit=16", f"retrieval.hits={hits}", f"output_dir={tmp / 'runs'}",
        "stage1.steps=8", "stage1.batch_size=4", "stage1.rho1=3", "stage1.rho2=20",
        "stage1.lr=1e-3", "stage1.warmup_ratio=0.25", "stage1.save_every=4",
        "stage1.log_every=1", "stage2.batch_size=8", "stage2.max_steps=2",
        "stage2.eval_every=1", "stage2.lr=1e-3", "eval.batch_size=16", *extra])


def metrics(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tlm")
    full_cfg = tiny(tmp, "name=full")
    full = run_tlm(full_cfg, progress=False)
    cut_cfg = tiny(tmp, "name=cut")
    part = run_tlm(cut_cfg, stop_after=3, progress=False)
    resumed = run_tlm(cut_cfg, resume=True, progress=False)
    return tmp, full_cfg, full, part, resumed


def test_task_batches_are_the_last_of_each_group_in_the_real_loop(runs):
    tmp, cfg, *_ = runs
    lines = [r for r in metrics(cfg.run_dir / "stage1" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 9))  # log_every=1: one line per step
    task_steps = [r["step"] - 1 for r in lines if r["task_batches"] == 1]  # 0-based
    assert task_steps == [3, 7]  # rho1 = 3: steps 3, 7 of 0..7
    for r in lines:  # external steps: L_mlm; task steps: (20 L_mlm + L_task) / 21
        expect = r["mlm_loss"] if r["task_batches"] == 0 else \
            (20 * r["mlm_loss"] + r["task_loss"]) / 21
        assert r["loss"] == pytest.approx(expect, rel=1e-6)
    state = json.loads((cfg.run_dir / "stage1" / "state.json").read_text())
    assert (state["steps"], state["task_steps"], state["external_steps"]) == (8, 2, 6)


def test_resume_mid_stage1_reaches_the_same_weights(runs):
    tmp, cfg, full, part, resumed = runs
    assert part == {"status": "interrupted", "stage": 1}
    a = load_file(tmp / "runs" / "full" / "stage1" / "model.safetensors")
    b = load_file(tmp / "runs" / "cut" / "stage1" / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    start = load_file(tmp / "runs" / "full" / "model.safetensors")
    assert not all(torch.equal(a[k], start[k]) for k in a)  # stage 2 trained further
    c = load_file(tmp / "runs" / "cut" / "model.safetensors")
    assert all(torch.equal(start[k], c[k]) for k in start)  # and the same stage 2 follows
    steps = [r["step"] for r in metrics(tmp / "runs" / "cut" / "stage1" / "metrics.jsonl")
             if "loss" in r]
    assert steps == list(range(1, 9))  # the resumed log has no duplicate lines
    assert resumed["best_metric"] == full["best_metric"]


def test_stage2_reinitialises_only_the_task_head(runs):
    from attnlab.recipes.tlm_train import stage2_model
    from attnlab.tasks import get_task

    _, cfg, *_ = runs
    stage1 = load_file(cfg.run_dir / "stage1" / "model.safetensors")
    model = stage2_model(cfg, get_task("cola"), cfg.run_dir)
    now = model.state_dict()
    head = {k for k in stage1 if k.startswith("task_head.")}
    assert head == {"task_head.dense.weight", "task_head.dense.bias", "task_head.out.weight",
                    "task_head.out.bias"}
    for k in stage1:
        same = torch.equal(now[k], stage1[k])
        assert same != (k in head), k  # encoder and MLM head kept, every task-head tensor new
    assert any(k.startswith("mlm.bert.encoder.") for k in stage1)


def test_summary_is_what_collect_reads(runs):
    from attnlab.recipes.collect import collect
    from attnlab.recipes.summary import read_summary

    tmp, cfg, full, *_ = runs
    s = read_summary(cfg.run_dir)
    assert s.is_finished and s.task == "cola" and s.main_metric == "mcc"
    assert s.steps == 8 + 2 and s.tuning == "tlm(external=bm25, rho1=3, rho2=20, steps=8)"
    assert s.best_metric is not None and s.params["percent_of_backbone"] == 100.0
    info = json.loads((cfg.run_dir / "tlm.json").read_text())
    assert info["external"]["passages"] == len(TEXTS) * 3 and info["stage2"]["steps"] == 2
    assert not (cfg.run_dir / "stage1" / "checkpoints").exists()  # pruned when finished
    # collect's layout: <variant>/seed-*/summary.json
    variant = tmp / "table" / "bm25"
    (variant / "seed-0").mkdir(parents=True)
    (variant / "seed-0" / "summary.json").write_text((cfg.run_dir / "summary.json").read_text())
    rows = collect([f"tlm={variant}"])
    assert rows[0]["metric"] == "mcc" and rows[0]["seeds"] == 1


def test_task_data_only_makes_every_step_a_task_batch(tmp_path):
    cfg = tiny(tmp_path, "external=none", "stage1.steps=3", "retrieval.hits=null")
    assert cfg.name == "tlm-cola/none/seed-0"  # the default name: collect's layout
    out = run_tlm(cfg, stages=(1,), progress=False)
    assert out["stage1"]["task_steps"] == 3 and out["stage1"]["rho1"] == 0
    lines = [r for r in metrics(cfg.run_dir / "stage1" / "metrics.jsonl") if "loss" in r]
    assert [r["task_batches"] for r in lines] == [1, 1, 1]
    assert all(r["task_loss"] is not None and r["mlm_loss"] is not None for r in lines)
    assert not (cfg.run_dir / "summary.json").exists()  # no result before stage 2


def test_an_empty_external_set_is_refused_before_training(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = tiny(tmp_path, f"retrieval.hits={empty}")
    with pytest.raises(ConfigError, match="has no passages") as e:
        run_tlm(cfg, progress=False)
    assert "\n" not in str(e.value)
    assert not (cfg.run_dir / "stage1").exists()  # nothing trained


@pytest.mark.parametrize("override,expect", [
    ("external=bogus", "external must be one of"),
    ("stage1.rho1=-1", "rho1 must be an integer >= 0"),
    ("stage1.rhoo=3", "rho1"),
    ("model.size=huge", "unknown; use one of"),
    ("model.config={hidden_sise: 3}", "hidden_size"),
    ("task.name=squad", "sequence or token classification"),
    ("stage2.warmup_ratio=1.5", "stage2.warmup_ratio must be in [0, 1)"),
    ("retrieval.hits=null", "needs retrieval.corpus"),
    ("retrieval.corpus=/no/such/corpus.jsonl", "corpus.jsonl does not exist"),
])
def test_bad_config_is_one_line(tmp_path, override, expect):
    extra = [override] if "corpus" not in override else ["retrieval.hits=null", override]
    with pytest.raises(Exception, match=re.escape(expect)) as e:
        tiny(tmp_path, *extra)
    assert isinstance(e.value, (ConfigError, KeyError)) or "Registry" in type(e.value).__name__
    assert "\n" not in str(e.value)


def test_shipped_configs_load_with_paths_from_the_file():
    for name, task in (("tlm_cola", "cola"), ("tlm_sst2", "sst2"), ("tlm_conll", "conll2003")):
        path = ROOT / "configs" / f"{name}.yaml"
        if not (SHARED / "corpus_en" / "docs.jsonl").is_file():
            pytest.skip("../shared/data is not here")
        cfg = load_tlm_config(path, ["seed=2", "external=random"])
        assert cfg.task.name == task and cfg.name == f"tlm-{task}/random/seed-2"
        assert Path(cfg.retrieval.corpus) == (SHARED / "corpus_en" / "docs.jsonl").resolve()
        assert Path(cfg.task.data_dir) == SHARED.resolve()


@pytest.mark.filterwarnings("ignore:.*matched no passage")
def test_bm25_and_random_from_a_corpus(tmp_path):
    """With the retrieval module: BM25 over a tiny corpus, and the random control drawing as
    many passages from the same pool (skips until attnlab.tlm.retrieve exists)."""
    pytest.importorskip("attnlab.tlm.retrieve")
    from attnlab.recipes.tlm_config import external_file, read_external
    from attnlab.tasks import get_task

    corpus = tmp_path / "docs.jsonl"
    docs = [*TEXTS, "zebra quartz xylophone", "quantum flux capacitor glows",
            "violet nebula drift", "granite obelisk hums"] * 2
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                              for i, t in enumerate(docs)))
    cfg = tiny(tmp_path, "retrieval.hits=null", f"retrieval.corpus={corpus}", "retrieval.k=2")
    examples = get_task("cola").load("train", "builtin")[:8]
    bm25 = external_file(cfg, examples, progress=False)
    assert bm25["condition"] == "bm25" and bm25["k"] == 2 and 1 <= bm25["passages"] <= 16
    again = external_file(cfg, examples, progress=False)  # cached: the same file
    assert again == bm25
    rnd_cfg = tiny(tmp_path, "external=random", "seed=3", "retrieval.hits=null",
                   f"retrieval.corpus={corpus}", "retrieval.k=2")
    rnd = external_file(rnd_cfg, examples, progress=False)
    assert rnd["passages"] == bm25["passages"] and rnd["file"] != bm25["file"]
    assert read_external(rnd)
