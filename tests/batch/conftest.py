"""Batch tests: the bundled model, with faults that fire only on marked rows.

GRISTMILL_FAULTS stays set for the whole package (it is read by every engine started
here): rows whose prompt holds BADROW fail to set up their detokenizer, rows whose
prompt holds TOKFAIL fail to tokenize, and a row whose prompt holds POISON makes the
engine core exit when it is scheduled.
"""

from __future__ import annotations

import os

import pytest

from gristmill import EngineConfig, faults
from gristmill.batch import deploy

FAULTS = "detokenize_init@prompt~BADROW,tokenize@prompt~TOKFAIL,core_exit@prompt~POISON"
ENGINE = EngineConfig(device="cpu", max_model_len=512)


@pytest.fixture(scope="package", autouse=True)
def marked_row_faults():
    before = os.environ.get("GRISTMILL_FAULTS")
    os.environ["GRISTMILL_FAULTS"] = FAULTS
    faults.load()
    yield
    if before is None:
        os.environ.pop("GRISTMILL_FAULTS", None)
    else:
        os.environ["GRISTMILL_FAULTS"] = before
    faults.load()


@pytest.fixture(scope="package")
def shared(marked_row_faults):
    with deploy(ENGINE, name="tests-shared") as deployment:
        yield deployment


def tiny_engine(**options) -> EngineConfig:
    """An engine on the tiny random-weight model (context 256), for tests of what a job or
    an engine does (restarts, deaths, rows, files) where the bundled model's text is not
    what is checked: it starts and generates in a fraction of the bundled model's time."""
    from tests.batch.inprocess import tiny_model

    return EngineConfig(**{"model": str(tiny_model()), "device": "cpu", "max_model_len": 256, **options})


def rows_of(n: int, start: int = 0) -> list[dict]:
    return [{"id": i, "prompt": f"Story {i}: once upon a time",
             "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}
            for i in range(start, start + n)]
