"""The package's import graph, read from the source (every import, also those inside
functions; imports for type checkers only are left out): `model/` imports nothing from
`engine/`, `batch/` nothing from `ray/`, and no module reaches itself again through its
imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "gristmill").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the gristmill modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import submodule` imports the submodule
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name and target.startswith("gristmill"):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                found.append(sorted(component + [module]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _crossing(graph, source: str, target: str) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith(source)
                  for b in targets if b.startswith(target))


def test_model_imports_nothing_from_engine_and_batch_nothing_from_ray():
    graph = import_graph()
    assert len(graph) > 80 and graph["gristmill.model.runner"], "the graph was not read"
    assert _crossing(graph, "gristmill.model.", "gristmill.engine") == []
    assert _crossing(graph, "gristmill.batch.", "gristmill.ray") == []
    assert _crossing(graph, "gristmill.engine.", "gristmill.server") == []
    # the step contract belongs to neither side
    assert not {m for m in graph["gristmill.step"] if m.startswith(("gristmill.engine", "gristmill.model"))}


def test_the_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
