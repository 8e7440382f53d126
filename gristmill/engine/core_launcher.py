"""The core launcher: one process per client process that has imported torch and the
model code once and forks each later engine core from there, so a core starts in a
fraction of a second instead of importing torch again (2-8 s on 2 cores).

Off unless asked for (`GRISTMILL_CORE_LAUNCHER=1`, or `core_launcher.ENABLED = True`):
it pays when one process starts many engines in turn (a notebook, a test suite, a job
that restarts its engine), and is one more process holding torch where it does not.
When on, the first core starts as always (`python -c`, core_client.py); once it is
ready the launcher is started beside it, and every later core whose environment matches
the launcher's (but for the variables read only at run time, `RUNTIME_VARIABLES`) is
forked by it. Anything else, or a launcher that is gone, starts the direct way.

A launched core is the same program (`core_process.main`) with the same pipes; what the
launcher adds:
- the core's parent is the launcher, so the launcher reaps it and sends its exit status
  back (`LaunchedCore` reads like a `subprocess.Popen`);
- the core gets the client's stderr, working directory and environment as they are when
  it is asked for, not as they were when the launcher started;
- the launcher exits when its client does (its socket reaches EOF); a core whose launcher
  is gone exits too (its parent pid changes), and so does one whose client is gone (its
  inbox reaches EOF).
"""

from __future__ import annotations

import os
import pickle
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from gristmill.errors import EngineDeadError

ENABLED = os.environ.get("GRISTMILL_CORE_LAUNCHER") == "1"
# Read by the core only after it starts (faults.load, paths.cache_root, startup): they
# may differ between the launcher and a core it forks.
RUNTIME_VARIABLES = frozenset({"GRISTMILL_FAULTS", "GRISTMILL_CACHE", "GRISTMILL_STARTUP_MESSAGES",
                               "PYTEST_CURRENT_TEST"})
LAUNCHER_MODULE = "gristmill.engine.core_launcher"
_PROGRAM = ("import sys; sys.path.insert(0, {root!r}); "
            "from gristmill.engine.core_launcher import main; main(sys.argv[1:])")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_REPLY_TIMEOUT_S = 10.0
_MAX_MESSAGE = 1 << 20

# Launchers by environment (`_key`): a library may set a variable in this process after
# a launcher started (torch sets TORCHINDUCTOR_CACHE_DIR) while cores of the first still run.
_MAX_LAUNCHERS = 2
_lock = threading.Lock()
_launchers: dict[frozenset, _Launcher] = {}


def launch(fds: tuple[int, int, int], env: Mapping[str, str] | None) -> LaunchedCore | None:
    """Fork a core from the launcher, handing it `fds` (inbox read end, outbox write end,
    heartbeat): None when there is no ready launcher for this environment (start it
    directly). Raises EngineDeadError when the launcher failed to start it."""
    if not ENABLED:
        return None
    full_env = {**os.environ, **env} if env else dict(os.environ)
    with _lock:
        launcher = _launchers.get(_key(full_env))
    if launcher is None or not launcher.ready.is_set() or launcher.lost:
        return None
    try:
        cwd = os.getcwd()
    except OSError:  # (a working directory since deleted: a direct start inherits it as it is)
        return None
    return launcher.launch(fds, full_env, cwd)


def prepare(env: Mapping[str, str] | None) -> None:
    """Start a launcher for this process's environment, if it is enabled and none runs
    for it (called once a core started the direct way is ready). A core with variables of
    its own (`env`) starts none. Of launchers for environments since changed, those with
    no core running are stopped to make room."""
    if not ENABLED or not hasattr(os, "pidfd_open"):
        return
    full_env = {**os.environ, **env} if env else dict(os.environ)
    key = _key(full_env)
    if key != _key(os.environ):
        return
    with _lock:
        for other, launcher in list(_launchers.items()):
            if launcher.lost or (other != key and not launcher.has_cores and len(_launchers) >= _MAX_LAUNCHERS):
                launcher.close()
                del _launchers[other]
        if key not in _launchers and len(_launchers) < _MAX_LAUNCHERS:
            _launchers[key] = _Launcher(full_env)


def _key(env: Mapping[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if k not in RUNTIME_VARIABLES)


class LaunchedCore:
    """A core the launcher forked, as much of `subprocess.Popen` as CoreClient uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        if not self._exited.is_set():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _ended(self, returncode: int | None) -> None:
        self.returncode = returncode
        self._exited.set()


class _Launcher:
    """The client's side: the launcher process, its socket, and a reader thread that
    hands replies to `launch` and exit statuses to their `LaunchedCore`."""

    def __init__(self, env: dict[str, str]):
        self.key = _key(env)
        self.ready = threading.Event()
        self.lost = False
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._cores: dict[int, LaunchedCore] = {}
        self._send_lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _PROGRAM.format(root=str(_PACKAGE_ROOT)), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=stderr_fd(), env=env)
        finally:
            theirs.close()
        self._socket = ours
        threading.Thread(target=self._read, name="gristmill-core-launcher", daemon=True).start()

    def launch(self, fds: tuple[int, int, int], env: dict[str, str], cwd: str) -> LaunchedCore:
        request = pickle.dumps(("start", env, cwd))
        err = stderr_fd()
        devnull = None if isinstance(err, int) else os.open(os.devnull, os.O_WRONLY)
        with self._send_lock:
            try:
                socket.send_fds(self._socket, [request], [*fds, err if devnull is None else devnull])
                reply = self._replies.get(timeout=_REPLY_TIMEOUT_S)
            except (OSError, queue.Empty) as exc:
                self._lose()
                raise EngineDeadError(f"the core launcher (pid {self.process.pid}) did not start the engine "
                                      f"core: {exc or 'no answer'}; unset GRISTMILL_CORE_LAUNCHER") from None
            finally:
                if devnull is not None:
                    os.close(devnull)
        if isinstance(reply, str):
            raise EngineDeadError(f"the core launcher could not start the engine core: {reply}")
        return reply

    @property
    def has_cores(self) -> bool:
        return bool(self._cores)

    def close(self) -> None:
        """Stop the launcher (it has no cores left); its reader thread then ends."""
        self.lost = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.process.wait()

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            kind, *rest = pickle.loads(data)
            if kind == "ready":
                self.ready.set()
            elif kind == "started":
                core = self._cores[rest[0]] = LaunchedCore(rest[0])
                self._replies.put(core)
            elif kind == "failed":
                self._replies.put(rest[0])
            elif kind == "exited":
                core = self._cores.pop(rest[0], None)
                if core is not None:
                    core._ended(rest[1])
        self._lose()

    def _lose(self) -> None:
        """The launcher is gone (or unusable): later cores start directly; the ones it
        forked exit with it (their parent pid changes), their exit status unknown."""
        self.lost = True
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pid, core in list(self._cores.items()):
            _wait_gone(pid)
            core._ended(None)
        self._cores.clear()


def _wait_gone(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        from multiprocessing.connection import wait
        wait([fd], timeout=5.0)
    finally:
        os.close(fd)


def stderr_fd():
    """Where a core writes (its stdout and stderr): this process's stderr as it is when
    the core starts (a redirect, a test's capture), as a direct start does."""
    try:
        return sys.__stderr__.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


# -- the launcher process ---------------------------------------------------------------

def main(argv: list[str]) -> None:
    """Import what a core needs, say "ready", then fork a core per request and report
    each one's exit, until the client's socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the client, which stops its cores
    sock = socket.socket(fileno=int(argv[0]))
    from gristmill.engine import builder, core_process  # noqa: F401
    builder.preload()
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pidfd -> pid
    _send(sock, ("ready",))
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 4)
                except OSError:
                    data, fds = b"", []
                if not data:
                    os._exit(0)  # the client is gone; its cores see their inbox close
                _start(sock, selector, children, pickle.loads(data), fds)
            else:
                pid = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, ("exited", pid, _returncode(status)))


def _start(sock: socket.socket, selector, children: dict[int, int], request: tuple, fds: list[int]) -> None:
    _, env, cwd = request
    launcher_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        _send(sock, ("failed", f"fork failed: {exc}"))
        return
    if pid == 0:
        _run_core(sock, selector, children, env, cwd, fds, launcher_pid)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pidfd] = pid
    selector.register(pidfd, selectors.EVENT_READ)
    _send(sock, ("started", pid))


def _run_core(sock, selector, children, env, cwd, fds, launcher_pid) -> None:
    """In the forked child: become the core the client asked for; never returns."""
    code = 1
    try:
        selector.close()
        sock.close()
        for pidfd in children:
            os.close(pidfd)
        inbox, outbox, heartbeat, err = fds
        os.dup2(err, 1)
        os.dup2(err, 2)
        os.close(err)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from gristmill.engine.core_process import main as core_main
        core_main([str(inbox), str(outbox), str(heartbeat), str(launcher_pid)])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - what python would print, then its exit code
        import traceback
        traceback.print_exc()
    finally:
        from gristmill.engine.core_process import _exit
        _exit(code)


def _returncode(status: int) -> int:
    """`subprocess`'s convention: the exit code, or minus the signal that killed it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _send(sock: socket.socket, message: tuple) -> None:
    try:
        sock.send(pickle.dumps(message))
    except OSError:
        os._exit(0)  # the client is gone
