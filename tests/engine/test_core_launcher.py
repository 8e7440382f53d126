"""The core launcher (GRISTMILL_CORE_LAUNCHER=1; the suite turns it on in
tests/conftest.py): later cores are forked from a process that has imported torch, and
behave as cores started directly do: the same outputs, their deaths reported with their
exit code or signal, nothing left behind when their client goes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from gristmill import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from gristmill.engine import core_launcher
from tests.batch.inprocess import tiny_model
from tests.harness import core_children, process_gone, run_script

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _tokens(engine: AsyncEngine, prompt: str = "Once upon a time") -> list[int]:
    async def run():
        async for out in engine.generate(prompt, PARAMS):
            pass
        return out.outputs[0].token_ids
    return asyncio.run(run())


def _engine(**options) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(tiny_model()), device="cpu", quantization=None, **options))


def _launcher_here() -> core_launcher._Launcher | None:
    """The launcher for this process's environment as it is now."""
    launcher = core_launcher._launchers.get(core_launcher._key(os.environ))
    return None if launcher is None or launcher.lost else launcher


@pytest.fixture
def launcher(monkeypatch):
    """A ready launcher (started by a first, direct core if none runs yet)."""
    monkeypatch.setattr(core_launcher, "ENABLED", True)
    if _launcher_here() is None:
        _engine().shutdown()
    launcher = _launcher_here()
    assert launcher is not None and launcher.ready.wait(120), "the core launcher never became ready"
    return launcher


def test_a_launched_core_is_the_launchers_child_and_gives_a_direct_cores_tokens(launcher, monkeypatch):
    engine = _engine()
    try:
        assert _ppid(engine.core_pid) == launcher.process.pid
        assert core_children() == [engine.core_pid]
        launched = _tokens(engine)
    finally:
        engine.shutdown()
    assert process_gone(engine.core_pid) and core_children() == []
    monkeypatch.setattr(core_launcher, "ENABLED", False)
    direct = _engine()
    try:
        assert _ppid(direct.core_pid) == os.getpid()
        assert _tokens(direct) == launched
    finally:
        direct.shutdown()


@pytest.mark.parametrize("how", ["SIGKILL", "core_exit"])
def test_a_launched_cores_death_says_its_signal_or_exit_code(launcher, monkeypatch, how):
    if how == "core_exit":
        monkeypatch.setenv("GRISTMILL_FAULTS", "core_exit@step=2")  # read after the fork
    engine = _engine()
    monkeypatch.delenv("GRISTMILL_FAULTS", raising=False)
    try:
        assert _ppid(engine.core_pid) == launcher.process.pid
        if how == "SIGKILL":
            os.kill(engine.core_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as info:
            _tokens(engine, "x " * 40)
    finally:
        engine.shutdown()
    expected = "was killed by signal SIGKILL" if how == "SIGKILL" else "exited with code 17"
    assert expected in str(info.value)


def test_a_core_whose_environment_differs_starts_directly(launcher):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model()), device="cpu", quantization=None),
                         core_env={"GRISTMILL_TEST_MARK": "1"})
    try:
        assert _ppid(engine.core_pid) == os.getpid()
        assert _tokens(engine)
    finally:
        engine.shutdown()


def test_a_launcher_killed_loses_its_cores_as_deaths_and_later_cores_start_directly(launcher):
    engine = _engine()
    try:
        os.kill(launcher.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.dead_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.dead_error is not None, "a core whose launcher died was not reported dead"
        assert "restart the engine" in str(engine.dead_error)
    finally:
        engine.shutdown()
    assert process_gone(engine.core_pid) and launcher.lost
    after = _engine()
    try:
        assert _ppid(after.core_pid) == os.getpid()
        assert _tokens(after)
    finally:
        after.shutdown()


def test_a_client_killed_leaves_neither_launcher_nor_cores(tmp_path):
    """A user's script (no main guard) with two engines in turn, the second launched,
    killed with SIGKILL: its launcher and its core exit by themselves."""
    script = f"""
        import os, signal, time
        from gristmill import AsyncEngine, EngineConfig
        from gristmill.engine import core_launcher
        core_launcher.ENABLED = True
        config = EngineConfig(model={str(tiny_model())!r}, device="cpu", quantization=None)
        AsyncEngine(config).shutdown()
        [launcher] = core_launcher._launchers.values()
        assert launcher.ready.wait(120)
        engine = AsyncEngine(config)
        print("PIDS", launcher.process.pid, engine.core_pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    result = run_script(tmp_path, script, timeout=240)
    assert result.returncode == -signal.SIGKILL, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("PIDS")]
    pids = [int(p) for p in line.split()[1:]]
    deadline = time.monotonic() + 10
    while not all(process_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(process_gone(pid) for pid in pids), f"left running: {[p for p in pids if not process_gone(p)]}"
