"""Errors of use end in one line naming the fix and exit status 2 (``--debug``: the
traceback); ``validate`` refuses what ``run`` refuses, before anything is written."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from attnlab.cli import app

runner = CliRunner()
TINY = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "task.train_limit=16", "task.eval_limit=8", "train.batch_size=8", "train.max_steps=1"]


def _error_line(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert "Traceback" not in res.output
    return lines[0]


@pytest.mark.parametrize("case,override,expect", [
    ("missing data", "task.data_dir={tmp}/no-such-data", "is not a folder"),
    ("data without the task's files", "task.data_dir={tmp}", "no 'train.tsv' found"),
    ("unknown model", "model.name={tmp}/no-such-model", "no such local folder"),
    ("model folder without config", "model.name={tmp}", "has no config.json"),
    ("unknown scratch size", "model.name=scratch:huge", "unknown size 'huge'"),
    ("unwritable output folder", "output_dir={tmp}/a-file/runs", "cannot write the run folder"),
    ("unknown task", "task.name=colaa", "cola"),
    ("unknown eval split", "task.eval_split=foo",
     "task.eval_split: task 'cola' has no split 'foo'; available splits: train, dev"),
    ("unknown train split", "task.train_split=foo", "task.train_split: task 'cola' has no"),
    ("negative steps", "train.max_steps=-5", "train.max_steps must be >= 1, got -5"),
    ("negative learning rate", "optim.lr=-1", "optim.lr must be >= 0, got -1"),
    # an analysis no rule needs is still checked: a typo is caught before the run
    ("unknown analysis task", "analysis=task:colaa", "analysis 'task:colaa'"),
    ("missing analysis file", "analysis={tmp}/none.json", "no such file or folder"),
])
@pytest.mark.parametrize("command", ["validate", "run"])
def test_one_line_errors_and_validate_agrees_with_run(tmp_path, command, case, override, expect):
    (tmp_path / "a-file").write_text("not a folder")
    args = [*TINY, override.format(tmp=tmp_path), f"output_dir={tmp_path}/out", "name=x"]
    if "output_dir" in override:
        args = [*TINY, override.format(tmp=tmp_path), "name=x"]
    res = runner.invoke(app, [command, *args])
    assert expect in _error_line(res), (case, res.output)
    assert not (tmp_path / "out" / "x").exists()  # nothing half-written


def test_missing_optional_package_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "datasets" else real(name, *a))
    res = runner.invoke(app, ["run", *TINY, "task.data_dir=null", f"output_dir={tmp_path}"])
    line = _error_line(res)
    assert "datasets" in line and "pip install 'attnlab[hub]'" in line


def test_debug_shows_the_traceback(tmp_path):
    res = runner.invoke(app, ["--debug", "run", *TINY, "model.name=scratch:huge",
                              f"output_dir={tmp_path}"])
    assert res.exit_code != 0 and res.exception is not None
    assert "unknown size" in str(res.exception)


def test_a_config_file_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: {name: cola, data_dir: builtin}\ntrain: {epochz: 3}\n")
    for command in ("validate", "run"):
        line = _error_line(runner.invoke(app, [command, str(bad)]))
        assert "epochz" in line and "epochs" in line


@pytest.mark.parametrize("raw", ["abc", "0", "-3"])
def test_bad_chunk_size_env_is_one_line(raw):
    """ATTNLAB_CHUNK_ELEMS is read at import: ``import attnlab`` survives a bad value, the
    CLI stops with one line, and the engine refuses to run with it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATTNLAB_CHUNK_ELEMS": raw}
    cli = subprocess.run([sys.executable, "-c", "from attnlab.cli import app; app()",
                          "data", "listops", "--help"], env=env, capture_output=True, text=True)
    lines = [ln for ln in (cli.stdout + cli.stderr).splitlines() if ln.strip()]
    assert cli.returncode == 2 and len(lines) == 1, cli.stdout + cli.stderr
    assert f"ATTNLAB_CHUNK_ELEMS must be a positive whole number of scores, got '{raw}'" in lines[0]
    engine = subprocess.run(
        [sys.executable, "-c", "import torch; from attnlab.mechanisms import _blocksparse as bs;"
         " q = torch.zeros(1, 1, 512, 8); bs.blocked_attention(q, q, q, block=64, left=64,"
         " width=192, pattern=lambda i, j: (i - j).abs() <= 64, extra=None, key_mask=None,"
         " causal=False, scale=1.0, dropout=0.0)"], env=env, capture_output=True, text=True)
    assert engine.returncode != 0 and "ValueError: ATTNLAB_CHUNK_ELEMS" in engine.stderr


@pytest.mark.parametrize("command", [
    ["analyze", "heads", "{tmp}/runs[b, h]/x"],
    ["data", "text", "--out", "{tmp}/out", "--data-dir", "{tmp}/no[b]data"],
    ["tlm", "retrieve", "{tmp}/runs[b, h]/tlm.yaml"],
])
def test_every_command_group_prints_the_message_whole_and_obeys_debug(tmp_path, command):
    """One printer for every command group (``cli_errors``): the message is text, not rich
    markup (a path or a shape glossary's "[b, h]" stays whole), on one line however long,
    and ``--debug`` raises instead."""
    args = [a.format(tmp=tmp_path) for a in command]
    line = _error_line(runner.invoke(app, args, terminal_width=80))
    assert "[b, h]" in line or "no[b]data" in line, line
    res = runner.invoke(app, ["--debug", *args])
    assert res.exit_code != 0 and res.exception is not None
    assert not isinstance(res.exception, SystemExit), res.output


def test_no_command_module_reaches_back_into_the_root_cli():
    """The command groups share ``cli_errors``; none imports ``attnlab.cli`` (which imports
    them), not even inside a function."""
    import ast
    from pathlib import Path

    import attnlab

    root = Path(attnlab.__file__).parent
    for path in sorted(root.glob("cli_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                assert not (node.level == 1 and (node.module == "cli" or (
                    node.module is None and "cli" in names))), f"{path.name} imports attnlab.cli"


def test_a_folder_given_as_the_config_is_one_line(tmp_path):
    for command in ("validate", "run"):
        line = _error_line(runner.invoke(app, [command, str(tmp_path)]))
        assert f"config file {tmp_path} not found" in line
    line = _error_line(runner.invoke(app, ["tlm", "retrieve", str(tmp_path)]))
    assert f"config file {tmp_path} not found" in line


@pytest.mark.parametrize("argv", [
    ["bench", "speed", "--mechanisms", "band", "--n", "abc"],
    ["bench", "speed", "--mechanisms", "band", "--n", "4096,"],
    ["bench", "speed", "--mechanisms", "band", "--n", "0"],
    ["bench", "sparse", "--ns", "1024,4k"],
    ["bench", "jat", "--lengths", "128;256"],
])
def test_length_lists_are_checked_before_any_work(tmp_path, argv):
    """A comma-separated list of lengths that is not whole numbers >= 1 is one line naming
    the option and its form (it was a ValueError traceback from int())."""
    res = runner.invoke(app, [*argv, *(["--out", str(tmp_path / "o")] if "speed" in argv
                                       else [])])
    line = _error_line(res)
    assert argv[-2] in line and "separated by commas" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,option", [
    (["demo", "--repeats", "0"], "--repeats"),
    (["bench", "speed", "--mechanisms", "band", "--n", "512", "--repeats", "0"], "--repeats"),
    (["bench", "speed", "--mechanisms", "band", "--n", "512", "--threads", "0"], "--threads"),
    (["bench", "sparse", "--ns", "512", "--repeats", "0"], "--repeats"),
    (["bench", "jat", "--lengths", "128", "--batch", "0"], "--batch"),
])
def test_counts_below_one_are_refused_before_any_work(tmp_path, argv, option):
    """``--repeats 0`` was "no median for empty data" (demo) or an IndexError in every cell
    of the table (bench speed)."""
    res = runner.invoke(app, [*argv, *(["--out", str(tmp_path / "o")] if "speed" in argv
                                       else [])])
    assert _error_line(res) == f"error: {option} 0: give 1 or more"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["run", "compare", "validate"])
def test_a_command_without_a_config_says_to_give_one(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, [command])
    if command == "validate":  # its CONFIG is a required argument: typer's usage error
        assert res.exit_code == 2 and "Missing argument" in res.output
        return
    assert "give a config, e.g. configs/glue/cola.yaml" in _error_line(res)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("option,value", [("--seeds", "0"), ("--seeds", "-1"),
                                          ("--parallel", "0")])
def test_compare_refuses_counts_below_one_before_any_folder(option, value, tmp_path):
    res = runner.invoke(app, ["compare", *TINY, f"output_dir={tmp_path}/out", "name=c",
                              "--vary", "plan=baseline", option, value])
    assert f"{option} {value}: give 1 or more" in _error_line(res)
    assert not (tmp_path / "out").exists()


def test_plan_errors_name_the_rule_once_and_argument_free_plans_refuse_arguments(tmp_path):
    res = runner.invoke(app, ["validate", *TINY, f"output_dir={tmp_path}",
                              "plan=0:-1:band(window=2)"])
    line = _error_line(res)
    assert line.count("plan rule 0") == 1 and "heads: cannot read '-1'" in line
    res = runner.invoke(app, ["validate", *TINY, f"output_dir={tmp_path}",
                              "plan=baseline(window=3)"])
    assert "takes no arguments; write plan=baseline" in _error_line(res)


def test_eval_names_a_missing_folder_and_an_unreadable_weights_file(tmp_path):
    assert "is not a folder; give the folder of a finished attnlab run" in _error_line(
        runner.invoke(app, ["eval", str(tmp_path / "nowhere")]))
    res = runner.invoke(app, ["run", *TINY, f"output_dir={tmp_path}", "name=e"])
    assert res.exit_code == 0, res.output
    (tmp_path / "e" / "tuned.safetensors").write_text("garbage")
    line = _error_line(runner.invoke(app, ["eval", str(tmp_path / "e")]))
    assert "tuned.safetensors: not a readable safetensors file" in line


@pytest.mark.parametrize("flags,expect", [(["--json", "--markdown"], "give one output format"),
                                          (["--plans", "--markdown"], "no Markdown form")])
def test_ls_refuses_flags_that_contradict(flags, expect):
    assert expect in _error_line(runner.invoke(app, ["ls", *flags]))
