"""Tests on a real local Ray cluster of 2 CPUs, started once for the package.

GRISTMILL_FAULTS reaches the cluster's workers (engine actors, Serve replicas) through
the job's runtime_env, and this process through its environment: rows whose prompt
holds BADROW fail to set up their detokenizer; a row whose prompt holds POISON makes
its engine core exit.
"""

from __future__ import annotations

import gc
import os

import pytest

from gristmill import EngineConfig, faults

ray = pytest.importorskip("ray")

FAULTS = "detokenize_init@prompt~BADROW,core_exit@prompt~POISON"
ENGINE = EngineConfig(device="cpu", max_model_len=512)
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
TINY_MAX_MODEL_LEN = 128


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory):
    """A one-layer random-weight model with a chat template, converted once into the
    machine's cache (kilobytes; the workers' engines find it there): for tests where the
    runners' outputs are compared, not the real model's. `tiny_engine(tiny_model)` is its
    EngineConfig."""
    from gristmill.model.loader import resolve_model
    from tests.model.test_loader import write_tiny_gguf

    return resolve_model(str(write_tiny_gguf(tmp_path_factory.mktemp("tiny-model") / "tiny.gguf", "llama", "gpt2")))


def tiny_engine(tiny_model) -> EngineConfig:
    return EngineConfig(model=str(tiny_model), device="cpu", max_model_len=TINY_MAX_MODEL_LEN)


@pytest.fixture(scope="package", autouse=True)
def cluster():
    before = os.environ.get("GRISTMILL_FAULTS")
    os.environ["GRISTMILL_FAULTS"] = FAULTS
    faults.load()
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"GRISTMILL_FAULTS": FAULTS}})
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    yield ray
    from ray import serve
    serve.shutdown()
    ray.shutdown()
    if before is None:
        os.environ.pop("GRISTMILL_FAULTS", None)
    else:
        os.environ["GRISTMILL_FAULTS"] = before
    faults.load()


@pytest.fixture(autouse=True)
def release_actors():
    """After each test, its jobs' actors go at once. A failed job's exception holds Ray
    Data's executor, and through it the engine actors and their CPUs, in a reference
    cycle until Python's collector runs (Ray asks for it ~20 s after a task waits for a
    CPU): the next job on this 2-CPU cluster waited those 20 s for its actor."""
    yield
    gc.collect()


def story_rows(n: int, start: int = 0) -> list[dict]:
    return [{"key": i, "prompt": f"Story {i}: once upon a time", "sampling_params": dict(GREEDY)}
            for i in range(start, start + n)]


def by_key(rows: list[dict]) -> dict:
    keys = [row["key"] for row in rows]
    assert len(keys) == len(set(keys)), f"a row came out twice: {sorted(keys)}"
    return {row["key"]: row for row in rows}
