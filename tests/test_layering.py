"""The package's import graph, read from the source (every import: inside functions and
under `if TYPE_CHECKING:` too): `model/` imports nothing from `engine/`, `batch/` nothing
from `ray/`, the leaves (`paths.py`, `structured/`) nothing from `model/`; no module
reaches itself again through its imports, and no two parts of the package (its
subpackages and the modules beside them) import each other.

What importing a module really loads is checked in a fresh interpreter, since other test
modules of a run import torch, Ray and every part of the package: `fresh_imports()` runs
ONE such interpreter for every "importing X loads no Y" check of the suite (the step
contract, batch/ and the CLI, the CLI's help, the kernels' check), each test reading its
own part of the report.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
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


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the gristmill modules it imports (read once per run; not to be changed)."""
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


def test_every_face_of_the_engine_stands_on_the_one_engine_client():
    """LLM and AsyncEngine are faces over engine/client.py; neither wires the engine's
    parts (processors, core, model) itself."""
    graph = import_graph()
    parts = {"gristmill.engine.builder", "gristmill.engine.core_client", "gristmill.engine.processor",
             "gristmill.engine.output_processor", "gristmill.engine.core_process"}
    for face in ("gristmill.llm", "gristmill.engine.async_engine"):
        assert "gristmill.engine.client" in graph[face], face
        assert not graph[face] & parts, (face, graph[face] & parts)
        assert not {m for m in graph[face] if m.startswith("gristmill.model")}, face


def test_the_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_no_two_parts_of_the_package_import_each_other():
    assert cycles(part_graph(import_graph())) == []


def test_every_import_counts():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gristmill.engine import core\n"
              "def load():\n    from .loader import gguf_model\n    import gristmill.paths\n")
    module, path = "gristmill.model.runner", ROOT / "gristmill" / "model" / "runner.py"
    assert _imports(ast.parse(source), module, path, _modules()) == {
        "gristmill.engine.core", "gristmill.model.loader.gguf_model", "gristmill.paths"}


def test_the_cycle_finders_find_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # two modules of one part and a module beside it: no module cycle, a cycle of parts
    graph = {"gristmill.model.a": {"gristmill.paths"}, "gristmill.paths": {"gristmill.model.b"},
             "gristmill.model.b": set()}
    assert cycles(graph) == [] and cycles(part_graph(graph)) == [["gristmill.model", "gristmill.paths"]]


# -- what importing loads, in one fresh interpreter ------------------------------------------

# Run in this order in one interpreter. sys.modules only grows, so each stage's check is on
# everything loaded up to its end (at least as strict as on what the stage alone loaded):
# the stages that forbid the most come first, and the one that loads torch comes last.
_FRESH_IMPORTS = r"""
import contextlib, importlib, io, json, sys
from pathlib import Path

report = {}

def loaded(*names, prefixes=()):
    return sorted(m for m in sys.modules if m in names or m.startswith(tuple(prefixes)))

# 1. The step contract (gristmill/step.py) belongs to neither engine/ nor model/.
import gristmill.step
report["step"] = loaded("torch", prefixes=("gristmill.engine", "gristmill.model"))

# 2. The CLI's help needs no torch.
out = io.StringIO()
from gristmill.cli import main
for command in (["serve", "--help"], ["batch", "--help"], ["generate", "--help"]):
    with contextlib.redirect_stdout(out):
        try:
            main(command)
        except SystemExit as exc:
            assert exc.code == 0, command
report["cli_help"] = {"torch": loaded("torch"), "stdout": out.getvalue()}

# 3. batch/ and the CLI import no Ray: batch/ reaches the Ray parts it offers by name.
import gristmill.batch
batch = sorted(f"gristmill.batch.{p.stem}" for p in Path(gristmill.batch.__file__).parent.glob("*.py")
               if p.stem != "__init__")
for name in ["gristmill.cli", *batch]:
    importlib.import_module(name)
report["batch"] = {"modules": batch, "ray": loaded("ray", prefixes=("ray.", "gristmill.ray"))}

# 4. Whether the kernels must compile is answered without torch; then the extensions (torch).
from gristmill.model.cpu import kernels
built = kernels.is_built()
torch_before = loaded("torch")
ext = kernels.extension()
report["kernels"] = {"built": built, "torch_before_loading": torch_before,
                     "int8_has": [hasattr(ext, "int8_linear"), hasattr(ext, "q4_linear")],
                     "q4_has_q4": hasattr(kernels.q4_extension(), "q4_linear"),
                     "one_module_after_q4": kernels.extension() is kernels.q4_extension()}
print("REPORT", json.dumps(report))
"""


@functools.cache
def fresh_imports() -> dict:
    """What each stage of `_FRESH_IMPORTS` loaded, from one fresh interpreter (run once per
    test run; the kernels' stage may compile the 4-bit kernel, minutes on a first run)."""
    done = subprocess.run([sys.executable, "-c", _FRESH_IMPORTS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


def test_the_kernels_build_needs_nothing_but_torch():
    """`make test` builds the kernels (`python -m gristmill.model.cpu.kernels`) while pip
    installs the rest, in a venv that holds torch and ninja only: importing gristmill for it
    must need nothing else, or the build fails there and the first tests compile the
    kernels instead, both workers waiting (numpy, gguf, transformers... blocked here)."""
    code = ("import importlib.abc, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in {'numpy', 'gguf', 'transformers', 'tokenizers', 'safetensors', "
            "'jinja2', 'llguidance', 'pydantic', 'yaml'}:\n"
            "            raise ImportError(f'{name} is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import gristmill.model.cpu.kernels as kernels\n"
            "assert callable(kernels.extension)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
