"""The step contract (gristmill/step.py) sits between engine/ and model/ and belongs to neither."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gristmill


def test_the_step_contract_imports_neither_side():
    # In a fresh interpreter: other test modules in the same run import both sides.
    code = ("import sys, gristmill.step; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('gristmill.engine', 'gristmill.model'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_model_imports_nothing_from_engine():
    # Every import statement, those inside functions too, of every file under model/.
    root = Path(gristmill.__file__).parent / "model"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "gristmill.engine" or n.startswith("gristmill.engine.") for n in names):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert found == [], f"model/ imports engine/ at {found}"
