"""``attnlab bench lra`` (bench/lra.py): real tiny training of two mechanisms on one task with
a stand-in speed measurement (no subprocess), every output written, resume without re-running
finished cells, softmax's ratios to itself, the measurement itself in-process, and one-line
CLI errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.bench import lra, lra_cell
from attnlab.bench.lra_cell import measure_step
from attnlab.bench.lra_data import bench_data, listops_bounds, recall_vocab
from attnlab.cli import app
from attnlab.train.memory import reset_peak_rss

TINY = lra.LraSettings(length=32, steps=2, batch_size=2, eval_size=4)


def fake_measure(calls):
    def measure(spec, length, batch_size, **kw):
        calls.append(spec)
        fast = spec.startswith("band")
        return {"step_ms": 50.0 if fast else 100.0, "steps_per_s": 20.0 if fast else 10.0,
                "peak_mem_mb": 30.0 if fast else 120.0, "kernels": ["aten::sdpa"]}
    return measure


@pytest.fixture
def trained(monkeypatch):
    """Counts the train cells that run (the real training runs underneath)."""
    calls = []
    real = lra.train_and_evaluate

    def counting(model, data, **kw):
        calls.append(data.task.name)
        return real(model, data, **kw)

    monkeypatch.setattr(lra, "train_and_evaluate", counting)
    return calls


def test_two_mechanisms_write_every_output_and_resume(tmp_path, trained):
    measured: list[str] = []
    res = lra.run_lra(tmp_path, ["band(window=4)"], ["recall"], [0], TINY, progress=False,
                      measure=fake_measure(measured))
    assert measured == ["softmax", "band(window=4)"] and trained == ["recall", "recall"]
    for name in ("rows.jsonl", "lra.json", "lra.md", "lra.png"):
        assert (tmp_path / name).stat().st_size > 0
    base, band = res["table"]
    assert base["label"] == "softmax" and base["speed_ratio"] == 1.0
    assert base["memory_ratio"] == 1.0
    assert band["speed_ratio"] == 2.0 and band["memory_ratio"] == 0.25
    acc = band["accuracy"]["recall"]
    assert acc["n"] == 1 and 0.0 <= acc["mean"] <= 1.0 and band["average"] == acc["mean"]
    table = (tmp_path / "lra.md").read_text()
    assert "| `softmax` |" in table and "| 1.00x |" in table and "| 0.25x |" in table
    assert json.loads((tmp_path / "lra.json").read_text())["table"][1]["label"] == (
        "band(window=4)")
    if reset_peak_rss():  # Linux: each train row gives its training's memory high-water mark
        rows = [r for r in lra.read_rows(tmp_path / "rows.jsonl") if r["kind"] == "train"]
        assert rows and all(r["train_peak_mb"] >= 0 for r in rows)

    # finished cells are never run again
    measured.clear()
    again = lra.run_lra(tmp_path, ["band(window=4)"], ["recall"], [0], TINY, progress=False,
                        measure=fake_measure(measured))
    assert measured == [] and trained == ["recall", "recall"]
    assert again["table"] == res["table"]

    # a cut last line (interrupted run) and a new seed: only those cells run
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    (tmp_path / "rows.jsonl").write_text("\n".join(lines[:-1]) + '\n{"kind": "tr')
    lra.run_lra(tmp_path, ["band(window=4)"], ["recall"], [0, 1], TINY, progress=False,
                measure=fake_measure(measured))
    assert measured == [] and trained == ["recall"] * 5  # band seed 0, then seed 1 of both
    assert len(lra.read_rows(tmp_path / "rows.jsonl")) == 6


def test_other_settings_do_not_reuse_cells(tmp_path, trained):
    measured: list[str] = []
    lra.run_lra(tmp_path, ["softmax"], ["recall"], [0], TINY, progress=False,
                measure=fake_measure(measured))
    other = lra.LraSettings(length=32, steps=3, batch_size=2, eval_size=4)
    lra.run_lra(tmp_path, ["softmax"], ["recall"], [0], other, progress=False,
                measure=fake_measure(measured))
    assert measured == ["softmax"] and trained == ["recall", "recall"]  # speed cell reused


def test_speed_only_measures_without_training_and_shares_cells(tmp_path, trained):
    measured: list[str] = []
    res = lra.run_lra(tmp_path, ["band(window=4)"], ["recall"], [0, 1], TINY, progress=False,
                      measure=fake_measure(measured), speed_only=True)
    assert measured == ["softmax", "band(window=4)"] and trained == []  # no train cell
    assert res["speed_only"] and res["tasks"] == [] and res["seeds"] == []
    band = res["table"][1]
    assert band["accuracy"] == {} and band["average"] is None
    assert band["speed_ratio"] == 2.0 and band["memory_ratio"] == 0.25
    table = (tmp_path / "lra.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| mechanism"))
    assert header == ("| mechanism | steps/s | speed vs softmax | peak MB | memory vs softmax |")
    assert "| `band(window=4)` | 20 | 2.00x | 30 | 0.25x |" in table
    assert "Accuracy" not in table and "speed and memory only" in table
    assert (tmp_path / "lra.png").stat().st_size > 0  # memory against speed
    # a training run into the same folder reuses the speed cells (same identity)
    measured.clear()
    lra.run_lra(tmp_path, ["band(window=4)"], ["recall"], [0], TINY, progress=False,
                measure=fake_measure(measured))
    assert measured == [] and trained == ["recall", "recall"]


def test_a_failing_speed_cell_is_reported_not_fatal(tmp_path, trained):
    def measure(spec, length, batch_size, **kw):
        if spec != "softmax":
            raise RuntimeError("benchmark subprocess failed:\nRuntimeError: out of memory")
        return fake_measure([])(spec, length, batch_size)

    res = lra.run_lra(tmp_path, ["band(window=4)"], ["recall"], [0], TINY, progress=False,
                      measure=measure)
    assert res["table"][1]["speed_error"] == "RuntimeError: out of memory"
    assert "out of memory" in (tmp_path / "lra.md").read_text()


def test_mechanism_names_take_the_long_input_setting():
    assert lra.requested("band") == "band(window=128)"  # bench speed's setting
    assert lra.requested("band(window=8)") == "band(window=8)"
    assert lra.canonical("band") == lra.canonical("band(window=128)")
    labels, skipped = lra.resolve_mechanisms(["linear_elu", "softmax", "band"], 256)
    assert list(labels.values()) == ["softmax", "linear_elu", "band(window=128)"]
    assert skipped == []
    with pytest.raises(ValueError, match="cannot run in the bench encoder"):
        lra.resolve_mechanisms(["pattern_loss"], 64)  # 4 patterns for the encoder's 2 heads


def test_the_data_fits_the_length():
    assert listops_bounds(2048) == (500, 2000) and listops_bounds(64) == (15, 63)
    assert recall_vocab(4096) == 8192 and recall_vocab(8192) == 16384
    d = bench_data("listops", 48, 6, 3, "unused")
    assert len(d.train) == 6 and len(d.eval) == 3
    assert max(len(f["input_ids"]) for f in d.train + d.eval) <= 48
    assert len(d.tokenizer) == 5 + 15


def test_measure_step_in_process():
    """What the subprocesses run: a full training step at the length, timed and measured."""
    t = measure_step("softmax", 32, 2, part="time", repeats=1)
    assert t["step_ms"] > 0 and t["steps_per_s"] == pytest.approx(1000 / t["step_ms"])
    assert any("scaled_dot_product" in k for k in t["kernels"])  # SDPA, as the table says
    m = measure_step("linear_elu", 32, 2, part="memory")
    assert set(m) == {"peak_mem_mb"} and m["peak_mem_mb"] >= 0
    # a task-conditioned mechanism gets a fixed task id from its bench setting (one task
    # per cell), so its bare name measures instead of failing for want of an id
    assert lra.requested("camtl_prior") == "camtl_prior(task=0)"
    assert measure_step(lra.requested("camtl_prior"), 32, 2, repeats=1)["step_ms"] > 0


@pytest.mark.parametrize("args, expect", [
    (["--mechanisms", "bandd", "--task", "listops"], "band"),
    (["--mechanisms", "softmax", "--task", "pathfinder"], "unknown bench task 'pathfinder'"),
    (["--mechanisms", "softmax", "--steps", "0"], "--steps 0: give 1 or more"),
])
def test_cli_bad_input_is_one_line(tmp_path, args, expect):
    res = CliRunner().invoke(app, ["bench", "lra", *args, "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], res.output
    assert not (tmp_path / "out").exists()


def test_labelled_positions_loss_and_gradients_equal_the_full_classifier():
    """The recall cells' wrapper (``lra_cell.LabelledPositions``) runs the classifier at the
    labelled positions only: without dropout its training loss and every gradient equal
    the wrapped model's (classifier at every position, -100 ignored) to 1e-6; in eval mode
    it returns the wrapped model's [b, n, C] logits."""
    import copy

    import torch

    from attnlab.bench.lra_cell import LabelledPositions, build_model

    wrapped = build_model("softmax", "token-classification", 50, 60, 16, seed=0)
    assert isinstance(wrapped, LabelledPositions)
    for mod in wrapped.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    full = copy.deepcopy(wrapped.model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 60, (3, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 11:] = 0  # padding
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[0, 9], labels[1, 15], labels[2, 4] = 7, 49, 0, 21
    wrapped.train(), full.train()
    ours = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    ref = full(input_ids=ids, attention_mask=mask, labels=labels)
    assert ours.logits.shape == (4, 50)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-6, rtol=0)
    ours.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(wrapped.model.named_parameters(), full.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
    wrapped.eval(), full.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(input_ids=ids, attention_mask=mask).logits,
                                   full(input_ids=ids, attention_mask=mask).logits)


def test_another_baseline_runs_first_and_sets_the_ratios(tmp_path, trained):
    measured: list[str] = []
    res = lra.run_lra(tmp_path, ["band(window=4)", "softmax"], ["recall"], [0], TINY,
                      progress=False, measure=fake_measure(measured), speed_only=True,
                      baseline="band(window=4)")
    assert measured == ["band(window=4)", "softmax"]
    assert res["baseline"] == "band(window=4)"
    soft = res["table"][1]
    assert soft["speed_ratio"] == 0.5 and soft["memory_ratio"] == 4.0
    table = (tmp_path / "lra.md").read_text()
    assert "| speed vs band(window=4) |" in table
    assert "| `softmax` | 10 | 0.50x | 120 | 4.00x |" in table
    with pytest.raises(ValueError, match="baseline 'pattern_loss' cannot run"):
        lra.run_lra(tmp_path, ["softmax"], ["recall"], [0], TINY, progress=False,
                    measure=fake_measure(measured), baseline="pattern_loss")


@pytest.mark.skipif(not reset_peak_rss(), reason="needs a resettable high-water mark (Linux)")
def test_memory_kept_across_steps_shows_in_the_train_row(monkeypatch):
    """A step that keeps 48 MB alive (a leak) raises ``train_peak_mb`` by that much a step.
    48 MB is above glibc's largest mmap threshold (32 MB), so the leak takes fresh pages even
    where the process has freed memory to reuse."""
    kept: list = []
    real = lra_cell._step

    def leaky(*args):
        kept.append(torch.ones(12 << 20))  # 48 MB, touched
        return real(*args)

    monkeypatch.setattr(lra_cell, "_step", leaky)
    data = bench_data("listops", 48, 6, 3, "unused")
    model = lra_cell.build_model("softmax", data.task.head, data.task.num_labels,
                                 len(data.tokenizer), 48, seed=0)
    res = lra_cell.train_and_evaluate(model, data, steps=3, batch_size=2, lr=1e-3, seed=0)
    assert res["train_peak_mb"] >= 3 * 48 * 0.9
