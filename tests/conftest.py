"""Shared fixtures: the real bundled Gemma 3 270M, loaded once per run, as users get it
(`default_llm`: int8 weights on CPU) and on the exact float path (`float_llm`)."""

from __future__ import annotations

import os

import pytest

# Under xdist (`make test`: two workers on a 2-core machine) each worker and the engines it
# starts compute on one thread: two processes of two spinning OpenMP threads on two cores
# slow each other several times over. Set before torch is imported; children inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Triton decides at import whether its own jit functions (tl.sum...) run interpreted: set
# TRITON_INTERPRET before any test imports it (sentence-transformers does, through
# transformers), or the kernels tests/model/test_triton_kernels.py runs on CPU fail.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# This process starts well over a hundred engine cores, one after another: fork each
# from a launcher that imported torch once (tests/engine/test_core_launcher.py), rather
# than importing it again per core. Not through the environment: the servers and jobs
# the tests start as processes start one core each, and run as users run them.
from gristmill.engine import core_launcher  # noqa: E402

core_launcher.ENABLED = True


# Files of several minutes each (`--durations`), scheduled right after the Ray group.
LONG_FILES = ("tests/server/test_structured_mixed.py", "tests/test_llm.py", "tests/model/test_quality.py",
              "tests/test_structured_output.py")


@pytest.hookimpl(tryfirst=True)  # (before xdist's own hook reads the marks)
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup` (what `make test` runs): a test file's tests
    run in one worker, so its module fixtures (an engine, a server) start once; the Ray
    tests all run in one worker, on one cluster of 2 CPUs (two clusters would deadlock
    the machine's CPUs)."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group("ray" if path.startswith("tests/on_ray/") else path))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The longest groups first (the Ray tests, then the files that take minutes on the
        # real model): the short files then fill both workers at the end, instead of one
        # worker waiting for the other to finish a long file alone.
        def order(item) -> int:
            path = item.nodeid.split("::", 1)[0]
            return 0 if path.startswith("tests/on_ray/") else 1 if path in LONG_FILES else 2
        items.sort(key=order)


@pytest.fixture(scope="session")
def default_llm():
    from gristmill import LLM
    return LLM(device="cpu")


@pytest.fixture(scope="session")
def float_llm():
    from gristmill import LLM
    return LLM(device="cpu", quantization=None)
