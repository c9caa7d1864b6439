"""The command line: ls, validate, compare (tiny), params, errors."""

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnlab.cli import app

runner = CliRunner()


def test_ls_json_lists_every_mechanism():
    import attnlab

    res = runner.invoke(app, ["ls", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [r["name"] for r in rows] == attnlab.list_mechanisms()
    assert all(r["paper"] and r["complexity"] for r in rows)


def test_ls_table_and_markdown():
    res = runner.invoke(app, ["ls"])
    assert res.exit_code == 0 and "softmax" in res.output
    md = runner.invoke(app, ["ls", "--markdown"])
    assert md.output.startswith("# Mechanism catalogue")


def test_ls_fits_80_columns_and_wraps_only_the_descriptions():
    import re

    from attnlab.catalogue import catalogue_rows

    res = runner.invoke(app, ["ls"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "\u2026" not in res.output  # nothing cut short with an ellipsis
    flat = " ".join(res.output.split())
    for r in catalogue_rows():
        # the short fields stay on the mechanism's own line, in full
        row = next(line for line in lines if re.match(rf"{re.escape(r['name'])}\s", line))
        assert row.split()[:3] == [r["name"], r["family"], r["scope"]], row
        for word in (*r["paper"].split(), *r["complexity"].split()):  # wrapped, not cut
            assert word in flat, (r["name"], word)


def test_demo_memory_measurement_prints_no_profiler_lines(capfd):
    """`attnlab demo` measures peak memory with the torch profiler, whose native Kineto code
    writes "USDT: ... profiler_start/stop" to fd 2; those lines are dropped, others kept."""
    import os
    import sys

    import torch

    from attnlab.bench.memory import peak_memory_mb

    def work():
        os.write(2, b"a native line that stays\n")
        print("a python line that stays", file=sys.stderr)
        return torch.ones(256, 256) @ torch.ones(256, 256)

    out, peak = peak_memory_mb(work)
    captured = capfd.readouterr()
    assert float(out[0, 0]) == 256.0 and peak > 0.2  # 2 x 256 KiB inputs + 256 KiB result
    assert "USDT" not in captured.err and "profiler_start" not in captured.err, captured.err
    assert "a native line that stays" in captured.err
    assert "a python line that stays" in captured.err


def test_docs_catalogue_is_up_to_date():
    from attnlab.catalogue import catalogue_markdown

    path = Path(__file__).resolve().parents[1] / "docs" / "mechanisms.md"
    assert path.read_text() == catalogue_markdown(), (
        "docs/mechanisms.md is stale: run `attnlab ls --markdown > docs/mechanisms.md`"
    )


def test_validate_reports_bad_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("task: {name: cola}\ntrain: {batch_sise: 3}\n")
    res = runner.invoke(app, ["validate", str(p)])
    assert res.exit_code == 2 and "batch_size" in res.output


def test_validate_reports_unknown_mechanism_in_plan(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("task: {name: cola}\nplan: ['all:all:bnad(window=3)']\n")
    res = runner.invoke(app, ["validate", str(p)])
    assert res.exit_code == 2 and "band" in res.output


def test_run_overrides_take_named_plans():
    """plan=NAME on run/validate means what it means in compare --vary plan=NAME."""
    from attnlab.cli import _load
    from attnlab.presets import plan_value

    root = Path(__file__).resolve().parents[1]
    cfg = str(root / "configs/jat/cola.yaml")
    assert _load(cfg, ["plan=jat_late"]).plan == plan_value("jat_late")
    rho = _load(cfg, ["plan=jat(rho=4.5)"]).plan
    assert rho == plan_value("jat(rho=4.5)") and "rho=4.5" in rho[0]
    assert _load(cfg, ["plan=baseline"]).plan == []
    assert _load(cfg, ["plan=[]"]).plan == []  # YAML lists are untouched
    res = runner.invoke(app, ["validate", cfg, "plan=jatt"])
    assert res.exit_code == 2 and "unknown plan 'jatt'" in res.output


# TLM configs (configs/tlm_*.yaml) are `attnlab tlm` configs: tests/tlm/test_tlm_recipe.py
CONFIGS = sorted(str(p.relative_to(Path(__file__).resolve().parents[1]))
                 for p in (Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml")
                 if not p.name.startswith("tlm_"))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_shipped_configs_validate(cfg):
    """Every shipped config validates: keys, plan, tuner, model and, where its data is staged
    here (../shared/data), the data too."""
    path = Path(__file__).resolve().parents[1] / cfg
    res = runner.invoke(app, ["validate", str(path)])
    if res.exit_code == 2 and ("no 'train.tsv' found" in res.output
                               or "is not a folder" in res.output
                               or "not found" in res.output):
        pytest.skip(f"its data is not staged here: {res.output.strip()}")
    assert res.exit_code == 0, res.output


def test_compare_tiny(tmp_path):
    res = runner.invoke(app, [
        "compare", "name=cmp", f"output_dir={tmp_path}", "task.data_dir=builtin",
        "model.name=scratch:tiny", "model.max_length=16", "train.max_steps=2",
        "train.batch_size=4", "task.train_limit=16", "task.eval_limit=8",
        "--vary", "plan=baseline,0-1:all:band(window=2)", "--seeds", "2",
    ])
    assert res.exit_code == 0, res.output
    out = tmp_path / "cmp"
    for name in ("comparison.md", "comparison.csv", "comparison.png", "comparison.json"):
        assert (out / name).is_file()
    rows = json.loads((out / "comparison.json").read_text())
    assert [r["variant"] for r in rows] == ["baseline", "0-1:all:band(window=2)"]
    assert all(r["seeds"] == 2 and len(r["values"]) == 2 for r in rows)
    assert (out / "baseline" / "seed-1" / "summary.json").is_file()


def test_vary_values_with_commas_use_pipes():
    from attnlab.recipes.compare import parse_vary

    vary = parse_vary(["plan=baseline|0,1:0,2:jat(rho=4.0, coef=0.5)", "optim.lr=1e-4,3e-4"])
    assert vary == [("plan", ["baseline", "0,1:0,2:jat(rho=4.0, coef=0.5)"]),
                    ("optim.lr", ["1e-4", "3e-4"])]


def test_named_plan_with_arguments_is_a_grid_point():
    from attnlab.core import RegistryError
    from attnlab.presets import plan_value
    from attnlab.recipes.compare import parse_vary

    (_, values), = parse_vary(["plan=jat(rho=4.5),jat_late(rho=10.0, order=2)"])
    assert plan_value(values[0]) == ["0,1,4,5:0,2,4,6,8,10:jat(rho=4.5, coef=0.5)"]
    assert plan_value(values[1]) == ["3,4,5:0,2,4,6,8,10:jat(rho=10.0, coef=0.5, order=2)"]
    assert plan_value("jat_early") == ["0,1,2:0,2,4,6,8,10:jat(rho=5.0, coef=0.5)"]
    with pytest.raises(RegistryError, match="unknown plan 'jatt"):
        plan_value("jatt(rho=4.5)")


def test_demo_on_the_embedded_model():
    res = runner.invoke(app, ["demo", "-p", "0-1:all:band(window=2)", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "with plan" in res.output and "A = band(window=2)" in res.output


def test_demo_bad_plan_is_a_clear_error():
    res = runner.invoke(app, ["demo", "-p", "0:12:band(window=2)"])
    assert res.exit_code == 2 and "12" in res.output


def test_compare_parallel_matches_sequential(tmp_path):
    """--parallel N runs each (variant, seed) as its own `attnlab run` process: same table."""
    args = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
            "train.max_steps=2", "train.batch_size=4", "task.train_limit=16",
            "task.eval_limit=8", "--vary", "plan=baseline,0-1:all:band(window=2)",
            "--seeds", "2"]
    for name, extra in (("seq", []), ("par", ["--parallel", "2"])):
        res = runner.invoke(app, ["compare", f"name={name}", f"output_dir={tmp_path}",
                                  *args, *extra])
        assert res.exit_code == 0, res.output
    seq = json.loads((tmp_path / "seq" / "comparison.json").read_text())
    par = json.loads((tmp_path / "par" / "comparison.json").read_text())
    assert [r["variant"] for r in par] == [r["variant"] for r in seq]
    for a, b in zip(par, seq, strict=True):
        assert a["values"] == pytest.approx(b["values"], abs=1e-6)
    assert (tmp_path / "par" / "baseline" / "seed-1.log").is_file()
    assert not list((tmp_path / "par").rglob(".seed-*.yaml"))  # temporary configs removed


def test_compare_parallel_names_the_failed_logs(tmp_path):
    res = runner.invoke(app, [
        # a data folder without CoLA: the variants pass the checks made before the grid
        # (``preflight``) and each run fails when it loads the data, in its own process
        "compare", "name=bad", f"output_dir={tmp_path}", f"task.data_dir={tmp_path}",
        "model.name=scratch:tiny", "train.max_steps=1", "--seeds", "2", "--parallel", "2"])
    assert res.exit_code != 0
    text = "".join(res.output.split())  # rich wraps long paths mid-word
    assert "2of2runsfailed" in text and "bad/base/seed-0.log" in text
    res = runner.invoke(app, ["compare", "--parallel", "0"])
    assert res.exit_code != 0 and "--parallel 0" in " ".join(res.output.split())


def test_compare_best_seeds_runs_more_seeds_of_the_best_variant(tmp_path):
    """--seeds 1 --best-seeds 2: a grid on seed 0, then seed 1 of the best variant only."""
    res = runner.invoke(app, [
        "compare", "name=grid", f"output_dir={tmp_path}", "task.data_dir=builtin",
        "model.name=scratch:tiny", "model.max_length=16", "train.max_steps=3",
        "train.batch_size=4", "task.train_limit=16", "task.eval_limit=16",
        "--vary", "optim.lr=1e-4,3e-2", "--seeds", "1", "--best-seeds", "2"])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "grid" / "comparison.json").read_text())
    seed0 = {r["variant"]: r["values"][0] for r in rows}
    best = max(seed0, key=seed0.get)  # MCC: greater is better
    for r in rows:
        assert r["selected"] == (r["variant"] == best)
        assert r["seeds"] == (2 if r["selected"] else 1)
    assert (tmp_path / "grid" / best / "seed-1" / "summary.json").is_file()
    table = (tmp_path / "grid" / "comparison.md").read_text()
    if len(set(seed0.values())) == 1:  # the tiny model's MCC ties at 0: the table says so
        assert f"{best} (selected; tied with" in table
    else:
        assert f"{best} (selected)" in table
    res = runner.invoke(app, ["compare", "--seeds", "3", "--best-seeds", "2"])
    assert res.exit_code != 0 and "--best-seeds 2 must be more" in " ".join(res.output.split())


def test_run_in_bf16_autocast_with_a_jat_plan(tmp_path):
    """train.mixed_precision=bf16 (Accelerate autocast; CPU here, GPU alike) trains a model
    whose plan has JAT heads; the logged losses stay finite."""
    res = runner.invoke(app, [
        "run", "name=bf16", f"output_dir={tmp_path}", "task.data_dir=builtin",
        "model.name=scratch:tiny", "model.max_length=16", "train.max_steps=4",
        "train.batch_size=4", "task.train_limit=16", "task.eval_limit=8", "train.log_every=1",
        "train.mixed_precision=bf16", 'plan=["0-1:all:jat(rho=0.5)"]'])
    assert res.exit_code == 0, res.output
    lines = (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(x)["loss"] for x in lines if '"loss"' in x]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


def test_ls_lists_the_named_plans():
    from attnlab.presets import NAMED_PLANS

    res = runner.invoke(app, ["ls", "--plans", "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == NAMED_PLANS
    table = runner.invoke(app, ["ls", "--plans"], env={"COLUMNS": "80"})
    assert all(name in table.output for name in NAMED_PLANS)


def test_readme_states_the_mechanism_count():
    import re

    import attnlab

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    counts = re.findall(r"(\d+) mechanisms today", readme)
    assert counts == [str(len(attnlab.list_mechanisms()))], counts
