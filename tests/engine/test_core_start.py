"""Starting the engine core as a user would: from scripts with no main guard, and
failing at once when the core dies before it is ready (a corrupt model, SIGKILL), for
`AsyncEngine` and for `LLM(core_process=True)` (what `gristmill generate` runs)."""

from __future__ import annotations

import gc
import os
import select
import signal
import threading
import time

import pytest

from gristmill import LLM, AsyncEngine, EngineConfig, EngineDeadError, RequestError, SamplingParams
from gristmill.engine import core_launcher
from gristmill.engine.core_process import EXIT_ENGINE_ERROR
from tests.batch.inprocess import tiny_model
from tests.harness import process_gone, run_script, wait_for_core_child
from tests.server.conftest import free_port

# Each script runs on the tiny random-weight model (MODEL): how its engine core starts
# from a main module without a guard is the point, not which model it loads.
UNGUARDED_SCRIPTS = {
    "async_engine": """
        import asyncio
        from gristmill import AsyncEngine, EngineConfig, SamplingParams

        engine = AsyncEngine(EngineConfig(model=MODEL, device="cpu"))

        async def main():
            async for out in engine.generate("The capital of France is",
                                             SamplingParams(max_tokens=8, temperature=0)):
                pass
            return out.text

        print("TEXT:", repr(asyncio.run(main())))
        engine.shutdown()
    """,
    "llm": """
        from gristmill import LLM, SamplingParams

        llm = LLM(model=MODEL, device="cpu")
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
        print("TEXT:", repr(out.text))
    """,
    "batch": """
        from gristmill import EngineConfig
        from gristmill.batch import EngineProcessorConfig, build_processor

        processor = build_processor(EngineProcessorConfig(engine=EngineConfig(model=MODEL, device="cpu")))
        [row] = processor([{"prompt": "The capital of France is",
                            "sampling_params": {"max_tokens": 8, "temperature": 0}}])
        print("TEXT:", repr(row["generated_text"]))
    """,
    "server": """
        import threading, time
        import openai, uvicorn
        from gristmill import AsyncEngine, EngineConfig
        from gristmill.server.app import build_app

        engine = AsyncEngine(EngineConfig(model=MODEL, device="cpu"))
        server = uvicorn.Server(uvicorn.Config(build_app(engine, "m"), host="127.0.0.1", port=PORT,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        client = openai.OpenAI(base_url="http://127.0.0.1:PORT/v1", api_key="none")
        out = client.completions.create(model="m", prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
        print("TEXT:", repr(out.choices[0].text))
        server.should_exit = True
        thread.join()
        engine.shutdown()
    """,
}


@pytest.fixture(autouse=True)
def direct_cores(monkeypatch):
    """Cores started as users' processes start them (the suite's launcher off)."""
    monkeypatch.setattr(core_launcher, "ENABLED", False)


@pytest.mark.parametrize("kind", sorted(UNGUARDED_SCRIPTS))
def test_a_script_without_a_main_guard_generates(tmp_path, kind):
    source = UNGUARDED_SCRIPTS[kind].replace("PORT", str(free_port())).replace("MODEL", repr(str(tiny_model())))
    result = run_script(tmp_path, source, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("TEXT:")]
    assert len(line) > len("TEXT: ''"), line
    assert "bootstrapping" not in result.stderr


def _start_llm(config: EngineConfig) -> None:
    """An LLM with its core in a child process, then dropped (its core killed)."""
    LLM(core_process=True, **{f: getattr(config, f) for f in ("model", "device", "cache_dir")})


class _Start:
    """AsyncEngine(...) (or `start(config)`) on a thread, so the test can watch (and kill)
    the core it starts."""

    def __init__(self, config: EngineConfig, start=lambda config: AsyncEngine(config).shutdown()):
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(config, start))
        self.thread.start()

    def _run(self, config, start):
        try:
            start(config)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc
        self.ended_at = time.monotonic()

    def join(self) -> BaseException | None:
        self.thread.join(60)
        assert not self.thread.is_alive(), "AsyncEngine(...) did not return"
        return self.error


def wait_exit(pid: int) -> float:
    """Block until `pid` exits; return when (time.monotonic)."""
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], 60)[0], f"core {pid} did not exit"
        return time.monotonic()
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def corrupt_model(tmp_path_factory):
    """A tiny model (converted from a random-weight GGUF) with its weights file cut in half:
    what is corrupt is the point, not which model (a small one keeps each start short)."""
    from gristmill.model.loader import resolve_model
    from tests.harness import transformers_dir
    from tests.model.test_loader import write_tiny_gguf

    root = tmp_path_factory.mktemp("corrupt-model")
    source = transformers_dir(resolve_model(str(write_tiny_gguf(root / "tiny.gguf", "gemma3", "llama")),
                                            str(root / "cache")))
    target = root / "model"
    target.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (target / path.name).symlink_to(path)
    data = (source / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[:len(data) // 2])
    return target


@pytest.mark.parametrize("face", ["async_engine", "llm_core_process"])
def test_a_corrupt_model_fails_at_once_every_time(corrupt_model, face):
    for attempt in range(4 if face == "async_engine" else 2):  # every start fails at once, not only the first
        start = _Start(EngineConfig(model=str(corrupt_model), device="cpu",
                                    cache_dir=str(corrupt_model.parent / "cache")),
                       *([_start_llm] if face == "llm_core_process" else []))
        pid = wait_for_core_child()
        exited_at = wait_exit(pid)
        error = start.join()
        assert isinstance(error, EngineDeadError), (attempt, error)
        message = str(error)
        assert f"exited with code {EXIT_ENGINE_ERROR}" in message, message
        assert "the engine failed to start: ValueError" in message and "truncated" in message, message
        assert start.ended_at - exited_at < 1.0, (attempt, start.ended_at - exited_at)
        assert process_gone(pid)


def test_sigkill_during_start_up_fails_at_once():
    start = _Start(EngineConfig(device="cpu"))
    pid = wait_for_core_child()
    time.sleep(1.0)  # importing torch and loading the model take longer than this
    assert not process_gone(pid) and start.ended_at is None
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    error = start.join()
    assert isinstance(error, EngineDeadError), error
    assert "killed by signal SIGKILL" in str(error)
    assert start.ended_at - killed_at < 1.0


def test_an_llm_with_its_core_in_a_child_process_generates_what_one_in_process_does():
    """`LLM(core_process=True)`: the same greedy text as the core in this process, from a
    core that runs in another process (which a dropped LLM leaves behind none of)."""
    prompts = ["The capital of France is", "1, 2, 3,"]
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [out.outputs[0].text for out in LLM(str(tiny_model()), device="cpu").generate(prompts, params)]
    llm = LLM(str(tiny_model()), device="cpu", core_process=True)
    pid = llm.client.core.pid
    assert pid != os.getpid() and not process_gone(pid)
    assert [out.outputs[0].text for out in llm.generate(prompts, params)] == expected
    assert [out.outputs[0].text for out in llm.generate(prompts, params)] == expected  # a second call too
    with pytest.raises(RequestError, match="child process"):
        llm.core
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_gone(pid)
