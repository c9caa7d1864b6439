"""The scripts in examples/ run: each with ``--tiny`` in a subprocess, from a fresh folder
(where it writes its outputs), offline; exit status 0 and its result printed.

Each takes a few seconds to ~30 s on 2 shared CPU cores (the embedded MiniLM is loaded each
time); the timeout leaves room for a loaded machine.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> patterns its output must contain (the result it exists to print)
EXPECTED = {
    "replace_heads_and_finetune.py": [
        r"layer \| h0 ", r"band = band\(window=8", r"jat = jat\(rho=5\.0",
        r"step 6/6  loss \d", r"dev mcc: -?\d\.\d{3}  \(32 sentences\)"],
    "compare_two_mechanisms.py": [
        r"softmax \(baseline\) +-?\d\.\d{3} ", r"band\(window=8\) +-?\d\.\d{3} ",
        r"comparison\.md"],
    "hf_trainer.py": [
        r"disagreement = disagreement\(", r"trained 6 steps, mean loss \d",
        r"dev mcc: -?\d\.\d{3}  \(32 sentences\)",
        r"reloaded with its plan: identical dev logits True"],
    "analyse_heads.py": [
        r"default: 6 sentences", r"layer +vertical +diagonal +vertical\+diagonal +block "
        r"+heterogeneous", r"\n    5 +\d+"],
}


def test_every_example_is_tested_and_documented():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(EXPECTED)
    for name in scripts:
        text = (EXAMPLES / name).read_text()
        doc = ast.get_docstring(ast.parse(text))
        assert doc and len(doc) > 100, f"{name}: a docstring saying what it shows"
        assert "--tiny" in text, f"{name}: a --tiny flag for CI-size settings"


def run_example(name: str, cwd: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(EXAMPLES / name), "--tiny"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{name} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name, tmp_path):
    out = run_example(name, tmp_path)
    for pattern in EXPECTED[name]:
        assert re.search(pattern, out), f"{name} did not print {pattern!r}:\n{out[-3000:]}"
    if name == "compare_two_mechanisms.py":
        folder = tmp_path / "runs" / "compare_two_mechanisms"
        assert (folder / "comparison.md").is_file()
        assert len(list(folder.glob("*/seed-0/summary.json"))) == 2
    if name == "analyse_heads.py":  # every one of the 6 x 12 heads has a class
        total = re.search(r"^total((?: +\d+)+)$", out, re.M)
        assert total and sum(map(int, total.group(1).split())) == 72
