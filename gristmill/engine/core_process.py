"""The engine-core child process and the small typed messages it exchanges.

The child runs the EngineCore busy loop. Between steps it drains its inbox; while a
step runs, `heartbeat` holds the step's start (time.monotonic, shared across
processes) so the client's monitor can tell a hang from a long step. The child exits
by itself when its client goes away (its inbox reaches EOF or its parent pid changes).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from gristmill.config import EngineConfig
from gristmill.engine import faults
from gristmill.engine.request import Request
from gristmill.engine.scheduler import RequestUpdate
from gristmill.errors import error_string

# Exit code of a child whose engine failed (start-up or a step raised).
EXIT_ENGINE_ERROR = 3
# Exit code of the core_exit fault.
EXIT_INJECTED = 17


# -- client -> core ----------------------------------------------------------------

@dataclass(slots=True)
class AddRequests:
    requests: list[Request]


@dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclass(slots=True)
class StatsQuery:
    token: int


@dataclass(slots=True)
class Shutdown:
    pass


# -- core -> client ----------------------------------------------------------------

@dataclass(slots=True)
class Ready:
    max_model_len: int
    num_total_blocks: int
    vocab_size: int


@dataclass(slots=True)
class StepOutputs:
    step: int
    updates: list[RequestUpdate]


@dataclass(slots=True)
class StatsReply:
    token: int
    stats: dict


@dataclass(slots=True)
class CoreFailed:
    """The core cannot go on; `message` is the original error."""
    message: str


def run_engine_core(config: EngineConfig, inbox, outbox, heartbeat, parent_pid: int) -> None:
    """Entry point of the child process."""
    try:
        faults.load()
        from gristmill.engine.core import EngineCore
        from gristmill.model.runner import ModelRunner

        runner = ModelRunner(config)
        core = EngineCore(config, runner)
        outbox.send(Ready(runner.max_model_len, runner.num_blocks, runner.hf_config.vocab_size))
    except BaseException as exc:  # noqa: BLE001 - report, then exit
        _report_and_exit(outbox, f"the engine failed to start: {error_string(exc)}")
    _busy_loop(core, inbox, outbox, heartbeat, parent_pid)


def _busy_loop(core, inbox, outbox, heartbeat, parent_pid: int) -> None:
    while True:
        timeout = 0.0 if core.has_unfinished else 0.2
        try:
            while inbox.poll(timeout):
                if not _handle(core, inbox.recv(), outbox):
                    return
                timeout = 0.0
        except (EOFError, OSError):
            return  # the client is gone
        if os.getppid() != parent_pid:
            return
        if not core.has_unfinished:
            continue
        step = core.num_steps + 1
        if faults.ACTIVE:
            _injected_process_faults(step, heartbeat)
        heartbeat.value = time.monotonic()
        try:
            updates = core.step()
        except Exception as exc:  # noqa: BLE001 - the engine state can no longer be trusted
            _report_and_exit(outbox, f"engine step {step} failed: {error_string(exc)}")
        heartbeat.value = 0.0
        if updates:
            outbox.send(StepOutputs(step, updates))


def _handle(core, message, outbox) -> bool:
    if isinstance(message, AddRequests):
        for request in message.requests:
            core.add_request(request)
    elif isinstance(message, Abort):
        core.abort(message.request_ids)
    elif isinstance(message, StatsQuery):
        outbox.send(StatsReply(message.token, core.stats()))
    elif isinstance(message, Shutdown):
        return False
    return True


def _injected_process_faults(step: int, heartbeat) -> None:
    if faults.fires("core_exit", step=step):
        os._exit(EXIT_INJECTED)
    if faults.fires("core_hang", step=step):
        heartbeat.value = time.monotonic()
        while True:
            time.sleep(3600)


def _report_and_exit(outbox, message: str) -> None:
    try:
        outbox.send(CoreFailed(message))
    finally:
        os._exit(EXIT_ENGINE_ERROR)
