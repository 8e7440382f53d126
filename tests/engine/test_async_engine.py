"""AsyncEngine's failure contract against a real engine-core process, with failures made
to happen for real (GRISTMILL_FAULTS, SIGKILL). The shared engine (`baseline`) and the
tests whose timing needs long requests run the bundled Gemma 3 270M; a test that starts
an engine of its own for a fault runs the tiny random-weight model (it starts in a
fraction of the time), its texts compared with the tiny model's run without faults."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gristmill import (AsyncEngine, EngineConfig, EngineDeadError, EngineOverloadedError,
                       GenerationError, PromptTooLongError, RequestError, SamplingParams, faults)
from gristmill.engine.messages import AddRequest
from tests.batch.inprocess import tiny_model

CONCURRENCY = 16
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
TINY_LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)  # (the tiny model's context: 256)


def prompts(marked: dict[int, str] | None = None) -> list[str]:
    marked = marked or {}
    return [f"Story {i}{marked.get(i, '')}: once upon a time" for i in range(CONCURRENCY)]


def start_engine(monkeypatch, spec: str | None = None, **options) -> AsyncEngine:
    """An engine whose core and client both run with `spec` (the client keeps it until
    `reset_faults` runs after the test)."""
    if spec:
        monkeypatch.setenv("GRISTMILL_FAULTS", spec)
    else:
        monkeypatch.delenv("GRISTMILL_FAULTS", raising=False)
    try:
        return AsyncEngine(EngineConfig(**{"device": "cpu", **options}))
    finally:
        monkeypatch.delenv("GRISTMILL_FAULTS", raising=False)


def start_tiny_engine(monkeypatch, spec: str | None = None, **options) -> AsyncEngine:
    """start_engine on the tiny random-weight model."""
    return start_engine(monkeypatch, spec, model=str(tiny_model()), **options)


@pytest.fixture(autouse=True)
def reset_faults():
    yield
    os.environ.pop("GRISTMILL_FAULTS", None)
    faults.load()


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too, only not yet reaped
        return f.read().split()[2] == "Z"


async def run_one(engine, prompt, params=PARAMS):
    """(text, None) or (None, exception); also the time it ended."""
    try:
        text = ""
        async for out in engine.generate(prompt, params):
            text += out.delta_text
        assert text == out.text and out.finished
        return out.text, None, time.monotonic()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return None, exc, time.monotonic()


def error_of(engine, prompt, params=PARAMS):
    [(_, error, _)] = asyncio.run(run_all(engine, [prompt], params))
    return error


async def run_all(engine, texts, params=PARAMS, timeout=120):
    return await asyncio.wait_for(asyncio.gather(*(run_one(engine, p, params) for p in texts)), timeout)


@pytest.fixture(scope="module")
def baseline():
    """Texts of the unmarked prompts from a run without faults."""
    mp = pytest.MonkeyPatch()
    engine = start_engine(mp)
    try:
        results = asyncio.run(run_all(engine, prompts()))
        assert all(error is None for _, error, _ in results)
        yield engine, [text for text, _, _ in results]
    finally:
        engine.shutdown()
        mp.undo()


@pytest.fixture(scope="module")
def tiny_texts():
    """The baseline's texts on the tiny random-weight model."""
    mp = pytest.MonkeyPatch()
    engine = start_tiny_engine(mp)
    try:
        results = asyncio.run(run_all(engine, prompts()))
        assert all(error is None for _, error, _ in results)
        return [text for text, _, _ in results]
    finally:
        engine.shutdown()
        mp.undo()


def test_concurrent_requests_stream_and_leave_nothing_behind(baseline):
    engine, texts = baseline
    assert all(texts) and len(set(texts)) > 1
    stats = asyncio.run(engine.stats())
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_live_requests"] == stats["num_running"] == stats["num_waiting"] == 0


def test_per_request_faults_end_only_their_request(monkeypatch, tiny_texts):
    texts = tiny_texts
    marks = {1: " TKZFAIL", 5: " INITFAIL", 9: " DTKFAIL", 13: " DTKFAIL"}
    engine = start_tiny_engine(monkeypatch, "tokenize@prompt~TKZFAIL,detokenize_init@prompt~INITFAIL,"
                                       "detokenize@prompt~DTKFAIL")
    try:
        results = asyncio.run(run_all(engine, prompts(marks)))
        for i, (text, error, _) in enumerate(results):
            if i in marks:
                assert isinstance(error, GenerationError), (i, error)
                assert "injected fault" in str(error)
                expected = {1: "tokenizing", 5: "detokenizer", 9: "detokenizing", 13: "detokenizing"}[i]
                assert expected in str(error)
            else:
                assert error is None and text == texts[i]
        stats = asyncio.run(engine.stats())
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_live_requests"] == 0 and stats["num_errors"] == 4
        assert not engine.errored
    finally:
        engine.shutdown()


def test_500_failed_requests_leave_stats_at_baseline(monkeypatch):
    engine = start_tiny_engine(monkeypatch, "detokenize@prompt~DTKFAIL")
    try:
        before = asyncio.run(engine.stats())

        async def flood():
            results = []
            for start in range(0, 500, 100):
                results += await run_all(engine, [f"{i} DTKFAIL" for i in range(start, start + 100)],
                                         SamplingParams(max_tokens=4, temperature=0))
            return results

        results = asyncio.run(flood())
        assert all(isinstance(error, GenerationError) for _, error, _ in results)
        after = asyncio.run(engine.stats())
        assert after["num_free_blocks"] == before["num_free_blocks"] == after["num_total_blocks"]
        assert after["num_live_requests"] == before["num_live_requests"] == 0
        assert after["num_errors"] == 500
        [(text, error, _)] = asyncio.run(run_all(engine, ["Story 0: once upon a time"]))
        assert error is None and text
    finally:
        engine.shutdown()


def test_failed_output_batch_ends_its_requests_and_the_engine_goes_on(monkeypatch, tiny_texts):
    texts = tiny_texts
    engine = start_tiny_engine(monkeypatch, "output_batch@step=3")
    try:
        results = asyncio.run(run_all(engine, prompts()))
        failed = [error for _, error, _ in results if error is not None]
        assert failed and all(isinstance(e, GenerationError) for e in failed)
        assert all("processing a batch of engine outputs failed" in str(e) for e in failed)
        assert not engine.errored
        later = asyncio.run(run_all(engine, prompts()))
        assert [text for text, _, _ in later] == texts
        stats = asyncio.run(engine.stats())
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        engine.shutdown()


def test_a_failed_output_batch_keeps_the_outputs_of_requests_it_finished(monkeypatch, baseline):
    # The batch fails at the update of the OBFAIL request, after it has processed the
    # requests before it in the same step: those it finished (max_tokens=1) must still end
    # normally; the one still running fails with the batch.
    engine = start_engine(monkeypatch, "output_batch@prompt~OBFAIL")
    try:
        async def scenario():
            long = asyncio.create_task(run_one(engine, "A long story.", SamplingParams(max_tokens=60, temperature=0)))
            while (await engine.stats())["num_running"] == 0:
                await asyncio.sleep(0.01)
            # Submitted together while the core is busy: admitted in one step, in this order.
            short = [asyncio.create_task(run_one(engine, f"Story {i}: once", SamplingParams(max_tokens=1, temperature=0)))
                     for i in range(3)]
            marked = asyncio.create_task(run_one(engine, "Story OBFAIL: once", PARAMS))
            return await asyncio.wait_for(asyncio.gather(long, *short, marked), 60)

        (_, long_error, _), *short, (_, marked_error, _) = asyncio.run(scenario())
        for error in (long_error, marked_error):
            assert isinstance(error, GenerationError)
            assert "processing a batch of engine outputs failed" in str(error)
        for text, error, _ in short:
            assert error is None and text
        stats = asyncio.run(engine.stats())
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_live_requests"] == 0
        assert not engine.errored
    finally:
        engine.shutdown()


def test_a_malformed_or_duplicate_wire_message_fails_only_its_request(baseline):
    engine, texts = baseline

    async def scenario():
        dup = engine.add_request("Story dup: once upon a time", LONG, request_id="dup")
        tasks = [asyncio.create_task(run_one(engine, p)) for p in prompts()]
        first = await anext(dup)
        # What a client out of step with its core would send: a second request under a
        # live id, then things the core does not know.
        engine.client.core.send(AddRequest("dup", [2, 3], SamplingParams(max_tokens=4), frozenset()))
        engine.client.core.send(AddRequest("bad", ["not a token"], SamplingParams(max_tokens=4), frozenset()))
        engine.client.core.send({"request_id": "bad"})
        try:
            with pytest.raises(RequestError, match="request id 'dup' was sent while a request with that id"):
                async for _ in dup:
                    pass
        finally:
            await dup.aclose()
        return first, await asyncio.wait_for(asyncio.gather(*tasks), 120)

    first, results = asyncio.run(scenario())
    assert not first.finished
    assert [text for text, _, _ in results] == texts
    assert not engine.errored
    stats = asyncio.run(engine.stats())
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_live_requests"] == 0


async def fail_in_flight(engine, kill=None, params=LONG):
    """Start CONCURRENCY long requests, optionally kill the core once they run; return
    results, the kill time and the time the engine was declared dead."""
    died_at = []
    engine.add_failure_callback(lambda error: died_at.append(time.monotonic()))
    tasks = [asyncio.create_task(run_one(engine, p, params)) for p in prompts()]
    killed_at = None
    if kill is not None:
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        kill()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return results, killed_at, died_at


@pytest.mark.parametrize("spec,says", [
    ("forward@step=4", "injected fault at 'forward'"),
    ("device_error@step=4", "injected fault at 'device_error'"),  # on CPU it raises; tests/cuda faults a GPU
    ("core_exit@step=4", "exited with code 17"),
    ("core_hang@step=4", "hung"),
    ("core_hang@prompt~Story 3:", "hung"),  # fires once that request is scheduled
])
def test_fatal_faults_fail_every_request_fast(monkeypatch, spec, says):
    # Only the hang test shortens the step timeout: elsewhere a slow machine's long step
    # must not pass for a hang.
    engine = start_tiny_engine(monkeypatch, spec, **({"step_timeout_s": 1.0} if "hang" in spec else {}))
    assert_a_fatal_fault_fails_every_request(engine, says)


def assert_a_fatal_fault_fails_every_request(engine, says):
    """Run CONCURRENCY requests into a fault that kills the engine: each ends with
    EngineDeadError within a second of the death, and the core process is gone."""
    pid = engine.core_pid
    try:
        results, _, died_at = asyncio.run(fail_in_flight(engine, params=TINY_LONG))
        assert_all_dead(engine, results, died_at[0], says)
        assert process_gone(pid)
    finally:
        engine.shutdown()


def test_sigkill_of_the_core_fails_every_request_within_a_second_and_restart_replaces_it(
        monkeypatch, baseline):
    engine = start_engine(monkeypatch)
    try:
        old_core = engine.core_pid
        results, killed_at, _ = asyncio.run(fail_in_flight(engine, lambda: os.kill(engine.core_pid, signal.SIGKILL)))
        assert_all_dead(engine, results, killed_at, "killed by signal SIGKILL")
        engine.restart()  # the same engine object, a new core
        assert not engine.errored and engine.num_restarts == 1 and engine.core_pid != old_core
        assert process_gone(old_core)
        again = asyncio.run(run_all(engine, prompts()))
        assert [text for text, _, _ in again] == baseline[1]
        stats = asyncio.run(engine.stats())
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_live_requests"] == 0
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.restart()


def test_an_unread_stream_is_aborted_past_max_buffered_and_the_others_go_on(baseline):
    engine, texts = baseline

    async def scenario():
        unread = engine.add_request("Tell me a long story.", LONG, max_buffered=8)
        results = await run_all(engine, prompts())  # while `unread` piles up outputs
        try:
            with pytest.raises(GenerationError, match="read its stream too slowly: 8 outputs"):
                async for _ in unread:
                    pass
        finally:
            await unread.aclose()
        return results, await engine.stats()

    results, stats = asyncio.run(scenario())
    assert [text for text, _, _ in results] == texts
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == stats["num_live_requests"] == 0


def assert_all_dead(engine, results, dead_since, says):
    for _, error, _ in results:
        assert isinstance(error, EngineDeadError), error
        assert says in str(error)
    assert max(ended for _, _, ended in results) - dead_since < 1.0
    assert engine.errored
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())
    later = error_of(engine, "after death")
    assert isinstance(later, EngineDeadError) and says in str(later)
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.stats())


def test_cancel_and_abort_free_the_request(baseline):
    engine, _ = baseline

    async def scenario():
        stream = engine.generate("Tell me a long story.", LONG, request_id="to-cancel")
        consumer = asyncio.create_task(anext(stream))
        await consumer
        await stream.aclose()  # what a cancelled consumer's `async for` does
        outputs = []

        async def consume():
            async for out in engine.generate("Another long story.", LONG, request_id="to-abort"):
                outputs.append(out)

        task = asyncio.create_task(consume())
        while not outputs:
            await asyncio.sleep(0.01)
        await engine.abort("to-abort")
        await asyncio.wait_for(task, 10)
        assert outputs[-1].finish_reason == "abort" and len(outputs[-1].token_ids) < 400

        task = asyncio.create_task(run_one(engine, "A third long story.", LONG))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            stats = await engine.stats()
            if stats["num_free_blocks"] == stats["num_total_blocks"]:
                break
            await asyncio.sleep(0.05)
        return stats

    stats = asyncio.run(scenario())
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == stats["num_live_requests"] == 0


def test_admission_limits(monkeypatch):
    engine = start_tiny_engine(monkeypatch, num_kv_blocks=8, block_size=16, max_num_seqs=1,
                          max_num_batched_tokens=64, max_waiting_requests=1)
    try:
        too_big = error_of(engine, "hi", SamplingParams(max_tokens=200))
        assert isinstance(too_big, PromptTooLongError)
        assert "more KV cache than the engine has (128 tokens in 8 blocks)" in str(too_big)
        results = asyncio.run(run_all(engine, ["a", "b", "c"], SamplingParams(max_tokens=20)))
        errors = [error for _, error, _ in results]
        assert sum(isinstance(e, EngineOverloadedError) for e in errors) == 1
        assert sum(e is None for e in errors) == 2
        for first_id, second_id, n in (("same", "same", 1), ("x", "x#0", 2)):
            async def duplicate():
                first = engine.generate("x", PARAMS.clone(n=n), request_id=first_id)
                await anext(first)
                try:
                    await anext(engine.generate("y", PARAMS, request_id=second_id))
                finally:
                    await first.aclose()
            with pytest.raises(RequestError, match="already in use"):
                asyncio.run(duplicate())
        assert not engine.errored
    finally:
        engine.shutdown()


def test_shutdown_and_client_death_leave_no_engine_process(monkeypatch, tmp_path):
    engine = start_tiny_engine(monkeypatch)
    pid = engine.core_pid
    engine.shutdown()
    assert process_gone(pid)
    assert engine.errored
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(engine.check_health())

    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys
        from gristmill import AsyncEngine, EngineConfig
        if __name__ == "__main__":
            engine = AsyncEngine(EngineConfig(model=MODEL, device="cpu"))
            print(engine.core_pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """).replace("MODEL", repr(str(tiny_model()))))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    core_pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not process_gone(core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(core_pid)


def test_malformed_fault_spec_fails_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("GRISTMILL_FAULTS", "forward@sometimes")
    with pytest.raises(ValueError, match="bad trigger"):
        AsyncEngine(EngineConfig(device="cpu"))
