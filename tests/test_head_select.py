"""Plans that choose heads by class or score: parsing, resolution against a head analysis,
the errors, saving the resolved plan, and `attnlab run` / `demo` with an analysis.

The analyses are constructed (known classes and scores) for the tiny random BERT of
conftest (3 layers x 4 heads), so which heads a selector must match is known exactly.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnlab import load_pretrained, save_pretrained
from attnlab.analysis import to_json
from attnlab.config import ConfigError, load_config
from attnlab.core import resolve_config
from attnlab.hf import Plan, PlanError, Rule, applied_report, apply_plan
from attnlab.hf.plan import HeadSelector
from attnlab.recipes.head_select import (
    HeadTable,
    read_head_table,
    resolve_for_model,
    resolve_plan,
)

V, D, VD, B, X = "vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous"
CLASSES = [[V, D, V, X],
           [X, X, X, X],
           [B, V, V, VD]]
NAN = math.nan
ENTROPY = torch.tensor([[0.5, 1.0, 2.0, 3.0],
                        [1.2, 1.6, 0.1, 2.2],
                        [NAN, 1.4, 1.49, 1.51]], dtype=torch.float64)
BAND = "band(window=2)"


def _table(source: str = "constructed") -> HeadTable:
    return HeadTable({"entropy": ENTROPY, "vertical": torch.zeros(3, 4, dtype=torch.float64),
                      "diagonal": torch.zeros(3, 4, dtype=torch.float64)},
                     [list(r) for r in CLASSES], source)


# ----------------------------------------------------------------------------- parsing


def test_selectors_parse_in_every_form_and_round_trip():
    compact = Plan.parse(["all:class:vertical+diagonal:band(window=2)", "0-1:entropy<1.5:softmax"])
    mapping = Plan.parse([{"layers": "all", "heads": "class:vertical+diagonal", "mechanism": BAND},
                          {"layers": [0, 1], "heads": "entropy < 1.5", "mechanism": "softmax"}])
    assert compact == mapping
    assert compact.rules[0].heads == HeadSelector("class", "vertical+diagonal")
    assert compact.rules[1].heads == HeadSelector("score", "entropy", "<", 1.5)
    assert compact.selective and not Plan.parse("all:0-1:softmax").selective
    for text in (str(compact), compact.to_json()):
        assert Plan.parse(text) == compact
    assert compact.rules[0].describe() == "all:class:vertical+diagonal:band(window=2)"
    assert compact.to_list()[1]["heads"] == "entropy<1.5"
    # a bare spec and index rules keep their meaning
    assert Plan.parse("softmax").rules[0].heads == "all"
    assert Rule("all", "class:block", "softmax").heads == HeadSelector("class", "block")


@pytest.mark.parametrize("bad, match", [
    ("0:class:softmax", "name the class"),
    ("all:class::softmax", "name the class"),
    ("all:vertical=>0.8:softmax", "SCORE OP NUMBER"),
    ("all:x:y:softmax", "LAYERS:HEADS:SPEC"),
    ("all:vertical>=a:softmax", "SCORE OP NUMBER"),
])
def test_malformed_selectors_say_how_to_write_them(bad, match):
    with pytest.raises(PlanError, match=match):
        Plan.parse(bad)


# ----------------------------------------------------------------------------- resolution


def test_class_rules_replace_exactly_the_classes_heads(bert_factory, padded_batch):
    plan, selection = resolve_plan(
        [f"all:class:vertical:{BAND}", "1-2:entropy<1.5:linear_elu"], _table(), shape=(3, 4))
    # vertical heads: layer 0 heads 0, 2 and layer 2 heads 1, 2; entropy < 1.5 in layers 1-2:
    # layer 1 heads 0, 2 and layer 2 heads 1, 2 (NaN never matches, 1.51 does not)
    band, linear = resolve_config(BAND), resolve_config("linear_elu")
    assert plan == Plan((Rule((0,), (0, 2), band), Rule((2,), (1, 2), band),
                         Rule((1,), (0, 2), linear),
                         Rule((2,), (1, 2), linear)))
    assert not plan.selective
    assert [r.heads for r in selection.rules] == [{0: (0, 2), 2: (1, 2)},
                                                 {1: (0, 2), 2: (1, 2)}]
    text = str(selection)
    assert "plan rule 0 (all:class:vertical:band(window=2)): 4 of 12 heads" in text
    assert "layer 2: heads 1, 2" in text

    model = bert_factory()
    report = apply_plan(model, plan)
    want = [["band", "softmax", "band", "softmax"],
            ["linear_elu", "softmax", "linear_elu", "softmax"],
            ["softmax", "linear_elu", "linear_elu", "softmax"]]  # later rules win in layer 2
    assert [[s.split("(")[0] for s in row] for row in report.table] == want
    # the same model as the plan written out by hand
    explicit = bert_factory()
    apply_plan(explicit, [f"0:0,2:{BAND}", f"2:1,2:{BAND}", "1:0,2:linear_elu",
                          "2:1,2:linear_elu"])
    with torch.no_grad():
        torch.testing.assert_close(model(**padded_batch).last_hidden_state,
                                   explicit(**padded_batch).last_hidden_state, rtol=0, atol=0)


def test_layers_with_the_same_heads_share_one_rule():
    classes = [[V, X, X, X], [X, X, X, X], [V, X, X, X]]
    table = HeadTable({"entropy": ENTROPY}, classes, "constructed")
    plan, _ = resolve_plan(["all:class:vertical:softmax"], table)
    assert plan == Plan((Rule((0, 2), (0,), resolve_config("softmax")),))


def test_a_selector_reaching_apply_plan_says_to_pass_an_analysis(tiny_bert):
    with pytest.raises(PlanError, match=r"rule 0 .*class:vertical.*pass one: --analysis"):
        apply_plan(tiny_bert, f"all:class:vertical:{BAND}")
    assert applied_report(tiny_bert) is None  # nothing was changed
    with pytest.raises(PlanError, match="chooses heads by a head analysis"):
        resolve_for_model(f"all:class:vertical:{BAND}", tiny_bert, None, None)


def test_unknown_class_and_score_name_the_close_matches():
    with pytest.raises(PlanError, match=r"unknown head class 'verticl'; did you mean "
                                        r"'vertical'.*Known: block, diagonal"):
        resolve_plan(["all:class:verticl:softmax"], _table())
    with pytest.raises(PlanError, match=r"unknown head score 'entrpy'; did you mean 'entropy'"):
        resolve_plan(["all:entrpy<1:softmax"], _table())


def test_a_selector_matching_no_head_is_an_error_saying_what_there_is():
    with pytest.raises(PlanError, match=r"rule 1 .*no head in layers \[1\] is 'block'.*"
                                        r"heterogeneous 4"):
        resolve_plan(["all:class:vertical:softmax", "1:class:block:softmax"], _table())
    with pytest.raises(PlanError, match=r"entropy<0.0 .*runs from 0.100 to 3.000"):
        resolve_plan(["all:entropy<0:softmax"], _table())
    nan = HeadTable({"block": torch.full((3, 4), NAN)}, None, "pairs-free")
    with pytest.raises(PlanError, match="n/a for every head"):
        resolve_plan(["all:block>=0.5:softmax"], nan)


def test_shape_scope_and_range_errors():
    with pytest.raises(PlanError, match=r"3 layers x 4 heads but the model has 6 x 12"):
        resolve_plan(["all:class:vertical:softmax"], _table(), shape=(6, 12))
    with pytest.raises(PlanError, match=r"'mqa' has scope 'module'.*heads: all"):
        resolve_plan(["all:class:vertical:mqa"], _table())
    with pytest.raises(PlanError, match=r"layer index 5 is out of range"):
        resolve_plan(["5:class:vertical:softmax"], _table())


# ----------------------------------------------------------------------------- files


def _write_analysis(folder, classes=CLASSES, entropy=ENTROPY):
    scores = {"vertical": torch.zeros(3, 4), "diagonal": torch.zeros(3, 4),
              "entropy": entropy}
    return to_json(folder / "head_scores.json", scores, classes, {"model": "constructed"})


def test_read_head_table_takes_the_file_or_its_folder(tmp_path):
    path = _write_analysis(tmp_path / "analysis")
    for where in (path, tmp_path / "analysis", tmp_path):  # the file, its folder, a run
        table = read_head_table(where)
        assert table.classes == CLASSES and table.shape == (3, 4)
        torch.testing.assert_close(table.scores["entropy"], ENTROPY, equal_nan=True)
    with pytest.raises(FileNotFoundError, match="no head_scores.json"):
        read_head_table(tmp_path / "nowhere")


def test_saved_model_holds_explicit_indices_and_reloads_without_analysis(
        bert_factory, padded_batch, tmp_path):
    _write_analysis(tmp_path / "analysis")
    model = bert_factory()
    plan, _ = resolve_for_model([f"all:class:vertical:{BAND}"], model, None,
                                str(tmp_path / "analysis"))
    apply_plan(model, plan)
    ref = model(**padded_batch).last_hidden_state
    save_pretrained(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "plan.json").read_text())
    assert saved == {"plan": [
        {"layers": [0], "heads": [0, 2], "mechanism": {"name": "band", "window": 2}},
        {"layers": [2], "heads": [1, 2], "mechanism": {"name": "band", "window": 2}}]}
    (tmp_path / "analysis" / "head_scores.json").unlink()  # the analysis is gone
    loaded = load_pretrained(tmp_path / "saved")
    torch.testing.assert_close(loaded(**padded_batch).last_hidden_state, ref, rtol=0, atol=0)


# ----------------------------------------------------------------------------- runs


BASE = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "train.max_steps=1", "train.batch_size=4", "task.train_limit=8", "task.eval_limit=4"]


def test_run_without_an_analysis_is_refused_before_anything_runs(tmp_path):
    from attnlab.recipes.preflight import preflight

    cfg = load_config(None, [*BASE, "plan=all:class:vertical:band(window=2)",
                             f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rule 0 .*set analysis: to a head_scores.json"):
        preflight(cfg)
    cfg = load_config(None, [*BASE, "plan=all:class:verticl:band(window=2)", "analysis=task",
                             f"output_dir={tmp_path}"])
    with pytest.raises(PlanError, match="did you mean 'vertical'"):
        preflight(cfg)
    assert not any(tmp_path.iterdir())


def test_run_resolves_against_a_file_and_records_explicit_heads(tmp_path, capsys):
    from attnlab.recipes.finetune import run_experiment
    from attnlab.recipes.runmodel import load_run_model

    # scratch:tiny has 2 layers x 2 heads
    analysis = to_json(tmp_path / "a" / "head_scores.json",
                       {"vertical": torch.zeros(2, 2), "diagonal": torch.zeros(2, 2)},
                       [[V, X], [X, V]], {})
    cfg = load_config(None, [*BASE, "plan=all:class:vertical:band(window=2)",
                             f"analysis={analysis}", "name=sel", f"output_dir={tmp_path}"])
    run_experiment(cfg)
    assert "layer 1: heads 1" in capsys.readouterr().out  # the printed selection
    run = tmp_path / "sel"
    plan = json.loads((run / "plan.json").read_text())["plan"]
    assert [(r["layers"], r["heads"]) for r in plan] == [([0], [0]), ([1], [1])]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["plan"] == plan
    analysis.unlink()  # reloads from config.yaml's explicit plan, without the analysis
    model, _, cfg2 = load_run_model(run)
    assert applied_report(model).table[1] == ["softmax", "band(window=2)"]
    assert Plan.parse(cfg2.plan) == Plan.parse(plan)


def test_a_computed_analysis_runs_on_the_model_the_run_starts_from(tmp_path):
    from attnlab.recipes.head_select import resolve_run_plan

    # every head has an entropy >= 0, so the threshold picks all 2 x 2 heads of scratch:tiny
    cfg = load_config(None, [*BASE, "plan=all:entropy>=0:band(window=2)", "analysis=task",
                             "name=comp", f"output_dir={tmp_path}"])
    resolved, selection = resolve_run_plan(cfg)
    assert [(r["layers"], r["heads"]) for r in resolved.plan] == [([0, 1], [0, 1])]
    assert "cola dev from builtin" in selection.source and "computed now" in selection.source
    assert resolved.analysis == "task" and resolve_run_plan(resolved) == (resolved, None)


def test_demo_takes_an_analysis_and_prints_the_matched_heads(tmp_path):
    from typer.testing import CliRunner

    from attnlab.cli import app

    classes = [[X] * 12 for _ in range(6)]  # the embedded MiniLM: 6 layers x 12 heads
    classes[1][3] = classes[4][0] = V
    to_json(tmp_path / "head_scores.json", {"vertical": torch.zeros(6, 12)}, classes, {})
    runner = CliRunner()
    res = runner.invoke(app, ["demo", "-p", "all:class:vertical:band(window=2)", "--analysis",
                              str(tmp_path), "--repeats", "1"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "plan rule 0 (all:class:vertical:band(window=2)): 2 of 72 heads" in text
    assert "layer 1: heads 3" in text and "layer 4: heads 0" in text
    assert "B = band(window=2) (2 heads)" in text and "A = softmax (70 heads)" in text
    res = runner.invoke(app, ["demo", "-p", "all:class:vertical:band(window=2)"])
    assert res.exit_code == 2 and "chooses heads by a head analysis" in res.output
