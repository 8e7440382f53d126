"""CoreClient: starts the engine-core process and watches it.

One monitor thread waits on the core's output pipe and its process sentinel together,
so a core that exits for any reason (crash, os._exit, SIGKILL, the OOM killer) is seen
at once, and polls the step heartbeat so a hung step is seen within step_timeout_s.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from gristmill.config import EngineConfig
from gristmill.engine.core_process import CoreFailed, Ready, Shutdown, run_engine_core
from gristmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class CoreClient:
    def __init__(self, config: EngineConfig, on_message: Callable, on_death: Callable[[EngineDeadError], None]):
        self.config = config
        self._on_message = on_message
        self._on_death = on_death
        ctx = mp.get_context("spawn")
        inbox_reader, self._inbox = ctx.Pipe(duplex=False)
        self._outbox, outbox_writer = ctx.Pipe(duplex=False)
        self.heartbeat = ctx.RawValue("d", 0.0)
        self.process = ctx.Process(target=run_engine_core, name="gristmill-engine-core", daemon=True,
                                   args=(config, inbox_reader, outbox_writer, self.heartbeat, os.getpid()))
        self.process.start()
        inbox_reader.close()
        outbox_writer.close()
        # Every message to the core goes through one writer thread, in order, so that no
        # caller (least of all the monitor, the only reader of the core's output) ever
        # blocks on a full pipe.
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="gristmill-core-writer", daemon=True)
        self._writer.start()
        self._stopping = False
        self._failure_message: str | None = None
        self.dead_error: EngineDeadError | None = None
        self._monitor: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self) -> Ready:
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            ready = wait([self._outbox, self.process.sentinel], timeout=_POLL_S)
            if self._outbox in ready:
                try:
                    message = self._outbox.recv()
                except EOFError:
                    continue
                if isinstance(message, Ready):
                    return message
                if isinstance(message, CoreFailed):
                    self._failure_message = message.message
            elif self.process.sentinel in ready:
                self.process.join()
                raise EngineDeadError(self._death_reason())
        self.kill()
        raise EngineDeadError(f"the engine core did not become ready within start_timeout_s="
                              f"{self.config.start_timeout_s}s; raise start_timeout_s for large models")

    def start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="gristmill-core-monitor", daemon=True)
        self._monitor.start()

    def send(self, message) -> None:
        """Queue a message for the core (never blocks); raises EngineDeadError once dead."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error.message)
        self._outgoing.put(message)

    def _write(self) -> None:
        while True:
            message = self._outgoing.get()
            if message is None:
                return
            try:
                self._inbox.send(message)
            except (OSError, ValueError):
                return  # the core is gone; the monitor reports it

    # -- the monitor thread -------------------------------------------------------------

    def _watch(self) -> None:
        sentinel = self.process.sentinel
        while not self._stopping:
            ready = wait([self._outbox, sentinel], timeout=_POLL_S)
            if self._outbox in ready:
                if not self._receive():
                    ready = [sentinel]  # the pipe closed: the process is going
            if sentinel in ready or not self.process.is_alive():
                self._drain()
                self.process.join(timeout=1.0)
                if not self._stopping:
                    self._die(self._death_reason())
                return
            started = self.heartbeat.value
            if started and time.monotonic() - started > self.config.step_timeout_s:
                self.kill()
                self._die(f"the engine core hung: a step ran longer than step_timeout_s="
                          f"{self.config.step_timeout_s}s; it was killed (pid {self.process.pid})")
                return

    def _receive(self) -> bool:
        try:
            message = self._outbox.recv()
        except (EOFError, OSError):
            return False
        if isinstance(message, CoreFailed):
            self._failure_message = message.message
        else:
            try:
                self._on_message(message)
            except Exception:  # noqa: BLE001 - the monitor must survive a handler bug
                logger.exception("handling an engine-core message failed")
        return True

    def _drain(self) -> None:
        try:
            while self._outbox.poll(0):
                if not self._receive():
                    break
        except (EOFError, OSError):
            pass

    def _death_reason(self) -> str:
        code = self.process.exitcode
        if code is None:
            how = "stopped responding"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        reason = f"the engine core process (pid {self.process.pid}) {how}"
        if self._failure_message:
            reason += f": {self._failure_message}"
        return reason + "; restart the engine"

    def _die(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(reason)
        logger.error("%s", reason)
        self._on_death(self.dead_error)

    # -- ending ----------------------------------------------------------------------

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self.process.is_alive():
            self._outgoing.put(Shutdown())
            self.process.join(timeout=timeout)
        self.kill()
        self._outgoing.put(None)
        self._writer.join(timeout=1.0)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=1.0)
        for conn in (self._inbox, self._outbox):
            conn.close()
