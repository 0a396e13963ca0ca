"""The package's shape: no module over 600 lines, no import cycle among modules or packages.

Both bounds were met once and regressed without anyone noticing; these tests keep them.
Imports are read with :mod:`ast` (nothing is imported). What counts as an import:

- **every** ``import`` statement of a module, wherever it stands: at the top, inside a
  function (a deferred import), or under ``if TYPE_CHECKING:``. Deferring an import is how
  a cycle usually gets hidden (it no longer breaks ``import``, so nothing complains), but
  the two modules still know each other and neither can be read, tested or moved alone; a
  ``TYPE_CHECKING`` import is a dependency of the module's interface. The failure message
  says which kind each import of a cycle is, so deferred ones can be told apart.
- ``from dapo.a import b`` depends on ``dapo.a.b`` when that is a module, else on
  ``dapo.a``; a module does not depend on its parent packages' ``__init__`` (importing
  ``dapo.a.b`` runs ``dapo/a/__init__.py`` first, but a package and its own modules are
  one unit; import-linter and pydeps count it so too).
- A package is a direct sub-package of ``dapo`` (``dapo.models``) or a top-level module
  (``dapo.errors``); package X depends on package Y when any module of X imports a module
  of Y.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "dapo"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST, kind: str = "module-level") -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement in ``tree`` with its kind: ``module-level`` (runs on import,
    including class bodies and top-level ``try``/``if``), ``deferred`` (inside a function)
    or ``type-checking`` (under ``if TYPE_CHECKING:``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, kind
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from imports(ast.Module(body=[child], type_ignores=[]), "type-checking")
            for child in node.orelse:
                yield from imports(ast.Module(body=[child], type_ignores=[]), kind)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from imports(node, "deferred" if kind == "module-level" else kind)
        else:
            yield from imports(node, kind)


def _resolve(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The ``dapo`` modules an import statement in ``module`` depends on."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the package of ``module``
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in MODULES:  # ``import dapo.a.b.c`` of an attribute
            name = name.rpartition(".")[0]
        if name.startswith("dapo.") and name != module:
            out.add(name)
    return out


def import_graph() -> dict[str, dict[str, str]]:
    """``{module: {imported dapo module: "file:line (kind)" of the first such import}}``."""
    graph: dict[str, dict[str, str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[str, str] = {}
        for node, kind in imports(tree):
            for dep in _resolve(name, node):
                edges.setdefault(dep, f"{path.relative_to(SRC.parent)}:{node.lineno} ({kind})")
        graph[name] = edges
    return graph


def package_of(module: str) -> str:
    """``dapo.models.loading`` -> ``dapo.models``; ``dapo.errors`` -> ``dapo.errors``."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """``{package: {imported package: where one import that makes the edge is}}``."""
    out: dict[str, dict[str, str]] = {}
    for module, deps in graph.items():
        src = package_of(module)
        edges = out.setdefault(src, {})
        for dep, where in deps.items():
            dst = package_of(dep)
            if dst != src:
                edges.setdefault(dst, where)
    return out


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle (a closed path of nodes) per strongly connected component of more than one
    node (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_shortest_cycle(graph, c) for c in components)


def _shortest_cycle(graph: dict[str, dict[str, str]], component: set[str]) -> list[str]:
    """A shortest closed path through the first node of a strongly connected component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    return [*paths[v], start]
                if w in component and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")  # pragma: no cover


def _describe(cycles: list[list[str]], graph: dict[str, dict[str, str]]) -> str:
    lines = []
    for cycle in cycles:
        lines.append("  " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:], strict=False):
            lines.append(f"      {a} imports {b}: {graph[a][b]}")
    return "\n".join(lines)


def test_no_module_over_600_lines() -> None:
    too_long = {
        str(path.relative_to(SRC.parent)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines (split them by concern): " + ", ".join(
        f"{p} ({n} lines)" for p, n in sorted(too_long.items())
    )


def test_the_trainer_only_composes() -> None:
    """``trainer.py`` stays under 400 lines: it orders the stages, and a new concern gets a
    module of its own (its owner builds it)."""
    n = len((ROOT / "training" / "trainer.py").read_text().splitlines())
    assert n < 400, f"src/dapo/training/trainer.py has {n} lines: move a concern to its owner"


def test_no_module_import_cycle() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among modules:\n" + _describe(cycles, graph)


def test_no_package_import_cycle() -> None:
    graph = package_graph(import_graph())
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among packages:\n" + _describe(cycles, graph)


def test_no_private_name_imported_across_modules() -> None:
    """A name with a leading underscore is its module's own: another module that needs it
    should get it under a public name (or the code should move)."""
    found = []
    for name, path in MODULES.items():
        for node, _ in imports(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom) or not _resolve(name, node):
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private:
                where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
                found.append(f"  {where}: {', '.join(private)} from {node.module}")
    assert not found, "private names imported from another module:\n" + "\n".join(found)


# --- the checker itself -------------------------------------------------------------------


def test_find_cycles_on_a_known_graph() -> None:
    graph = {
        "a": {"b": ""},
        "b": {"c": ""},
        "c": {"a": "", "d": "", "b": ""},
        "d": {},
        "e": {"f": ""},
        "f": {"e": ""},
    }
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert find_cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {}}) == []


def test_imports_are_read_as_documented() -> None:
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import dapo.errors\n"
        "from dapo.models import loading\n"
        "from dapo.rewards.math import SCORERS\n"
        "import dapo.models.tiny.RECIPES\n"
        "try:\n"
        "    from dapo import atomic\n"
        "except ImportError:\n"
        "    pass\n"
        "if TYPE_CHECKING:\n"
        "    from dapo.config import Config\n"
        "class C:\n"
        "    from dapo import seeding\n"
        "    def f(self):\n"
        "        from dapo.training import trainer\n"
        "def g():\n"
        "    import dapo.cli\n"
        "from . import shaping\n"
        "from .math import extract_answer\n"
    )
    found = {
        dep: kind
        for node, kind in imports(ast.parse(source))
        for dep in _resolve("dapo.rewards.pool", node)
    }
    assert found == {
        "dapo.errors": "module-level",
        "dapo.models.loading": "module-level",
        "dapo.rewards.math": "module-level",
        "dapo.models.tiny": "module-level",
        "dapo.atomic": "module-level",
        "dapo.config": "type-checking",
        "dapo.seeding": "module-level",
        "dapo.training.trainer": "deferred",
        "dapo.cli": "deferred",
        "dapo.rewards.shaping": "module-level",
    }


def test_the_graphs_see_the_real_imports() -> None:
    graph = import_graph()
    assert "dapo.rewards.math" in graph["dapo.rewards.user"]
    assert graph["dapo.models.loading"]["dapo.models.tiny"].endswith("(deferred)")
    packages = package_graph(graph)
    assert "dapo.parallel" in packages["dapo.models"]
    assert "dapo.errors" in packages["dapo.models"]
    assert "dapo.models" not in packages["dapo.models"]
