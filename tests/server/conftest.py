"""Real `gristmill serve` processes on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.harness import core_children

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
        """The engine-core child (not multiprocessing's resource tracker), started by any
        of the server's threads (a restarted core is started by a worker thread)."""
        found = core_children(self.process.pid)
        if len(found) != 1:
            raise RuntimeError(f"not one engine-core child: {found}")
        return found[0]

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


LONG = {"prompt": "Tell me a very long story.", "max_tokens": 3000, "ignore_eos": True}


def long_requests(client: httpx.AsyncClient, srv: Server) -> list[asyncio.Task]:
    """Two streamed and two plain long completions, started now; each task gives
    (kind, status, body, time it ended)."""
    url = f"{srv.url}/v1/completions"

    async def streamed():
        async with client.stream("POST", url, json={**LONG, "stream": True}) as r:
            body = (await r.aread()).decode()
        return "stream", r.status_code, body, time.monotonic()

    async def plain():
        r = await client.post(url, json=LONG)
        return "plain", r.status_code, r.text, time.monotonic()

    return [asyncio.create_task(f()) for f in (streamed, streamed, plain, plain)]


def assert_ended_dead(results, since: float, slack: float, says: str = "") -> None:
    """Each request ended within `slack` s of `since` with the engine's death: a plain
    one 503 engine_dead_error, a stream an engine_dead_error event then [DONE]."""
    for kind, status, body, ended in results:
        assert ended - since < slack, kind
        if kind == "plain":
            assert status == 503
            error = json.loads(body)["error"]
        else:
            assert status == 200
            events = [e for e in body.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: "):])["error"]
        assert error["type"] == "engine_dead_error" and says in error["message"], error
