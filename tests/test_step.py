"""The step contract (gristmill/step.py) sits between engine/ and model/ and belongs to
neither (that model/ imports nothing from engine/: tests/test_layering.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_step_contract_imports_neither_side():
    # In a fresh interpreter: other test modules in the same run import both sides.
    code = ("import sys, gristmill.step; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('gristmill.engine', 'gristmill.model'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
