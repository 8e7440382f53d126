"""The server restarts a dead or hung engine in place: in-flight requests end at once
with 503 (streams: an error event then [DONE]), /health says `restarting` then ok, new
requests meanwhile get 503 with Retry-After, and afterwards the same requests give the
same greedy text. Real server, real faults (GRISTMILL_FAULTS)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.harness import process_gone
from tests.server.conftest import Server, assert_ended_dead, long_requests, wait_running_async

GREEDY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def healing():
    srv = Server("--max-engine-restarts", "5", "--step-timeout-s", "3",
                 faults="core_exit@prompt~KILL_THE_CORE,core_hang@prompt~HANG_THE_CORE")
    yield srv
    assert srv.stop() == 0


async def _fault_mid_load(srv: Server, trigger: str):
    """Four long requests (two streamed) in flight, then one whose prompt fires a fault.
    Returns (time the fault request was sent, its response, [(kind, status, body, ended)],
    /health answers seen until it was 200 again, [(status, headers, body)] of requests
    sent while restarting)."""
    url = f"{srv.url}/v1/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = long_requests(client, srv)
        await wait_running_async(client, srv.url, 4)  # all four in flight
        sent = time.monotonic()
        fault = asyncio.create_task(client.post(url, json={"prompt": f"{trigger} now", "max_tokens": 50}))
        results = await asyncio.gather(*tasks)
        healths, refused = [], []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            health = await client.get(f"{srv.url}/health")
            healths.append((health.status_code, health.json()))
            if health.status_code == 200:
                break
            if len(refused) < 3:
                r = await client.post(url, json=GREEDY)
                refused.append((r.status_code, r.headers, r.json()))
            await asyncio.sleep(0.1)
        return sent, await fault, results, healths, refused


def _metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_core_exit_mid_load_is_restarted_in_place(healing):
    before = httpx.post(f"{healing.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    old_core = healing.core_pid
    sent, fault, results, healths, refused = asyncio.run(_fault_mid_load(healing, "KILL_THE_CORE"))
    # The core exits when the fault request is scheduled (the next step): every request
    # in flight ends within a second of that.
    assert_ended_dead(results, sent, 1.5)
    assert fault.status_code == 503 and "exited with code 17" in fault.json()["error"]["message"]
    statuses = [body["status"] for _, body in healths]
    assert statuses[-1] == "ok" and set(statuses[:-1]) <= {"restarting"} and len(statuses) > 1
    assert "exited with code 17" in healths[0][1]["reason"]
    for status, headers, body in refused:
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert body["error"]["type"] == "engine_dead_error" and "restarting" in body["error"]["message"]
    assert process_gone(old_core) and healing.core_pid != old_core
    after = httpx.post(f"{healing.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == before
    assert _metric(healing, "gristmill_engine_restarts_total") >= 1
    assert _metric(healing, "gristmill_engine_restart_seconds_total") > 0
    assert _metric(healing, "gristmill_engine_dead") == 0
    stats_free = _metric(healing, "gristmill_kv_free_blocks")
    assert stats_free == _metric(healing, "gristmill_kv_total_blocks")  # nothing held by the dead requests


def test_a_hung_core_is_killed_and_restarted(healing):
    restarts = _metric(healing, "gristmill_engine_restarts_total")
    before = httpx.post(f"{healing.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    sent, fault, results, healths, _ = asyncio.run(_fault_mid_load(healing, "HANG_THE_CORE"))
    # A hang is seen when a step outlives --step-timeout-s (3 s).
    assert_ended_dead(results, sent, 3 + 1.5)
    assert fault.status_code == 503 and "hung" in fault.json()["error"]["message"]
    assert healths[-1] == (200, {"status": "ok"})
    after = httpx.post(f"{healing.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == before
    assert _metric(healing, "gristmill_engine_restarts_total") == restarts + 1
