"""The batch runtime: one event loop on a daemon thread, shared by every processor and
deployment in this process.

Engines, deployments and the rows in flight all live on this loop, so a deployment is
shared by processors without locks, and chained processors (`p2(p1(rows))`) run at once.
Callers on other threads hand it coroutines with `submit` / `call`; nothing that blocks
(reading a user's rows, user functions) runs on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            ready = threading.Event()
            new_loop = asyncio.new_event_loop()

            def run():
                asyncio.set_event_loop(new_loop)
                new_loop.call_soon(ready.set)
                new_loop.run_forever()

            threading.Thread(target=run, name="gristmill-batch-loop", daemon=True).start()
            ready.wait()
            _loop = new_loop
        return _loop


def submit(coro) -> concurrent.futures.Future:
    """Run `coro` on the runtime loop; returns a future this thread can wait on."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def call(coro, timeout: float | None = None):
    """Run `coro` on the runtime loop and wait for its result (never from the loop itself)."""
    if on_loop():
        coro.close()
        raise RuntimeError("gristmill.batch.runtime.call() was called on the runtime loop, where it "
                           "would wait for itself; await the coroutine instead")
    return submit(coro).result(timeout)


def on_loop() -> bool:
    try:
        return asyncio.get_running_loop() is _loop
    except RuntimeError:
        return False
