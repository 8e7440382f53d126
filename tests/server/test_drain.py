"""Graceful shutdown of a real server: SIGTERM drains (new requests 503 + Connection:
close, requests in flight finish, what outlives --shutdown-grace-s ends with a typed
error), the process exits 0 with no engine process left; SIGINT twice exits at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.harness import process_gone
from tests.server.conftest import Server, wait_running, wait_until

# SHORT ends well within the grace even on a loaded 2-core machine (a step of ~0.6 s).
SHORT = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
GRACE_S = 10
LONG = {"prompt": "Tell me a very long story.", "max_tokens": 3000, "ignore_eos": True}


def _in_background(fn, *args) -> dict:
    """Run fn(*args) on a thread; the dict gets its result (or error) and end time."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            box["error"] = exc
        box["ended"] = time.monotonic()

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def _stream(url: str, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    return r.status_code, events


def _plain(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _draining(srv: Server) -> bool:
    """Whether the server says it drains (it answers /health while it does)."""
    health = httpx.get(f"{srv.url}/health", timeout=10)
    return health.status_code == 503 and health.json()["status"] == "draining"


def test_sigterm_lets_requests_in_flight_finish_then_exits_0():
    srv = Server("--shutdown-grace-s", str(GRACE_S))
    core = srv.core_pid
    short_stream = _in_background(_stream, srv.url, SHORT)
    short_plain = _in_background(_plain, srv.url, SHORT)
    long_stream = _in_background(_stream, srv.url, LONG)
    wait_running(srv.url, 3)
    srv.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_until(lambda: _draining(srv), 10, "the server never began to drain")

    refused = httpx.post(f"{srv.url}/v1/completions", json=SHORT, timeout=10)
    assert refused.status_code == 503
    assert refused.headers["connection"] == "close" and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "engine_dead_error"
    assert "shutting down" in refused.json()["error"]["message"]
    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining"

    for box in (short_stream, short_plain, long_stream):
        box["thread"].join(60)
    status, events = short_stream["result"]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    plain = short_plain["result"]
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"
    # The long one outlived the grace: an error event, then [DONE], when the grace ran out.
    status, events = long_stream["result"]
    assert status == 200 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "engine_dead_error" and f"shutdown grace of {GRACE_S} s ran out" in error["message"]
    assert GRACE_S <= long_stream["ended"] - signalled < GRACE_S + 3
    assert srv.process.wait(30) == 0
    wait_until(lambda: process_gone(core), 5, "the engine core outlived the server")


def test_sigint_twice_exits_at_once():
    srv = Server()  # the default grace: 30 s
    core = srv.core_pid
    long_stream = _in_background(_stream, srv.url, LONG)
    wait_running(srv.url, 1)
    srv.process.send_signal(signal.SIGINT)
    wait_until(lambda: _draining(srv), 10, "the server never began to drain")
    assert srv.process.poll() is None  # draining: the long stream may go on
    srv.process.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    srv.process.wait(15)
    assert time.monotonic() - interrupted < 8
    wait_until(lambda: process_gone(core), 5, "the engine core outlived the server")
    long_stream["thread"].join(10)
    assert "ended" in long_stream  # the client was not left hanging
