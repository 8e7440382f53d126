"""The step contract (gristmill/step.py) sits between engine/ and model/ and belongs to
neither (that model/ imports nothing from engine/: tests/test_layering.py)."""

from __future__ import annotations

from tests.test_layering import fresh_imports


def test_the_step_contract_imports_neither_side():
    # In a fresh interpreter (one for all such checks): other test modules in the same run
    # import both sides.
    assert fresh_imports()["step"] == []
