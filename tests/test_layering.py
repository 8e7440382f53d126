"""The package's import graph, read from the source (every import: inside functions and
under `if TYPE_CHECKING:` too): `model/` imports nothing from `engine/`, `batch/` nothing
from `ray/`, the leaves (`paths.py`, `structured/`) nothing from `model/`; no module
reaches itself again through its imports, and no two parts of the package (its
subpackages and the modules beside them) import each other."""

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


def _imported(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The module `from ... import` names, a relative one made absolute."""
    if not node.level:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_graph() -> dict[str, set[str]]:
    """module -> the gristmill modules it imports."""
    modules = _modules()
    return {name: _imports(ast.parse(path.read_text()), name, path, modules) for name, path in modules.items()}


def _imports(tree: ast.AST, name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The gristmill modules that the module `name` (parsed: `tree`) imports, wherever
    the import stands."""
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _imported(node, name, path)
            # `from package import submodule` imports the submodule
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name and target.startswith("gristmill"):
                imported.add(target)
    return imported


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The parts of the package (`gristmill.model`, `gristmill.paths`, ...) -> the parts
    their modules import."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: dict[str, set[str]] = {part(module): set() for module in graph}
    for module, targets in graph.items():
        parts[part(module)] |= {part(target) for target in targets} - {part(module)}
    return parts


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
    # the leaves: the layer that owns a model converts it, and applies masks to logits
    assert _crossing(graph, "gristmill.paths", "gristmill.model") == []
    assert _crossing(graph, "gristmill.structured", "gristmill.model") == []


def test_the_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_no_two_parts_of_the_package_import_each_other():
    assert cycles(part_graph(import_graph())) == []


def test_every_import_counts():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gristmill.engine import core\n"
              "def load():\n    from .loader import gguf_file\n    import gristmill.paths\n")
    module, path = "gristmill.model.runner", ROOT / "gristmill" / "model" / "runner.py"
    assert _imports(ast.parse(source), module, path, _modules()) == {
        "gristmill.engine.core", "gristmill.model.loader.gguf_file", "gristmill.paths"}


def test_the_cycle_finders_find_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # two modules of one part and a module beside it: no module cycle, a cycle of parts
    graph = {"gristmill.model.a": {"gristmill.paths"}, "gristmill.paths": {"gristmill.model.b"},
             "gristmill.model.b": set()}
    assert cycles(graph) == [] and cycles(part_graph(graph)) == [["gristmill.model", "gristmill.paths"]]
