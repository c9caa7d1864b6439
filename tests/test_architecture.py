"""The import graph of attnlab keeps the house rules: arrows point down.

``cli -> recipes -> {train, tasks, tuning, analysis, bench, tlm} -> hf -> mechanisms -> core``.
Read from the source with ``ast`` (nothing is imported):

- no cycle between modules through module-level imports (imports inside a function or
  method run on use and are not edges; ``if TYPE_CHECKING:`` blocks never run);
- no module takes a private name (``_x``, or anything from a private module ``_x.py``)
  from a module of another package of attnlab: what crosses a package line is public;
- the layers: ``core`` imports nothing of attnlab outside ``core``; ``mechanisms`` never
  import transformers, nor attnlab's hf / train / tasks / recipes / tuning / analysis / cli
  (imports inside functions count here);
- and, run for real: ``import attnlab.cli`` (what ``attnlab --help`` loads) imports none of
  the heavy libraries, which the commands import on use.

An allow-list entry names one known violation in a file whose owner is rewriting it; the
owner removes the entry with the fix. A stale entry (the violation is gone) fails, so the
lists only shrink.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "attnlab"

# (importing module, imported module, name) -> why it is still allowed.
PRIVATE_ALLOWED: dict[tuple[str, str, str], str] = {}

# (importing module, imported module) module-level edges left out of the cycle check.
CYCLE_ALLOWED: dict[tuple[str, str], str] = {}

# (importing module, imported module) layering violations still allowed.
LAYER_ALLOWED: dict[tuple[str, str], str] = {}

MECHANISMS_FORBIDDEN = ("hf", "train", "tasks", "recipes", "tuning", "analysis", "cli")
# Libraries the CLI's start (``attnlab --help``) must not import.
HEAVY = ("transformers", "matplotlib", "peft", "accelerate", "datasets", "sklearn", "scipy",
         "seqeval", "tokenizers", "safetensors")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted (a name imported from a package that is
    #              itself a module, e.g. ``from .hf import surgery``, resolves to it)
    names: tuple[str, ...]  # names taken with ``from target import ...`` ("" for ``import``)
    top: bool  # at module level (not inside a function); TYPE_CHECKING blocks excluded
    line: int


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / ROOT).rglob("*.py"))}


MODULES = _modules()


def _package_of(module: str) -> str:
    """The package a module belongs to: itself for a package, else its parent."""
    path = MODULES.get(module)
    if path is not None and _is_package(path):
        return module
    return module.rpartition(".")[0]


def _resolve(module: str, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = _package_of(module).split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk(module: str, body: list[ast.stmt], top: bool, out: list[Import]) -> None:
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(module, alias.name, ("",), top, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node.level, node.module)
            names = tuple(a.name for a in node.names)
            # ``from pkg import submodule`` imports the submodule: an edge to it
            subs = [n for n in names if f"{target}.{n}" in MODULES]
            for n in subs:
                out.append(Import(module, f"{target}.{n}", ("",), top, node.lineno))
            rest = tuple(n for n in names if n not in subs)
            if rest or not subs:
                out.append(Import(module, target, rest, top, node.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _walk(module, node.body, False, out)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            _walk(module, node.body, False, out)
            _walk(module, node.orelse, top, out)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.AST):
                    _walk(module, inner, top, out)  # class bodies, try/if/with at top level


def _imports() -> list[Import]:
    out: list[Import] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        _walk(module, tree.body, True, out)
    return out


IMPORTS = _imports()


def _ours(name: str) -> bool:
    return name == ROOT or name.startswith(ROOT + ".")


def _owner_module(target: str) -> str:
    """The attnlab module that defines ``target`` (dotted names may run past a module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def _module_edges(top_only: bool = True) -> dict[str, set[str]]:
    """Module -> the attnlab modules it imports at module level (``top_only=False``: also
    inside functions).

    Only the named module is an edge, not its parent packages: Python runs a parent's
    ``__init__`` first, but a half-initialised parent package does not break the import."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if not ((imp.top or not top_only) and _ours(imp.target)):
            continue
        target = _owner_module(imp.target)
        if target and target != imp.module:
            graph[imp.module].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if color.get(nxt, BLACK) == GREY:
                return [*stack[stack.index(nxt):], nxt]
            if color.get(nxt) == WHITE and (found := visit(nxt)):
                return found
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE and (found := visit(node)):
            return found
    return None


# ----------------------------------------------------------------------------- the scanner


def test_the_scanner_sees_the_package():
    assert {"attnlab", "attnlab.core", "attnlab.hf.surgery", "attnlab.cli"} <= MODULES.keys()
    hf = {(i.module, i.target) for i in IMPORTS if i.top}
    assert ("attnlab.hf.saving", "attnlab.hf.surgery") in hf
    assert ("attnlab.hf", "attnlab.hf.surgery") in hf


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_imports_resolve():
    assert _resolve("attnlab.hf.saving", 1, "surgery") == "attnlab.hf.surgery"
    assert _resolve("attnlab.hf", 1, "plan") == "attnlab.hf.plan"
    assert _resolve("attnlab.hf.saving", 2, "core") == "attnlab.core"
    assert _resolve("attnlab.hf.saving", 2, None) == "attnlab"


# ----------------------------------------------------------------------------- the rules


def test_no_import_cycle_at_module_level():
    graph = _module_edges()
    stale = [edge for edge in CYCLE_ALLOWED if edge[1] not in graph.get(edge[0], ())]
    assert not stale, f"stale entries: {stale}"
    for a, b in CYCLE_ALLOWED:
        graph[a].discard(b)
    cycle = _find_cycle(graph)
    assert cycle is None, (
        "module-level import cycle: " + " -> ".join(cycle or [])
        + "; make the imports one-way (move the shared part down a layer)")


def test_no_import_cycle_even_through_imports_inside_functions():
    """A lazy import (start-up time) is still an arrow of the design: recipes, the CLI's
    command groups and every other module import one way only."""
    cycle = _find_cycle(_module_edges(top_only=False))
    assert cycle is None, (
        "import cycle through an import inside a function: " + " -> ".join(cycle or [])
        + "; move the shared part down a layer instead of importing it lazily")


def _private(imp: Import) -> list[str]:
    """Private names (or a private module) that ``imp`` takes across a package line."""
    if not _ours(imp.target):
        return []
    target = _owner_module(imp.target)
    if _package_of(imp.module) == _package_of(target) or imp.module == _package_of(target):
        return []  # within one package (a package's __init__ may re-export its own)
    if any(p.startswith("_") and not p.startswith("__") for p in imp.target.split(".")):
        return [imp.target]  # a private module: everything in it is private
    return [n for n in imp.names if n.startswith("_") and not n.startswith("__")]


def _where(imp: Import) -> str:
    return f"{MODULES[imp.module].relative_to(SRC)}:{imp.line}"


def test_no_private_name_crosses_a_package_line():
    bad, used = [], set()
    for imp in IMPORTS:
        for name in _private(imp):
            key = (imp.module, _owner_module(imp.target), name)
            if key in PRIVATE_ALLOWED:
                used.add(key)
                continue
            bad.append(f"{_where(imp)} imports {name!r} from {imp.target}")
    assert not bad, "private names across packages (give them a public name):\n" + "\n".join(bad)
    assert used == PRIVATE_ALLOWED.keys(), f"stale entries: {PRIVATE_ALLOWED.keys() - used}"


def _layer(imp: Import) -> str | None:
    """Why ``imp`` breaks the layering (None if it does not). Function-level imports count."""
    pkg = imp.module.split(".")[1] if "." in imp.module else ""
    parts = imp.target.split(".")
    sub = parts[1] if len(parts) > 1 else ""
    if pkg == "core" and _ours(imp.target) and sub != "core":
        return "core imports nothing of attnlab outside core"
    if pkg == "mechanisms":
        if parts[0] == "transformers":
            return "mechanisms never import transformers"
        if _ours(imp.target) and (sub in MECHANISMS_FORBIDDEN or sub.startswith("cli")):
            return f"mechanisms never import attnlab.{sub}"
    return None


def test_layers_point_down():
    bad, used = [], set()
    for imp in IMPORTS:
        why = _layer(imp)
        if why is None:
            continue
        key = (imp.module, imp.target)
        if key in LAYER_ALLOWED:
            used.add(key)
            continue
        bad.append(f"{_where(imp)} imports {imp.target}: {why}")
    assert not bad, "layering:\n" + "\n".join(bad)
    assert used == LAYER_ALLOWED.keys(), f"stale entries: {LAYER_ALLOWED.keys() - used}"


def test_the_rules_catch_what_they_should():
    def imp(module: str, target: str, *names: str) -> Import:
        return Import(module, target, names or ("",), True, 1)

    # private names: across packages only
    assert _private(imp("attnlab.bench.jat", "attnlab.mechanisms._jat_adjacency"))
    assert _private(imp("attnlab.cli", "attnlab.hf.surgery", "_build")) == ["_build"]
    assert not _private(imp("attnlab.hf.check", "attnlab.hf.surgery", "_build"))
    assert not _private(imp("attnlab.mechanisms.jat", "attnlab.mechanisms._jat_adjacency",
                            "jump_counts"))
    assert not _private(imp("attnlab.hf", "attnlab.hf.surgery", "__all__"))
    # layers
    assert _layer(imp("attnlab.core.masks", "attnlab.mechanisms.dense"))
    assert _layer(imp("attnlab.core.masks", "attnlab", "build_mechanism"))
    assert not _layer(imp("attnlab.core.masks", "attnlab.core.protocol"))
    assert _layer(imp("attnlab.mechanisms.jat", "transformers", "AutoModel"))
    assert _layer(imp("attnlab.mechanisms.jat", "attnlab.hf.backend"))
    assert _layer(imp("attnlab.mechanisms.jat", "attnlab.cli_data"))
    assert not _layer(imp("attnlab.mechanisms.jat", "attnlab.core"))
    assert not _layer(imp("attnlab.hf.backend", "transformers"))


def test_the_cli_starts_without_heavy_libraries():
    """``attnlab --help`` imports attnlab.cli; the heavy libraries wait for a command."""
    code = ("import sys, attnlab.cli; "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    loaded = res.stdout.split()
    assert not loaded, f"importing attnlab.cli loads {loaded}; import them inside the command"
