"""The engine-core process: `main(argv)`, which its client (core_client.py) runs in a
fresh interpreter (`python -c`) that imports this module by name.

Never started through the user's script, so a script without an
`if __name__ == "__main__":` guard works. Its client passes three file descriptors and
its own pid on the command line: the inbox pipe (one frame of wire.py per message), the
outbox pipe (pickled `messages` structs, one per send) and a shared 8-byte heartbeat
holding the start (time.monotonic) of the step running now, or 0 between steps, so the
client's monitor can tell a hang from a long step.

The first message in is `Start(config)`; the first out is `Ready` or `CoreFailed`. The
process exits by itself when its client goes away (its inbox reaches EOF or its parent
pid changes), and ignores SIGINT: a Ctrl-C reaches its client, which shuts it down.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing.connection import Connection

from gristmill import faults, startup
from gristmill.engine import wire
from gristmill.engine.heartbeat import Heartbeat
from gristmill.engine.messages import (Abort, AddRequest, AddRequests, CoreFailed, Ready, Rejected, Shutdown,
                                       StatsQuery, StatsReply, StepOutputs)
from gristmill.errors import error_string

# Exit code of a core whose engine failed (start-up or a step raised).
EXIT_ENGINE_ERROR = 3
# Exit code of the core_exit fault.
EXIT_INJECTED = 17


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    startup.show_messages_if_asked()
    inbox_fd, outbox_fd, heartbeat_fd, parent_pid = (int(a) for a in argv)
    inbox = Connection(inbox_fd, writable=False)
    outbox = Connection(outbox_fd, readable=False)
    heartbeat = Heartbeat(heartbeat_fd)
    try:
        start = wire.decode(inbox.recv_bytes())
        faults.load()
        if faults.fires("load_killed"):  # as the kernel's OOM killer ends a core loading too large a model
            os.kill(os.getpid(), signal.SIGKILL)
        from gristmill.engine.builder import build_core
        core = build_core(start.config)
        core.process_fault = lambda point: _process_fault(point, heartbeat)
        outbox.send(Ready(core.capacity, getattr(core.executor, "memory_need", None)))
    except BaseException as exc:  # noqa: BLE001 - report, then exit
        _report_and_exit(outbox, f"the engine failed to start: {error_string(exc)}")
    CoreLoop(core, inbox, outbox, heartbeat, parent_pid).run()
    _exit(0)


class CoreLoop:
    """The busy loop: drain the inbox, run a step while requests are unfinished."""

    def __init__(self, core, inbox: Connection, outbox: Connection, heartbeat: Heartbeat, parent_pid: int):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.heartbeat = heartbeat
        self.parent_pid = parent_pid

    def run(self) -> None:
        core = self.core
        while True:
            try:
                if not self._drain_inbox(0.0 if core.has_unfinished else 0.2):
                    return
            except (EOFError, OSError):
                return  # the client is gone
            if os.getppid() != self.parent_pid:
                return
            if core.has_unfinished:
                self._step()

    def _drain_inbox(self, timeout: float) -> bool:
        while self.inbox.poll(timeout):
            frame = self.inbox.recv_bytes()
            try:
                message = wire.decode(frame)
            except wire.Unreadable as exc:  # refused (or, carrying no request, dropped), not fatal
                for request_id in exc.request_ids:
                    self.outbox.send(Rejected(request_id, f"RequestError: the engine core could not read "
                                                          f"the request ({exc.reason}); send plain values "
                                                          f"the core can import (SamplingParams, str, int, "
                                                          f"float, list, dict)"))
                if not exc.request_ids:
                    print(f"gristmill engine core: dropped an unreadable message: {exc.reason}", file=sys.stderr)
                continue
            if not self._handle(message):
                return False
            timeout = 0.0
        return True

    def _handle(self, message) -> bool:
        if isinstance(message, (AddRequest, AddRequests)):
            for request in message.requests if isinstance(message, AddRequests) else [message]:
                error = self.core.add_request(request)
                if error is not None:
                    self.outbox.send(Rejected(getattr(request, "request_id", ""), error_string(error), error.param))
        elif isinstance(message, Abort):
            self.core.abort(message.request_ids)
        elif isinstance(message, StatsQuery):
            self.outbox.send(StatsReply(message.token, self.core.stats()))
        elif isinstance(message, Shutdown):
            return False
        else:
            request_id = getattr(message, "request_id", None)
            if isinstance(request_id, str):
                self.outbox.send(Rejected(request_id, f"RequestError: the engine core got a message it does "
                                                      f"not know ({type(message).__name__})"))
        return True

    def _step(self) -> None:
        step = self.core.num_steps + 1
        if faults.ACTIVE:
            _injected_process_faults(step, self.heartbeat)
        self.heartbeat.beat()
        try:
            updates = self.core.step()
        except Exception as exc:  # noqa: BLE001 - the engine state can no longer be trusted
            _report_and_exit(self.outbox, f"engine step {step} failed: {error_string(exc)}")
        self.heartbeat.rest()
        if updates:
            self.outbox.send(StepOutputs(step, updates))


def _injected_process_faults(step: int, heartbeat: Heartbeat) -> None:
    """The core_exit / core_hang faults triggered by a step number (a request's prompt
    triggers them from EngineCore.step, once it is scheduled)."""
    for point in ("core_exit", "core_hang"):
        if faults.fires(point, step=step):
            _process_fault(point, heartbeat)


def _process_fault(point: str, heartbeat: Heartbeat) -> None:
    if point == "core_exit":
        os._exit(EXIT_INJECTED)
    heartbeat.beat()  # a step is running, and never ends
    while True:
        time.sleep(3600)


def _exit(code: int) -> None:
    """End the process now. Everything it sent is sent (sends are synchronous) and it
    holds nothing that must be flushed but its stdio; the interpreter's normal exit would
    spend 0.8-1.6 s (2 cores) tearing down torch's C++ state and the model, which the OS
    takes back at once anyway, and every engine's shutdown waits for that exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


def _report_and_exit(outbox: Connection, message: str) -> None:
    try:
        outbox.send(CoreFailed(message))
    finally:
        os._exit(EXIT_ENGINE_ERROR)


if __name__ == "__main__":
    main(sys.argv[1:])
