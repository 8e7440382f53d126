"""Keeps the server's engine alive: a dead or hung core is replaced by a new one inside
the running server (same port, metrics and clients), within a restart budget.

On a death the engine has already failed every in-flight request with EngineDeadError
(503, or an SSE error event then `[DONE]`); the supervisor then starts a new core in a
worker thread while new requests get 503 with `Retry-After` and `/health` says
`restarting`. Past the budget (`--max-engine-restarts` within `--restart-window-s`) the
server stays dead, or `on_give_up` ends it (`--exit-on-engine-death`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from gristmill.engine import restarts
from gristmill.engine.async_engine import AsyncEngine
from gristmill.engine.restarts import RestartBudget
from gristmill.errors import EngineDeadError
from gristmill.server.metrics import ServerMetrics

logger = logging.getLogger("gristmill.serve")

OK, RESTARTING, DEAD, DRAINING = "ok", "restarting", "dead", "draining"


class EngineSupervisor:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, max_restarts: int = 3,
                 window_s: float = 600.0, start_seconds: float = 5.0,
                 on_give_up: Callable[[EngineDeadError], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.budget = RestartBudget(max_restarts, window_s)
        self.on_give_up = on_give_up
        #: How long the last start took: what a client is told to wait (Retry-After).
        self.start_seconds = start_seconds
        self.draining = False
        self._restarting = False
        self._gave_up: EngineDeadError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        engine.add_failure_callback(self._on_death)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The server's event loop, where restarts run (call it at startup)."""
        self._loop = loop
        if self.engine.errored:  # died before the server was up
            loop.call_soon(self._begin, self.engine.dead_error)

    # -- what clients see ---------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._status()[0]

    def _status(self) -> tuple[str, EngineDeadError | None]:
        """(state, the error behind it), read once: a restart's thread may bring the
        engine back between two reads."""
        if self.draining:
            return DRAINING, None
        if self._gave_up is not None:
            return DEAD, self._gave_up
        error = self.engine.dead_error
        if error is None:
            return OK, None
        return (RESTARTING if self._will_restart() else DEAD), error

    def health(self) -> tuple[int, dict]:
        state, error = self._status()
        if state == OK:
            return 200, {"status": OK}
        body = {"status": state}
        if error is not None:
            body["reason"] = error.message
        if state == RESTARTING:
            body["restarts"] = self.budget.used
        return 503, body

    def unavailable(self) -> EngineDeadError | None:
        """The error a new request gets now, or None when the engine takes requests."""
        state, error = self._status()
        if state == OK:
            return None
        if state == DRAINING:
            return EngineDeadError("the server is shutting down and takes no new requests; send the "
                                   "request to another server", retry_after_s=self.retry_after_s)
        if state == RESTARTING:
            return EngineDeadError(f"the engine is restarting after it died ({error.message}); retry in a few "
                                   f"seconds", retry_after_s=self.retry_after_s)
        return EngineDeadError(error.message)

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.start_seconds))

    def retry_after(self, exc: BaseException) -> int | None:
        """Seconds a client should wait before retrying a request that failed with `exc`
        (an in-flight request of a dead engine that is being restarted), else None."""
        if isinstance(exc, EngineDeadError) and self.state in (RESTARTING, DRAINING):
            return self.retry_after_s
        return None

    # -- deaths and restarts ------------------------------------------------------------

    def _will_restart(self) -> bool:
        return self._restarting or (self._loop is not None and not self.draining
                                    and self.budget.available())

    def _on_death(self, error: EngineDeadError) -> None:
        """On the engine's monitor thread."""
        self.metrics.engine_dead.set(1)
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._begin, error)
            except RuntimeError:  # the server's loop is closed: it is exiting anyway
                pass

    def _begin(self, error: EngineDeadError) -> None:
        if self._restarting or self._gave_up is not None or not self.engine.errored:
            return
        if self.draining:
            self._give_up(error, "the server is shutting down")
            return
        if not self.budget.take():
            self._give_up(error, f"the restart budget ({self.budget.describe()}) is spent")
            return
        self._restarting = True
        self._task = asyncio.get_running_loop().create_task(self._restart(error))

    async def _restart(self, error: EngineDeadError) -> None:
        logger.error("engine died (%s); restarting it (restart %d, budget %s)", error.message,
                     self.budget.used, self.budget.describe())
        started = time.monotonic()
        try:
            while True:
                try:
                    seconds = await restarts.restart(self.engine)
                except EngineDeadError as exc:  # the new core failed to start
                    logger.error("restarting the engine failed: %s", exc.message)
                    if self.draining or not self.budget.take():
                        self._give_up(exc, "restarting it failed and the restart budget "
                                           f"({self.budget.describe()}) is spent")
                        return
                    continue
                self.start_seconds = seconds
                self.metrics.engine_restarts.inc()
                self.metrics.engine_dead.set(0)
                logger.info("engine restarted in %.1f s", seconds)
                return
        except Exception as exc:  # noqa: BLE001 - anything else: the server cannot go on
            logger.exception("restarting the engine failed")
            self._give_up(EngineDeadError(f"restarting the engine failed: {type(exc).__name__}: {exc}"),
                          "restarting it raised")
        finally:
            self.metrics.engine_restart_seconds.inc(time.monotonic() - started)
            self._restarting = False
            self._task = None

    def _give_up(self, error: EngineDeadError, why: str) -> None:
        message = f"{error.message} (not restarted: {why})"
        self._gave_up = EngineDeadError(message)
        self.metrics.engine_dead.set(1)
        logger.error("engine dead for good: %s", message)
        if self.on_give_up is not None:
            self.on_give_up(self._gave_up)

    async def stop(self) -> None:
        """Wait for a restart in progress to end (shutdown)."""
        task = self._task
        if task is not None:
            try:
                await task
            except Exception:  # noqa: BLE001 - logged in _restart
                pass
