"""Imports flow one way: no module of drafthead, train or inference imports itself through others.

Every import statement counts, also those inside functions (a function-level import only postpones a circle).
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("drafthead", "train", "inference")


def project_modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of PACKAGES (found without importing them)."""
    modules = {}
    for package in PACKAGES:
        modules[package] = REPO / package / "__init__.py"
        for info in pkgutil.walk_packages([str(REPO / package)], prefix=f"{package}."):
            spec = info.module_finder.find_spec(info.name.rsplit(".", 1)[-1])
            modules[info.name] = Path(spec.origin)
    return modules


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name an import statement anywhere in `path` refers to (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports. Importing a.b.c also runs a and a.b (their __init__)."""
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in imported_names(name, path):
            parts = target.split(".")
            edges.update(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules)
        graph[name] = edges - {name} - {p for p in modules if name.startswith(p + ".")}  # parents run first
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, colours white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_walks_every_package_module():
    modules = project_modules()
    assert {"drafthead.format", "drafthead.checkpoint", "train.trainer", "inference.engine"} <= set(modules)
    graph = import_graph(modules)
    assert "drafthead.model" in graph["drafthead.checkpoint"]  # edges are found (checkpoint builds on model)


def test_no_import_cycle():
    cycle = find_cycle(import_graph(project_modules()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_reports_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_drafthead_layers():
    """format and paths are leaves (utils builds on paths only); model does not reach checkpoint; checkpoint does
    not reach export/validate; validate does not reach export."""
    graph = import_graph(project_modules())

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    internal = {m for m in graph if m.startswith("drafthead.")}
    assert not reach("drafthead.format") & internal and not reach("drafthead.paths") & internal
    assert reach("drafthead.utils") & internal == {"drafthead.paths"}
    assert not reach("drafthead.model") & {"drafthead.checkpoint", "drafthead.export", "drafthead.validate"}
    assert not reach("drafthead.checkpoint") & {"drafthead.export", "drafthead.validate"}
    assert not reach("drafthead.validate") & {"drafthead.export"}
