"""Fuzzing ``attnlab validate``: malformed but plausible configs, overrides, specs and plans
end in one line ``error: ...`` and exit status 2 (or 0 when the input happens to be valid),
never a traceback, and nothing is written under the output folder.

Derandomized (the same examples every run) and small, so the suite stays fast; a larger
campaign is the same test with ``FUZZ_EXAMPLES=2000`` in the environment. The minimal
cases the fuzzing found are pinned below it, each with the one line it must print.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from attnlab.cli import app

runner = CliRunner()
BASE = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=16",
        "task.train_limit=16", "task.eval_limit=8", "train.batch_size=8", "train.max_steps=1",
        "name=fz"]
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "40")), derandomize=True,
                deadline=None, database=None, suppress_health_check=list(HealthCheck))


def check_cli(args: list[str], yaml_text: str | bytes | None = None, command: str = "validate"
              ) -> tuple[int, str]:
    """Run ``attnlab COMMAND [config] BASE args`` in a fresh folder; assert the contract;
    return (exit code, output)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        config = []
        if yaml_text is not None:
            path = Path(tmp) / "c.yaml"
            path.write_bytes(yaml_text.encode() if isinstance(yaml_text, str) else yaml_text)
            config = [str(path)]
        argv = [command, *config, *BASE, f"output_dir={out}", *args]
        res = runner.invoke(app, argv)
        lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
        assert res.exit_code in (0, 2), (argv, res.output, res.exception)
        assert res.exception is None or isinstance(res.exception, SystemExit), (
            argv, repr(res.exception))
        assert "Traceback" not in res.output, res.output
        if res.exit_code == 2:
            assert len(lines) == 1 and lines[0].startswith("error: "), (argv, res.output)
        if command == "validate" or res.exit_code == 2:
            assert not out.exists(), (argv, sorted(out.rglob("*")))
        return res.exit_code, res.output


# ------------------------------------------------------------------------- strategies

SECTIONS = {
    "": ["name", "seed", "output_dir", "plan", "analysis"],
    "model": ["name", "max_length", "attn_implementation", "dropout"],
    "task": ["name", "data_dir", "train_limit", "eval_limit", "train_fraction", "train_split",
             "eval_split", "task_id"],
    "tuning": ["method"],
    "optim": ["lr", "weight_decay", "warmup_ratio", "schedule", "max_grad_norm", "betas", "eps",
              "fused"],
    "train": ["batch_size", "grad_accum", "epochs", "max_steps", "eval_every", "save_every",
              "early_stopping_patience", "keep_best", "group_by_length", "mixed_precision",
              "log_every"],
    "eval": ["batch_size"],
}


def _misspell(word: str) -> st.SearchStrategy[str]:
    """``word`` with one letter dropped, doubled or changed, or in capitals."""
    if not word:
        return st.just("x")
    i = st.integers(0, len(word) - 1)
    return st.one_of(
        i.map(lambda k: word[:k] + word[k + 1:]), i.map(lambda k: word[:k] + word[k] + word[k:]),
        i.map(lambda k: word[:k] + "x" + word[k + 1:]), st.just(word.upper()))


@st.composite
def keys(draw) -> str:
    """A config key: real, misspelled at any level, one level too deep, or empty parts."""
    section = draw(st.sampled_from(sorted(SECTIONS)))
    field = draw(st.sampled_from(SECTIONS[section]))
    kind = draw(st.sampled_from(["real", "real", "bad field", "bad section", "deep", "odd"]))
    if kind == "bad field":
        field = draw(_misspell(field))
    elif kind == "bad section" and section:
        section = draw(_misspell(section))
    elif kind == "deep":
        field = f"{field}.{draw(st.sampled_from(['x', 'name', '0']))}"
    elif kind == "odd":
        return draw(st.sampled_from(["", ".", "..", "a..b", f"{section}.", f".{field}", " "]))
    return f"{section}.{field}" if section else field


NUMBERS = ["-1", "0", "1", "-0.5", "1.5", "1e400", "-1e400", "1e-5", "5e-5", ".nan", ".inf",
           "-.inf", "nan", "inf", "99999999999999999999", "4294967296", "9223372036854775808",
           "0x10", "1_000", "0o17", "1:20", "2001-12-14"]
WORDS = ["null", "~", "", "abc", "true", "yes", "no", "[]", "{}", "[1, 2]", "[a]", "{a: 1}",
         "'x'", '"x', "[1", "{", "}", "&a x", "*a", "!!python/object:os.system x", "@x", "`x",
         "%x", "- a", "? a", "a: b", "\t1", "é", "名前", "\u200b", "a\\0b", "'a\\0b'",
         "cola", "colaa", "builtin", "scratch:huge", "scratch:", "default", "linear", "cosine",
         "bf17", "task:", "task:colaa", "eager", "foo"]
values = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(WORDS),
                   st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=6))

MECHANISMS = ["band", "softmax", "jat", "longformer", "bigbird", "linear", "performer",
              "nystrom", "lsh", "routing", "camtl_prior"]
TUNERS = ["full", "bitfit", "pasta", "lora", "prefix", "adapter", "diff_prune", "mae"]
PARAMS = ["window", "rho", "coef", "r", "dropout", "num_virtual_tokens", "global_tokens",
          "seed", "chunk", "eps", "tasks", "task", "alpha"]
SPEC_VALUES = ["8", "0", "-1", "1.5", "'x'", "[1]", "[]", "None", "True", "1e400", "-1e400",
               "99999999999999999999999", "10**3", "x", "'x", "[1", "(1", "{1: 2}", "1j",
               "b'x'", "...", "0x10", "'8'"]


@st.composite
def specs(draw, names: list[str]) -> str:
    """A spec ``name(key=value, ...)`` with a real or misspelled name, known or unknown
    keys, values of any type, and now and then a bracket or quote left open or extra."""
    name = draw(st.one_of(st.sampled_from(names), st.sampled_from(names).flatmap(_misspell)))
    args = draw(st.lists(st.tuples(st.sampled_from(PARAMS), st.sampled_from(SPEC_VALUES)),
                         max_size=3))
    text = name if not args and draw(st.booleans()) else (
        f"{name}(" + ", ".join(f"{k}={v}" for k, v in args) + ")")
    damage = draw(st.sampled_from(["", "", "", "cut", "extra", "quote", "positional"]))
    if damage == "cut":
        text = text[:draw(st.integers(0, max(len(text) - 1, 0)))]
    elif damage == "extra":
        text += draw(st.sampled_from([")", "(", "]", ",", "'", ":", ";"]))
    elif damage == "quote":
        text = text.replace("(", "('", 1)
    elif damage == "positional":
        text = text.replace("(", "(8, ", 1)
    return text


INDEX_FIELDS = ["all", "0", "1", "0-1", "1-0", "3-1", "0--2", "-1", "a", "", " ", "0,", ",",
                "0-", "-", "1.5", "99999999999", "0-99999999999", "class", "class:", "ALL",
                "entropy<1.5", "entropy<", "vertical>=x", "٣"]


@st.composite
def plans(draw) -> str:
    """``plan=`` override text: LAYERS:HEADS:SPEC rules (bad ranges, empty fields, wrong
    field counts), named plans with arguments, or a YAML list of rule mappings."""
    kind = draw(st.sampled_from(["rules", "rules", "named", "yaml"]))
    if kind == "named":
        name = draw(st.sampled_from(["baseline", "band16", "jat", "jat_early", "bogus", "JAT"]))
        return name + draw(st.sampled_from(["", "(", "()", "(rho=4.5)", "(rho='x')",
                                            "(rho=[1])", "(rho=4.5", "(bogus=1)"]))
    if kind == "yaml":
        layers = draw(st.sampled_from(["all", "0", "-1", "1.5", "null", "[]", "'0-1'", "{a: 1}",
                                       "99999999999999999999", "'3-1'"]))
        mech = draw(st.sampled_from(["band", "'band(window=8)'", "{name: band, window: x}",
                                     "{window: 8}", "{name: 3}", "null", "[band]",
                                     "{name: band, window: 1e400}"]))
        extra = draw(st.sampled_from(["", ", extra: 1", ", 1: 2", ", layers: 0"]))
        return f"[{{layers: {layers}, mechanism: {mech}{extra}}}]"
    rules = []
    for _ in range(draw(st.integers(1, 2))):
        fields = [draw(st.sampled_from(INDEX_FIELDS)), draw(st.sampled_from(INDEX_FIELDS)),
                  draw(specs(MECHANISMS))]
        rules.append(":".join(fields[draw(st.sampled_from([0, 0, 0, 1, 2])):]))
    return ";".join(rules)


FRAGMENTS = [
    "task: {name: cola}\n", "task:\n  name: cola\n", "task:\n\tname: cola\n",
    "train:\n  epochs: 1\n  epochs: 2\n", "task: {name: cola, name: sst2}\n",
    "base: &b {max_length: 16}\nmodel: *b\n", "model: *nowhere\n", "model: &m\n",
    "- task\n", "just text\n", "42\n", "null\n", "[]\n", "---\na: 1\n---\nb: 2\n",
    "1: 2\n", "null: 1\n", "true: 1\n", "? [a, b]\n: 1\n", "<<: {task: {name: cola}}\n",
    "task: !!python/object:os.system {}\n", "task: !custom x\n", "task: {name: cola\n",
    'task: "open\n', "tâsk: {name: cola}\n", "optim: {betas: [0.9]}\n",
    "plan:\n  - {layers: 0, mechanism: jat(rho=5, coef=0.5)}\n", "plan: band16\n",
    "plan:\n  - 0:all:band(window=8)\n", "plan: [{layers: all, mechanism: {name: 3}}]\n",
    "analysis: \"a\\0b\"\n", "output_dir: \"a\\0b\"\n", "name: \"a\\0b\"\n", "name: ''\n",
    "name: 2001-12-14\n", "seed: 0x10\n", "seed: -3\n", "train: [1, 2]\n", "eval: 3\n",
    "model: {attn_implementation: foo}\n", "tuning: {method: 'lora(r=8'}\n", "\ufeff",
    "# comment only\n", "task: {name: \u0441ola}\n",
]


@st.composite
def yaml_files(draw) -> bytes:
    """A config file glued from fragments (tabs, anchors, duplicate keys, tags, non-mapping
    tops, unicode), now and then with bytes that are not UTF-8."""
    text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=3)))
    raw = text.encode()
    if draw(st.integers(0, 5)) == 0:
        raw = raw + draw(st.sampled_from([b"\xff\xfe", b"\x00", b"\xc3"]))
    return raw


# ------------------------------------------------------------------------------ fuzzing


@FUZZ
@given(st.lists(st.tuples(keys(), values), min_size=1, max_size=3))
def test_fuzzed_overrides(pairs):
    check_cli([f"{k}={v}" for k, v in pairs])


@FUZZ
@given(plans())
def test_fuzzed_plans(plan):
    check_cli([f"plan={plan}"])


@FUZZ
@given(specs(TUNERS))
def test_fuzzed_tuner_specs(spec):
    check_cli([f"tuning.method={spec}"])


@FUZZ
@given(yaml_files())
def test_fuzzed_config_files(raw):
    check_cli([], yaml_text=raw)


# ------------------------------------------------------------- the cases fuzzing found


@pytest.mark.parametrize("args,expect", [
    (["plan=0-99999999999:all:band(window=8)"],
     "index 99999999999 is larger than any model's layers or heads (at most 65535)"),
    (["plan=0:0-99999999999:band(window=8)"], "heads: index 99999999999 is larger"),
    (["plan=0--2:all:band(window=8)"], "layers: cannot read '0--2'"),
    (["plan=[{1: 2, a: 3, mechanism: band}]"], "unknown parameter 1 for a plan rule"),
    (["plan=[{null: 2, mechanism: band}]"], "unknown parameter None for a plan rule"),
    (["plan=[{mechanism: {name: band, 1: 2}}]"], "unknown parameter 1 for mechanism 'band'"),
    (["plan=[{mechanism: {name: [band]}}]"], "'name' must be a string naming one"),
    (["plan=0:all:band(window=8, window=9)"], "'window' is given twice; keep one"),
    (["tuning.method=lora(r=8, r=9)"], "'r' is given twice; keep one"),
    (["plan=[{layers: all, mechanism: band, layers: 0}]"], "key 'layers' is given twice"),
    (["plan=0:all:band(window=99999999999999999999999)"],
     "band.window must be an integer below 2**63"),
    (["model.max_length=99999999999999999999"], "model.max_length must be an integer below"),
    (["tuning.method=pasta(init_std=1e400)"], "pasta.init_std must be a finite number, got inf"),
    (["optim.lr=.inf"], "optim.lr must be a finite number, got inf"),
    (["optim.max_grad_norm=.inf"], "optim.max_grad_norm must be a finite number"),
    (["train.epochs=.nan"], "train.epochs must be a finite number, got nan"),
    (["seed=-1"], "seed must be in 0 .. 2**32 - 1, got -1"),
    (["seed=4294967296"], "seed must be in 0 .. 2**32 - 1"),
    (["model.attn_implementation=foo"],
     "model.attn_implementation 'foo' is not an attention of transformers; use one of eager"),
    (["name=@x"], "value is not valid YAML (found character '@' that cannot start any token); "
                  "quote a value"),
])
@pytest.mark.parametrize("command", ["validate", "run"])
def test_found_by_fuzzing(command, args, expect):
    """Each was a traceback (MemoryError, AttributeError, TypeError, OverflowError, numpy's
    ValueError), a setting silently dropped, or a value ``validate`` passed and ``run``
    then failed on or trained to NaN with."""
    code, output = check_cli(args, command=command)
    assert code == 2 and expect in output, output


@pytest.mark.parametrize("text,expect", [
    ("1: 2\n", "unknown parameter 1 for the config"),
    ("task: {name: cola}\nanalysis: \"a\\0b\"\n", "analysis 'a\\x00b' holds a NUL character"),
])
def test_config_files_found_by_fuzzing(text, expect):
    code, output = check_cli([], yaml_text=text)
    assert code == 2 and expect in output, output


def test_a_nul_in_a_path_override_is_one_line():
    """YAML's "\\0" is a NUL character, which ``Path`` refuses with a ValueError."""
    for key in ("task.data_dir", "model.name", "output_dir"):
        code, output = check_cli([f'{key}="a\\0b"'])
        assert code == 2 and f"{key} 'a\\x00b' holds a NUL character" in output, output


def test_compare_refuses_a_bad_variant_before_any_folder():
    code, output = check_cli(["--vary", "plan=baseline|0-99999999999:all:band(window=8)",
                              "--seeds", "1"], command="compare")
    assert code == 2 and "index 99999999999 is larger" in output, output


@pytest.mark.parametrize("argv,expect", [
    (["data", "recall", "--power-a", "inf", "--num-train", "2"],
     "--power-a inf: give a finite number other than 0"),
    (["data", "recall", "--power-a", "0", "--num-train", "2"], "--power-a 0.0: give a finite"),
    (["data", "recall", "--seed", "-1", "--num-train", "2"],
     "--seed -1: give a whole number in 0 .. 2**32 - 1"),
    (["bench", "speed", "--mechanisms", ",", "--n", "64"], "--mechanisms ',' names no mechanism"),
    (["bench", "lra", "--mechanisms", "band", "--task", ","], "--task ',' names no task"),
])
def test_command_options_found_by_fuzzing(tmp_path, argv, expect):
    """``--power-a inf`` was "probabilities contain NaN" after a RuntimeWarning, ``--seed -1``
    numpy's words without the option; ``--mechanisms ,`` ran every mechanism and
    ``--task ,`` every task."""
    res = runner.invoke(app, [*argv, "--out", str(tmp_path / "out")])
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and expect in lines[0], res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["-1:all:band", "- -1:all:band"])
def test_a_plan_text_yaml_reads_as_a_string_is_compact_rules(text):
    """YAML reads "-1:all:band" as a string: parsed as rules, not again as YAML (that was a
    RecursionError)."""
    from attnlab.hf.plan import Plan, PlanError

    with pytest.raises(PlanError, match=r"layers: cannot read '-1'"):
        Plan.parse(text)
