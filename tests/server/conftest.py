"""Real `gristmill serve` processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, faults: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "GRISTMILL_FAULTS"}
        if faults:
            env["GRISTMILL_FAULTS"] = faults
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gristmill.cli", "serve", "--port", str(self.port), "--device", "cpu", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.process.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    @property
    def core_pid(self) -> int:
        """The engine-core child (not multiprocessing's resource tracker)."""
        pid = self.process.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"gristmill.engine.core_process" in f.read():
                    return child
        raise RuntimeError(f"no engine-core child among {children}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


@pytest.fixture(scope="package")
def server():
    """The main server: default model, an API key."""
    srv = Server("--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}
