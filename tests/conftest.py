"""Shared fixtures: the real bundled Gemma 3 270M, loaded once per run, as users get it
(`default_llm`: int8 weights on CPU) and on the exact float path (`float_llm`)."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

# Under xdist (`make test`: two workers on a 2-core machine) each worker and the engines it
# starts compute on one thread: two processes of two spinning OpenMP threads on two cores
# slow each other several times over. Set before torch is imported; children inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# A suite started in the background of a non-interactive shell (`make test &`) inherits
# SIGINT ignored, and so would every process it starts: Ctrl-C would do nothing and the
# tests of what Ctrl-C does would fail. Handled here, it is the default again after exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
              "tests/test_structured_output.py", "tests/model/test_families_gguf.py")


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: a test file (its module fixtures, an engine or a
    server, start once), or all the Ray tests (one cluster of 2 CPUs: two clusters would
    deadlock the machine's CPUs)."""
    path = nodeid.split("::", 1)[0]
    return "ray" if path.startswith("tests/on_ray/") else path


def _rank(path: str) -> int:
    return 0 if path == "ray" else 1 if path in LONG_FILES else 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N --dist loadgroup` (what `make test` runs) hands out `work_unit`s. Not
    through xdist_group marks: xdist puts a test's group into its node id, which pytest
    9.2 no longer lets a plugin change, so marked tests were spread over both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # (the order pytest_collection_modifyitems gives)
    return WorkUnits(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest units first (the Ray tests, then the files that take minutes on the real
    model, then the rest by their number of tests): the short files then fill both
    workers at the end, instead of one worker finishing a long file alone."""
    if config.getvalue("dist") == "loadgroup" or os.environ.get("PYTEST_XDIST_WORKER"):
        sizes = Counter(work_unit(item.nodeid) for item in items)
        items.sort(key=lambda item: (_rank(work_unit(item.nodeid)), -sizes[work_unit(item.nodeid)]))


@pytest.fixture(scope="session")
def default_llm():
    from gristmill import LLM
    return LLM(device="cpu")


@pytest.fixture(scope="session")
def float_llm():
    from gristmill import LLM
    return LLM(device="cpu", quantization=None)
