"""The restart policy the batch runtime and the server share: a budget of restarts per
window of time, and the restart itself (a new core for the same AsyncEngine)."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

from gristmill.engine.async_engine import AsyncEngine


class RestartBudget:
    """At most `max_restarts` engine restarts within any `window_s` seconds (None: within
    the budget's whole life, as a batch job's `max_engine_restarts`)."""

    def __init__(self, max_restarts: int, window_s: float | None = None):
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        if window_s is not None and not window_s > 0:
            raise ValueError(f"window_s must be > 0 or None, got {window_s!r}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.used = 0  # restarts taken in all
        self._recent: collections.deque[float] = collections.deque()

    def available(self) -> bool:
        """Whether a restart is left now (spends nothing)."""
        now = time.monotonic()
        while self.window_s is not None and self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        return len(self._recent) < self.max_restarts

    def take(self) -> bool:
        """Spend one restart; False (and nothing spent) when none is left."""
        if not self.available():
            return False
        self._recent.append(time.monotonic())
        self.used += 1
        return True

    def describe(self) -> str:
        within = f" within {self.window_s:g} s" if self.window_s is not None else ""
        return f"{self.max_restarts} restart{'s' if self.max_restarts != 1 else ''}{within}"


async def restart(engine: AsyncEngine) -> float:
    """Give `engine` a new core, waiting for it on a thread of its own (it takes seconds;
    the thread ends with it, so a long-running server's threads do not grow); returns
    the seconds it took. Raises EngineDeadError when the new core fails to start."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    start = time.monotonic()

    def run() -> None:
        try:
            engine.restart()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting task
            _settle(loop, done, exc)
        else:
            _settle(loop, done, None)

    thread = threading.Thread(target=run, name="gristmill-engine-restart", daemon=True)
    thread.start()
    error = await done
    thread.join()
    if error is not None:
        raise error
    return time.monotonic() - start


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None) -> None:
    def settle():
        if not future.done():
            future.set_result(error)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass
