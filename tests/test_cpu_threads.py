"""EngineConfig.cpu_threads (`--cpu-threads`, as llama.cpp's --threads): the threads the
engine's CPU work runs on, set in the process that runs its core; the output does not
depend on it; more threads than CPUs is said at start; a count that is not one is refused."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch

from gristmill import LLM, EngineConfig, RequestError, SamplingParams
from gristmill.engine.async_engine import AsyncEngine
from tests.batch.inprocess import tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = ["Hello there", "a b c d e f g", "The numbers 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]


@pytest.fixture
def threads_kept():
    """This process's torch threads, put back after the test (an in-process LLM sets them)."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_a_thread_count_that_is_not_one_is_refused_naming_the_field(value):
    with pytest.raises(RequestError, match=r"EngineConfig\.cpu_threads: must be a positive integer or None") as caught:
        EngineConfig(cpu_threads=value)
    assert caught.value.param == "cpu_threads"


def test_an_in_process_llm_runs_on_the_threads_given_with_the_same_output(threads_kept, tmp_path):
    texts = {}
    for threads in (1, 2):
        llm = LLM(model=str(tiny_model()), device="cpu", cache_dir=str(tmp_path), cpu_threads=threads)
        assert torch.get_num_threads() == threads and llm.core.stats()["cpu_threads"] == threads
        texts[threads] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert texts[1] == texts[2] and all(len(ids) > 0 for ids in texts[1])


def test_the_core_process_runs_on_the_threads_given_and_the_caller_keeps_its_own(threads_kept, tmp_path):
    async def run():
        engine = AsyncEngine(EngineConfig(model=str(tiny_model()), device="cpu", cache_dir=str(tmp_path),
                                          cpu_threads=threads_kept + 1))
        try:
            return (await engine.stats())["cpu_threads"]
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == threads_kept + 1
    assert torch.get_num_threads() == threads_kept


def test_more_threads_than_cpus_is_said_at_start_and_still_runs(threads_kept, tmp_path, caplog):
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with caplog.at_level(logging.WARNING, logger="gristmill.startup"):
        llm = LLM(model=str(tiny_model()), device="cpu", cache_dir=str(tmp_path), cpu_threads=cpus + 1)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"cpu_threads={cpus + 1} is more than the {cpus} CPUs" in said and f"cpu_threads={cpus} or fewer" in said
    assert llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_serve_replica_s_threads_are_its_engine_s_cpu_threads(threads_kept, tmp_path):
    """`deploy(..., threads=N)` hands each replica N: its engine's cpu_threads (the
    replica class itself, without a Ray cluster), not a changed environment."""
    pytest.importorskip("ray")
    from gristmill.ray import EngineServer

    environment = dict(os.environ)

    async def run():
        server = EngineServer(EngineConfig(model=str(tiny_model()), device="cpu", cache_dir=str(tmp_path)),
                              threads=threads_kept + 1)
        try:
            return (await server.stats())["cpu_threads"]
        finally:
            server.engine.shutdown()

    assert asyncio.run(run()) == threads_kept + 1
    assert dict(os.environ) == environment


@pytest.mark.parametrize("value", [0, 1.5, True])
def test_deploy_refuses_a_thread_count_before_it_starts_anything(value):
    """Checked in the caller, before Ray or Serve start: not in every replica, in a loop of restarts."""
    pytest.importorskip("ray")
    from gristmill.ray import deploy

    with pytest.raises(RequestError, match="deploy: threads must be a positive integer") as caught:
        deploy(EngineConfig(), threads=value)
    assert caught.value.param == "threads"
