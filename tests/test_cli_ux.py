"""What a user reads: help texts as written, tables that stay Markdown, the banner and
warnings naming the settings in force, and what Ctrl-C leaves and says."""

from __future__ import annotations

import json
import re

import pytest
import typer.main
from rich.text import Text
from typer.testing import CliRunner

from attnlab.cli import app

runner = CliRunner()
TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "task.train_limit=16", "task.eval_limit=8", "train.batch_size=8", "train.max_steps=2"]


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_help_texts_reach_the_user_whole():
    """typer's rich mode reads help as Rich markup and keeps a docstring's line breaks:
    ``C[i, j]`` vanished and paragraphs broke mid-sentence. Every help shows as written."""
    for path, command in _commands(typer.main.get_command(app)):
        texts = [("help", command.help or "")]
        texts += [(p.name, getattr(p, "help", None) or "") for p in command.params]
        for name, text in texts:
            shown = Text.from_markup(text).plain
            assert shown == text.replace("\\[", "["), (path, name, text)
        for paragraph in (command.help or "").split("\n\n")[1:]:
            assert "\n" not in paragraph, (path, paragraph)


def test_help_shows_formulas_and_unbroken_paragraphs():
    wide = {"COLUMNS": "250"}
    res = runner.invoke(app, ["analyze", "links", "--help"], env=wide)
    assert "Counts C[i, j] = sum_k 1[S[i,k] S[j,k] / (d max(|K_k|, 1)) >= rho]" in res.output
    assert "S[i,k] S[j,k] / (d max(|K_k|, 1)) >= rho)" in res.output  # --rho
    res = runner.invoke(app, ["validate", "--help"], env=wide)
    assert "that the model takes the plan from its config alone" in res.output


def test_quickstart_banner_names_max_steps_when_set(monkeypatch):
    import attnlab.cli as cli

    monkeypatch.setattr(cli, "_run_and_report", lambda *a, **k: None)
    res = runner.invoke(app, ["quickstart", "--data-dir", "builtin", "train.max_steps=4"])
    assert res.exit_code == 0, res.output
    assert "4 step(s)" in res.output and "epoch" not in res.output
    res = runner.invoke(app, ["quickstart", "--data-dir", "builtin"])
    assert "4 epoch(s)" in res.output


def test_compare_and_collect_print_whole_markdown_rows(tmp_path):
    """The printed table is Markdown to paste: the file's rows, unwrapped, at any width."""
    res = runner.invoke(app, ["compare", "name=cmp", f"output_dir={tmp_path}", *TINY,
                              "--vary", "plan=baseline,0-1:all:band(window=2)", "--seeds", "1"])
    assert res.exit_code == 0, res.output
    table = (tmp_path / "cmp" / "comparison.md").read_text().strip()
    assert len(table.splitlines()) == 4 and table in res.output, res.output
    assert f"saved {tmp_path / 'cmp'}/comparison.md, comparison.csv, comparison.json, " \
           "comparison.png" in res.output  # every file it wrote
    out = tmp_path / "t"
    res = runner.invoke(app, ["collect", f"a={tmp_path / 'cmp' / 'baseline'}",
                              "--show", "optim.lr", "--out", str(out)])
    assert res.exit_code == 0, res.output
    table = (out / "comparison.md").read_text().strip()
    assert len(table.splitlines()) == 3 and table in res.output, res.output


def test_vary_plan_rules_with_commas_get_the_pipe_hint():
    from attnlab.config import ConfigError
    from attnlab.recipes.compare import parse_vary

    with pytest.raises(ConfigError, match=r"separate the values with '\|'"):
        parse_vary(["plan=baseline,0,2:all:band(window=8)"])
    # commas inside a plan's brackets, and ranges, are no problem
    assert parse_vary(["plan=baseline,0-2:all:band(window=8, causal=True)"]) == [
        ("plan", ["baseline", "0-2:all:band(window=8, causal=True)"])]


def test_ctrl_c_says_how_to_resume(tmp_path, monkeypatch):
    import attnlab.recipes.finetune as finetune

    def interrupted(cfg, resume=False, stop_after=None):  # as a run stopped mid-training
        cfg.run_dir.mkdir(parents=True)
        (cfg.run_dir / "config.yaml").write_text("name: r\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune, "run_experiment", interrupted)
    res = runner.invoke(app, ["run", *TINY, "name=r", f"output_dir={tmp_path}"])
    assert res.exit_code == 130, res.output
    assert f"attnlab run {tmp_path / 'r'}/config.yaml --resume" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(app, ["compare", *TINY, "name=c", f"output_dir={tmp_path}",
                              "--seeds", "1"])
    assert res.exit_code == 130, res.output
    assert "--resume" in res.output and "Traceback" not in res.output
    monkeypatch.setattr(finetune, "run_experiment", lambda *a, **k: _raise(KeyboardInterrupt))
    res = runner.invoke(app, ["run", *TINY, "name=early", f"output_dir={tmp_path}"])
    assert res.exit_code == 130 and "nothing to resume" in res.output, res.output


def _raise(error):
    raise error


def test_sigterm_takes_the_interrupt_path(tmp_path, monkeypatch):
    """SIGTERM (``timeout``, a scheduler) reaches the run as a KeyboardInterrupt, so the run
    records it and the user is told how to resume; exit status 143; the handler is restored."""
    import os
    import signal

    import attnlab.recipes.finetune as finetune

    seen = []

    def killed(cfg, resume=False, stop_after=None):
        cfg.run_dir.mkdir(parents=True)
        (cfg.run_dir / "config.yaml").write_text("name: r\n")
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode
        except KeyboardInterrupt:
            seen.append("run saw it")
            raise

    def fallback(signum, frame):  # reached only when the command installed no handler
        raise RuntimeError("SIGTERM was not handled by the command")

    original = signal.signal(signal.SIGTERM, fallback)
    try:
        monkeypatch.setattr(finetune, "run_experiment", killed)
        res = runner.invoke(app, ["run", *TINY, "name=r", f"output_dir={tmp_path}"])
        assert res.exit_code == 143, res.output
        assert seen == ["run saw it"]
        assert "terminated:" in res.output and "--resume" in res.output, res.output
        assert signal.getsignal(signal.SIGTERM) is fallback
    finally:
        signal.signal(signal.SIGTERM, original)


def test_eval_of_a_compare_folder_or_an_unfinished_run_names_the_fix(tmp_path):
    (tmp_path / "cmp" / "baseline" / "seed-0").mkdir(parents=True)
    res = runner.invoke(app, ["eval", str(tmp_path / "cmp")])
    assert res.exit_code == 2
    assert f"{tmp_path / 'cmp' / 'baseline' / 'seed-0'}" in res.output, res.output
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    res = runner.invoke(app, ["eval", str(run)])
    assert res.exit_code == 2
    assert re.search(r"not finished.*interrupted.*--resume", res.output), res.output


def test_majority_class_warning_names_the_settings_in_force(tmp_path):
    from attnlab.recipes.evaluation import degenerate_warning

    evals = [{"step": 2}]
    assert "(raise train.epochs)" in degenerate_warning([True], evals, 2, 2, 1e-4)
    by_steps = degenerate_warning([True], evals, 2, 2, 1e-4, by_steps=True)
    assert "raise train.max_steps, which overrides train.epochs" in by_steps
    tlm = degenerate_warning([True], evals, 2, 2, 1e-3, section="stage2", lr_key="stage2.lr")
    assert "stage2.epochs" in tlm and "(stage2.lr)" in tlm and "optim.lr" not in tlm
    # a run with train.max_steps: the warning names it, and the run's folder (in a compare,
    # every run is seed-N: the name alone does not say which)
    res = runner.invoke(app, ["run", *TINY, "name=r", f"output_dir={tmp_path}", "optim.lr=0.0",
                              "model.dropout=0.0"])
    assert res.exit_code == 0, res.output
    assert "raise train.max_steps, which overrides train.epochs" in res.output
    assert f"WARNING ({tmp_path / 'r'})" in res.output


def test_demo_without_analysis_names_the_option():
    res = runner.invoke(app, ["demo", "-p", "all:class:vertical:band(window=8)"])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "--analysis" in line and "task / task:NAME" not in line and "\n" not in line


@pytest.mark.parametrize("command", ["run", "validate"])
def test_an_empty_split_is_one_line_and_writes_nothing(tmp_path, command):
    """A data file with a header and no rows (e.g. `attnlab data listops --num-train 0`)."""
    data = tmp_path / "data"
    res = runner.invoke(app, ["data", "listops", "--out", str(data), "--num-train", "0",
                              "--num-valid", "4", "--num-test", "4", "--min-length", "4",
                              "--max-length", "30"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [command, "task.name=listops", f"task.data_dir={data}",
                              "model.name=scratch:tiny", "model.max_length=32",
                              "train.max_steps=1", "name=r", f"output_dir={tmp_path}"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "has no examples" in lines[0] and "train" in lines[0], lines
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", ["run", "validate"])
def test_prefix_with_a_token_keyed_plan_is_one_line_and_writes_nothing(tmp_path, command):
    """Prefix tuning's extra keys would shift a mechanism that reads key j as token j: refused
    from the config, before any folder is written, as the tuner itself refuses it."""
    res = runner.invoke(app, [command, *TINY, "name=p", f"output_dir={tmp_path}",
                              "tuning.method=prefix", "plan=1:all:band(window=4)"])
    assert res.exit_code == 2, res.output
    assert "band in layer 1" in res.output and "Use another tuner" in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "p").exists()
    ok = runner.invoke(app, ["validate", *TINY, "name=p", f"output_dir={tmp_path}",
                             "tuning.method=prefix", "plan=1:all:softmax"])
    assert ok.exit_code == 0, ok.output


def test_prefix_beyond_the_models_positions_is_refused_by_validate(tmp_path):
    """Prefix tuning shifts the tokens' positions by its length: more positions than the
    model has is refused from the config (it had failed inside the embedding lookup)."""
    res = runner.invoke(app, ["validate", *TINY, "name=p", f"output_dir={tmp_path}",
                              "tuning.method=prefix(num_virtual_tokens=600)"])
    assert res.exit_code == 2, res.output
    assert "max_position_embeddings" in res.output and "shift_positions=False" in res.output
    ok = runner.invoke(app, ["validate", *TINY, "name=p", f"output_dir={tmp_path}",
                             "tuning.method=prefix(num_virtual_tokens=600, shift_positions=False)"])
    assert ok.exit_code == 0, ok.output
