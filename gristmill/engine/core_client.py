"""CoreClient: starts the engine-core process, talks to it and watches it.

The core is started as its own module (`python -c "...core_process.main..."`), never
through the user's script. Three threads, one job each:

- the writer sends queued messages to the core, in order, so no caller (least of all an
  event loop) ever blocks on a full pipe;
- the reader receives the core's messages and hands them to `on_message`;
- the monitor waits on the process itself (a pidfd where the OS has one) and reads the
  step heartbeat: a core that exits for any reason (crash, os._exit, SIGKILL, the OOM
  killer) or hangs in a step past `step_timeout_s` is reported to `on_death` at once.

Every wait is a blocking wait with a timeout; nothing polls in a busy loop.

`SteppedChildCore` wraps one for a synchronous caller (`LLM(core_process=True)`): the
core's messages, and its death, wait in a queue for the caller's next step.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path

from gristmill.config import EngineConfig
from gristmill.engine import core_launcher, wire
from gristmill.engine.heartbeat import Heartbeat
from gristmill.engine.messages import (Abort, AddRequest, AddRequests, CoreFailed, Ready, Rejected, Shutdown,
                                       Start, StepOutputs, request_ids_of)
from gristmill.errors import EngineDeadError, error_string
from gristmill.model import memory  # (torch-free: the figures of a core killed for memory)

logger = logging.getLogger(__name__)

# How often the monitor reads the heartbeat while the core is alive.
_WATCH_INTERVAL_S = 0.05
# The child's whole program: import the core module by name and run it. The package
# root goes first on sys.path, so the core runs the very gristmill its client imported
# (not another copy in its working directory) wherever the client could import it.
_CORE_PROGRAM = ("import sys; sys.path.insert(0, {root!r}); "
                 "from gristmill.engine.core_process import main; main(sys.argv[1:])")
CORE_MODULE = "gristmill.engine.core_process"
# The directory holding the gristmill package this module belongs to.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class CoreClient:
    def __init__(self, config: EngineConfig, on_message: Callable, on_death: Callable[[EngineDeadError], None],
                 env: Mapping[str, str] | None = None):
        """`env`: environment variables for the core process, over this process's."""
        self.config = config
        self._env = env
        self._on_message = on_message
        self._on_death = on_death
        self._stopping = False
        self._failure_message: str | None = None
        self.dead_error: EngineDeadError | None = None
        self._oom_kills_at_start = memory.oom_kills()
        self.heartbeat = Heartbeat.create()
        inbox_read, inbox_write = os.pipe()
        outbox_read, outbox_write = os.pipe()
        fds = (inbox_read, outbox_write, self.heartbeat.fd)
        try:
            self.process = core_launcher.launch(fds, env) or _start_directly(fds, env)
        finally:
            os.close(inbox_read)
            os.close(outbox_write)
        self._inbox = Connection(inbox_write, readable=False)
        self._outbox = Connection(outbox_read, writable=False)
        self._exit_fd = _pidfd(self.process.pid)
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._outgoing.put(Start(config))
        self._writer = _thread(self._write, "gristmill-core-writer")
        self._reader: threading.Thread | None = None
        self._monitor: threading.Thread | None = None
        #: The core's Ready (its capacity and memory figures) once it came.
        self._ready: Ready | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    # -- starting ---------------------------------------------------------------------

    def wait_ready(self) -> Ready:
        """Block until the core is ready. Raises EngineDeadError at once if it exits first
        (with its exit code or signal and its own error), or after start_timeout_s."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if self._exit_fd is not None:
                ready = wait([self._outbox, self._exit_fd], timeout=remaining)
            else:
                ready = wait([self._outbox], timeout=min(remaining, 0.5))
            if self._outbox in ready:
                message = self._recv()
                if isinstance(message, Ready):
                    core_launcher.prepare(self._env)
                    self._ready = message
                    return message
                if message is not None:
                    continue  # CoreFailed was recorded: the exit follows
            elif not ready and self.process.poll() is None:
                continue
            self._reap()  # the pipe closed or the process exited
            # `core_error`: the core's own report of why it failed (None: it said nothing).
            raise EngineDeadError(self._death_reason(), core_error=self._failure_message)
        self.kill()
        raise EngineDeadError(f"the engine core did not become ready within start_timeout_s="
                              f"{self.config.start_timeout_s}s; raise start_timeout_s for large models")

    def start(self) -> None:
        """Start delivering the core's messages and watching it (after wait_ready)."""
        self._reader = _thread(self._read, "gristmill-core-reader")
        self._monitor = _thread(self._watch, "gristmill-core-monitor")

    # -- the writer thread ------------------------------------------------------------

    def send(self, message) -> None:
        """Queue a message for the core (never blocks); raises EngineDeadError once dead."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error.message)
        self._outgoing.put(message)

    def add(self, requests: list[AddRequest]) -> list[Rejected]:
        """Send a request's completions, in one message (the core's refusal of any comes
        back later, as a `Rejected`)."""
        self.send(requests[0] if len(requests) == 1 else AddRequests(requests))
        return []

    def abort(self, request_ids: list[str]) -> None:
        """Free these requests in the core; a dead core has nothing left to free."""
        if request_ids and self.dead_error is None:
            try:
                self.send(Abort(request_ids))
            except EngineDeadError:  # it died since
                pass

    def _write(self) -> None:
        while (message := self._outgoing.get()) is not None:
            try:
                frame = wire.encode(message)
            except Exception as exc:  # noqa: BLE001 - it cannot be sent: only its own request ends
                self._unsendable(message, exc)
                continue
            try:
                self._inbox.send_bytes(frame)
            except (OSError, ValueError):
                return  # the core is gone; the monitor reports it

    def _unsendable(self, message, exc: Exception) -> None:
        request_ids = request_ids_of(message)
        if not request_ids:
            logger.error("a message for the engine core could not be pickled: %s", error_string(exc))
        for request_id in request_ids:
            self._on_message(Rejected(request_id, f"RequestError: the request could not be sent to the engine "
                                                  f"core ({error_string(exc)}); send plain values the core can "
                                                  f"unpickle (SamplingParams, str, int, float, list, dict)"))

    # -- the reader thread ------------------------------------------------------------

    def _read(self) -> None:
        while True:
            message = self._recv()
            if message is None:
                return
            if isinstance(message, CoreFailed):
                continue
            try:
                self._on_message(message)
            except Exception:  # noqa: BLE001 - the reader must survive a handler bug
                logger.exception("handling an engine-core message failed")

    def _recv(self):
        """The core's next message (recording a CoreFailed), or None once the pipe closed."""
        try:
            message = self._outbox.recv()
        except (EOFError, OSError):
            return None
        if isinstance(message, CoreFailed):
            self._failure_message = message.message
        return message

    # -- the monitor thread -----------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping:
            if self._exited(_WATCH_INTERVAL_S):
                # Let the reader deliver what the core sent before it went (its last
                # outputs, its own error message) before anyone hears of the death.
                self._reader.join(timeout=1.0)
                self._reap()
                if not self._stopping:
                    self._die(self._death_reason())
                return
            started = self.heartbeat.step_started
            if started and time.monotonic() - started > self.config.step_timeout_s:
                self.kill()
                self._die(f"the engine core hung: a step ran longer than step_timeout_s="
                          f"{self.config.step_timeout_s}s; it was killed (pid {self.process.pid})")
                return

    def _exited(self, timeout: float) -> bool:
        if self._exit_fd is not None:
            return bool(wait([self._exit_fd], timeout=timeout))
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _reap(self) -> None:
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it closed its pipe but lingers
            self.kill()

    def _death_reason(self) -> str:
        code = self.process.returncode
        if code is None:
            how = "stopped responding"
        elif code == -signal.SIGKILL:
            how = f"was killed by signal SIGKILL: {self._killed_for_memory()}"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        reason = f"the engine core process (pid {self.process.pid}) {how}"
        if self._failure_message:
            reason += f": {self._failure_message}"
            if self._ready is None:  # it failed to start: its message says why; a restart would fail again
                return reason
        return reason + "; restart the engine"

    def _killed_for_memory(self) -> str:
        """Why a core gets SIGKILL unasked: the kernel's OOM killer (certain where the
        container counts its kills), with the figures of what the engine needs."""
        kills = memory.oom_kills()
        said = ("it ran out of memory (the kernel's OOM killer ended it)"
                if kills is not None and self._oom_kills_at_start is not None and kills > self._oom_kills_at_start
                else "most likely it ran out of memory (the kernel's OOM killer sends SIGKILL)")
        need = self._memory_need()
        return said if need is None else f"{said}; {need.figures()}; {need.advice()}"

    def _memory_need(self) -> memory.MemoryNeed | None:
        """The engine's memory figures: a core that got as far as Ready sent its own (as
        its load checked them: reading a model's header again here took 0.7-1.5 s, and a
        death is reported within one); one that died starting has them worked out here."""
        if self._ready is not None:
            return self._ready.memory_need
        from gristmill.engine.builder import resolve_model_dir

        try:
            return memory.memory_need_of(self.config, resolve_model_dir(self.config))
        except Exception:  # noqa: BLE001 - the figures help the message; they never replace it
            return None

    def _die(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(reason)
        logger.error("%s", reason)
        self._on_death(self.dead_error)

    # -- ending -----------------------------------------------------------------------

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def abandon(self) -> None:
        """Stop the core at once, waiting for nothing: its owner is gone (a finalizer, run
        in whatever thread collected the owner, must not block it)."""
        self._stopping = True
        if self.process.poll() is None:
            self.process.kill()
        self._outgoing.put(None)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core (Shutdown, then SIGKILL after `timeout`) and every thread."""
        self._stopping = True
        if self.process.poll() is None:
            self._outgoing.put(Shutdown())
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._outgoing.put(None)
        current = threading.current_thread()
        for thread in (self._writer, self._reader, self._monitor):
            if thread is not None and thread is not current:
                thread.join(timeout=1.0)
        for conn in (self._inbox, self._outbox):
            conn.close()
        if self._monitor is None or not self._monitor.is_alive():
            if self._exit_fd is not None:
                os.close(self._exit_fd)
                self._exit_fd = None
            self.heartbeat.close()


class SteppedChildCore:
    """A core in a child process (`CoreClient`) stepped by its client's caller: `step`
    waits for the core's next message (a step's outputs, a refusal, or its death), so a
    synchronous face runs it as it runs an `InprocCore`."""

    def __init__(self, config: EngineConfig, env: Mapping[str, str] | None = None):
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self.process = CoreClient(config, self._messages.put, self._messages.put, env)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.process.dead_error

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def has_unfinished(self) -> bool:
        return True  # the core has whatever its client still tracks; `step` says when it died

    def wait_ready(self):
        return self.process.wait_ready()

    def start(self) -> None:
        self.process.start()

    def add(self, requests: list[AddRequest]) -> list[Rejected]:
        return self.process.add(requests)

    def abort(self, child_ids: list[str]) -> None:
        self.process.abort(child_ids)

    def step(self) -> StepOutputs | Rejected:
        """The core's next message; raises EngineDeadError once it died."""
        message = self._messages.get()
        if isinstance(message, EngineDeadError):
            self._messages.put(message)  # (every later step raises it too)
            raise EngineDeadError(message.message)
        return message

    def abandon(self) -> None:
        self.process.abandon()

    def shutdown(self) -> None:
        self.process.shutdown()


def _start_directly(fds: tuple[int, int, int], env: Mapping[str, str] | None) -> subprocess.Popen:
    """The core as a fresh interpreter, handed the pipes' ends and the heartbeat `fds`."""
    return subprocess.Popen([sys.executable, "-c", _CORE_PROGRAM.format(root=str(_PACKAGE_ROOT)),
                             *map(str, fds), str(os.getpid())],
                            pass_fds=fds, stdin=subprocess.DEVNULL, stdout=core_launcher.stderr_fd(),
                            env={**os.environ, **env} if env else None)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _thread(target: Callable, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
