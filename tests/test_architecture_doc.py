"""docs/architecture.md's folder map states each part's imports of ours as the code has them.

The column reads ``A, B; lazy: C`` (``A``, ``B`` imported at module level, ``C`` only inside
functions) or ``none``; text in parentheses is commentary. Read with the scanner of
tests/test_architecture.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_architecture import IMPORTS, _ours, _owner_module

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _part(module: str) -> str:
    """attnlab.hf.plan -> hf; attnlab.cli_bench -> cli; attnlab -> __init__."""
    names = module.split(".")
    if len(names) == 1:
        return "__init__"
    return "cli" if names[1].startswith("cli") or names[1] == "__main__" else names[1]


def _actual() -> dict[str, tuple[set[str], set[str]]]:
    """part -> (parts imported at module level, parts imported only inside functions)."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for imp in IMPORTS:
        target = _owner_module(imp.target) if _ours(imp.target) else ""
        if not target:
            continue
        src, dst = _part(imp.module), _part(target)
        if src != dst and dst != "__init__":
            out.setdefault(src, (set(), set()))[0 if imp.top else 1].add(dst)
    return {p: (top, lazy - top) for p, (top, lazy) in out.items()}


def _documented() -> dict[str, tuple[set[str], set[str]]]:
    text = DOC.read_text()
    table = text[text.index("## src/attnlab"):text.index("## Around the package")]
    known = {_part(i.module) for i in IMPORTS} | {"io", "models", "presets", "catalogue"}
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        first = cells[0].split(",")[0].strip("` ").removesuffix("/").removesuffix(".py")
        part = "cli" if first.startswith("cli") else first
        cell = re.sub(r"\([^()]*\)", "", cells[2])  # commentary aside
        top, _, lazy = cell.partition("lazy:")
        words = lambda s: {w for w in re.findall(r"[a-z_]+", s) if w in known}  # noqa: E731
        out[part] = (words(top), words(lazy))
    return out


def test_the_folder_map_states_the_imports_the_code_has():
    documented, actual = _documented(), _actual()
    assert {"core", "hf", "analysis", "bench", "cli", "recipes"} <= documented.keys()
    wrong = []
    for part, (top, lazy) in documented.items():
        if part in ("data",):
            continue
        real_top, real_lazy = actual.get(part, (set(), set()))
        if part == "__init__":  # its lazy imports go by name (importlib), unseen here
            lazy = real_lazy
        if (top, lazy) != (real_top, real_lazy):
            wrong.append(f"{part}: documented {sorted(top)}; lazy: {sorted(lazy)} -- the code "
                         f"has {sorted(real_top)}; lazy: {sorted(real_lazy)}")
    assert not wrong, "\n".join(wrong)
