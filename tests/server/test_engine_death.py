"""Engine death on the wire with no restart budget: in-flight requests fail within a
second, /health says so, the server stays up and 503 (or exits with
--exit-on-engine-death). Restarts: test_restarts.py; shutdown: test_drain.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from tests.server.conftest import Server, assert_ended_dead, long_requests, wait_running_async

async def in_flight_then_kill(srv: Server):
    """Two streaming and two plain requests in flight, then SIGKILL of the engine core.
    Returns (kill time, /health's answer, when it came, [(kind, status, body, ended)])."""
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = long_requests(client, srv)
        await wait_running_async(client, srv.url, 4)  # all four in flight
        killed_at = time.monotonic()
        os.kill(srv.core_pid, signal.SIGKILL)
        health = None
        while time.monotonic() - killed_at < 1.0:
            health = await client.get(f"{srv.url}/health")
            if health.status_code == 503:
                break
            await asyncio.sleep(0.02)
        health_at = time.monotonic()
        return killed_at, health, health_at, await asyncio.gather(*tasks)


def test_sigkill_of_the_core_on_the_wire():
    srv = Server("--max-engine-restarts", "0")
    try:
        killed_at, health, health_at, results = asyncio.run(in_flight_then_kill(srv))
        assert health.status_code == 503 and health_at - killed_at < 1.0
        assert health.json()["status"] == "dead" and "SIGKILL" in health.json()["reason"]
        assert "not restarted: the restart budget (0 restarts within 600 s) is spent" in health.json()["reason"]
        # A SIGKILL nobody asked for is most likely the OOM killer's: said with the figures
        # the core's load checked (sent with its Ready: nothing is read again on the way).
        for said in ("most likely it ran out of memory", "weights", "KV cache", "available", "a smaller quantization"):
            assert said in health.json()["reason"], said
        assert_ended_dead(results, killed_at, 1.0, "SIGKILL")
        start = time.monotonic()
        later = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert later.status_code == 503 and time.monotonic() - start < 1.0
        assert "SIGKILL" in later.json()["error"]["message"]
        assert "retry-after" not in later.headers  # dead for good: retrying here is no use
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 2})):
            dead = httpx.post(f"{srv.url}{path}", json=body)
            assert dead.status_code == 503 and "SIGKILL" in dead.json()["error"]["message"], (path, dead.text)
        assert httpx.get(f"{srv.url}/v1/models").status_code == 200  # the server stays up
        assert srv.process.poll() is None
    finally:
        assert srv.stop() == 0


def test_exit_on_engine_death_once_the_restart_budget_is_spent():
    srv = Server("--exit-on-engine-death", "--max-engine-restarts", "1", faults="core_exit@step=3")
    try:
        response = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 20}, timeout=30)
        assert response.status_code == 503
        assert "exited with code 17" in response.json()["error"]["message"]
        deadline = time.monotonic() + 120
        while httpx.get(f"{srv.url}/health").status_code != 200:  # restarted once
            assert srv.process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        response = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 20}, timeout=30)
        assert response.status_code == 503  # the new core dies at its step 3 too: budget spent
        assert srv.process.wait(15) == 1
        assert "restart budget (1 restart within 600 s) is spent" in srv.process.stdout.read()
    finally:
        srv.stop()
