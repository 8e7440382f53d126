"""Running the app under uvicorn with a graceful drain.

The first SIGTERM (or SIGINT) starts the drain: new /v1 requests get 503 with
`Connection: close` and `/health` says `draining`, while the requests in flight go on
for up to `shutdown_grace_s`; what is left then ends with EngineDeadError (503, or an
SSE error event then `[DONE]`), and the server exits. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn

from gristmill.errors import EngineDeadError

logger = logging.getLogger("gristmill.serve")

# Longest wait, after the grace ran out and the rest was aborted, for their error
# responses to go out.
_ABORTED_FLUSH_S = 5.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for `DrainingServer.run(sockets=[...])`, taken
    before the engine loads so that a port in use fails at once, not after the model
    loaded. Bound as uvicorn binds one: IPv6 for a host with a ':', SO_REUSEADDR."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_grace_s: float = 30.0):
        super().__init__(config)
        self.app = config.app
        self.shutdown_grace_s = shutdown_grace_s
        self.drain_started = False
        self.forced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets and self.started:  # (uvicorn says where it listens only on a socket of its own)
            host, port = sockets[0].getsockname()[:2]
            logger.info("serving on http://%s:%d (Ctrl-C or SIGTERM to stop)",
                        f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler (SIGINT, SIGTERM), on the main thread."""
        if self.drain_started:
            if sig == signal.SIGINT:  # the second Ctrl-C: now
                logger.warning("second SIGINT: exiting without waiting for requests in flight")
                self.forced = self.force_exit = self.should_exit = True
            return
        self.drain_started = True
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        self._drain = self._loop.create_task(self.drain(signal_name))

    async def drain(self, reason: str = "shutdown") -> None:
        state = self.app.state
        state.supervisor.draining = True
        logger.info("%s: draining %d request(s) in flight for up to %g s", reason, state.traffic.active,
                    self.shutdown_grace_s)
        try:
            if not await state.traffic.wait_idle(self.shutdown_grace_s):
                logger.warning("the shutdown grace (%g s) ran out with %d request(s) in flight; aborting them",
                               self.shutdown_grace_s, state.traffic.active)
                state.engine.abort_all(EngineDeadError(
                    f"the server shut down before this request finished (its shutdown grace of "
                    f"{self.shutdown_grace_s:g} s ran out); send the request again"))
                await state.traffic.wait_idle(_ABORTED_FLUSH_S)
        finally:
            self.should_exit = True
