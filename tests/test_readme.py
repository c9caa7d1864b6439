"""The README's short tour runs as written, and what its comments show is what it returns."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _tour() -> str:
    text = README.read_text()
    section = text[text.index("## A short tour"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_tour_comment_lists_the_first_mechanisms():
    import attnlab

    line = next(ln for ln in _tour().splitlines() if "attnlab.list_mechanisms()" in ln)
    shown = ast.literal_eval(re.search(r"#\s*(\[.*)\.\.\.\]", line).group(1) + "]")
    assert shown == attnlab.list_mechanisms()[:len(shown)]


def test_tour_runs_and_its_shapes_are_the_comments(tmp_path):
    checks = ("\nassert list(res.out.shape) == [1, 2, 32, 8], res.out.shape"
              "\nassert list(res.probs.shape) == [1, 2, 32, 32], res.probs.shape"
              "\nassert (tmp / 'out' / 'plan.json').is_file()\nprint('tour ok')\n")
    script = "from pathlib import Path\ntmp = Path.cwd()\n" + _tour() + checks
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tour ok" in res.stdout
