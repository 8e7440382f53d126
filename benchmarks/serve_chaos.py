"""Chaos soak of a real `gristmill serve`: many concurrent clients for minutes while the
engine core is killed and hung on a schedule, then a PASS/FAIL verdict on what clients
saw and on what the server holds afterwards. Also a smoke test of a deployment (--url).

Starts `python -m gristmill.cli serve` with GRISTMILL_FAULTS set so that chosen prompts
make the engine core exit (CHAOS_EXIT), hang (CHAOS_HANG; the server kills it after
--step-timeout-s) or fail one request while detokenizing (CHAOS_DETOK). A fault task
sends a CHAOS_EXIT request every --exit-every seconds and one CHAOS_HANG request at
--hang-at; --clients loops send completions and chat requests, streamed or not, some
disconnecting early, some invalid, some carrying CHAOS_DETOK. A watcher polls /health
every 0.1 s and records the outages.

Every request ends in one of: ok (200, a complete body; a stream ends with a
finish_reason then `data: [DONE]`), invalid (an invalid body answered 400),
engine_dead (503 engine_dead_error, or a stream's engine_dead_error event then [DONE]),
injected (a CHAOS_DETOK request answered 500 internal_error, or its stream's error
event), disconnected (the client left on purpose), hung (no end within
--request-timeout) or an anomaly (anything else: another status, a missing envelope, a
stream cut short, an engine_dead answer outside any outage, ...).

PASS needs: no hung request and no anomaly; every death followed by /health 200 within
the server's start-up time + --restart-slack-s (+ --step-timeout-s for a hang); no
outage nobody caused; the server's restart counter equal to the deaths caused; and, idle
at the end against idle after warm-up: KV blocks held (total - free), open file
descriptors, child processes and threads no more than at the start (--thread-tolerance
allows a few more, for a deployment whose server starts worker threads lazily), RSS
growth under --rss-growth-pct.

    python benchmarks/serve_chaos.py                            # 10 min, 32 clients
    python benchmarks/serve_chaos.py --duration 60 --clients 8 --exit-every 20
    python benchmarks/serve_chaos.py --server-args "--model /models/x --max-num-seqs 64"
    python benchmarks/serve_chaos.py --url http://10.0.0.5:8000 --duration 120   # smoke test
    python benchmarks/serve_chaos.py --url http://127.0.0.1:8000 --server-pid 4242 --faults on

With --url nothing is started and, unless --faults on (the deployment then runs with
GRISTMILL_FAULTS set to the value printed by --print-faults), no fault is sent; the
server's fds, threads, RSS and children are measured only with --server-pid (same host).
Exit code 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

EXIT, HANG, DETOK = "CHAOS_EXIT", "CHAOS_HANG", "CHAOS_DETOK"
FAULTS = f"core_exit@prompt~{EXIT},core_hang@prompt~{HANG},detokenize@prompt~{DETOK}"
CORE_MODULE = "gristmill.engine.core_process"  # the engine-core child's module (cmdline)

PROMPTS = [
    "Write a haiku about a lighthouse.",
    "The capital of France is",
    "List three uses of a paperclip:",
    "Once upon a time, in a village by the sea,",
    "Explain what a hash table is in one sentence.",
    "Translate 'good morning' into Spanish:",
    "The best way to learn to cook is",
    "Give me a name for a grey cat.",
]

OUTCOMES = ("ok", "invalid", "engine_dead", "injected", "disconnected", "overloaded", "hung", "anomaly")
KINDS = ("cmpl", "cmpl-stream", "chat", "chat-stream")


# -- the server ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`gristmill serve` on loopback, its output in a log file."""

    def __init__(self, port: int, extra: list[str], faults: str | None, log_path: Path, timeout: float):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k != "GRISTMILL_FAULTS"}
        if faults:
            env["GRISTMILL_FAULTS"] = faults
        self.argv = [sys.executable, "-m", "gristmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                     *extra]
        self.log = open(log_path, "w")
        started = time.monotonic()
        self.process = subprocess.Popen(self.argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.process.pid
        deadline = started + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode} before it was "
                                   f"healthy; its output:\n{tail(log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not healthy within {timeout:g} s; its output:\n{tail(log_path)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        #: From process start to the first /health 200.
        self.startup_s = time.monotonic() - started

    def stop(self, grace: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- /proc and /metrics ---------------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    """Live (non-zombie) descendants of `pid`."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def proc_figures(pid: int) -> dict:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    children = descendants(pid)
    cores = 0
    for child in children:
        try:
            cores += CORE_MODULE.encode() in Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            pass
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(status["Threads"]),
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024, "children": len(children), "engine_cores": cores}


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                pass
    return values


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    r = await client.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text)


async def idle_snapshot(url: str, headers: dict, pid: int | None, timeout: float = 120.0) -> dict:
    """Resource figures once the server is idle: /health 200, nothing running or waiting,
    and (with a pid) its open fds settled (closed client sockets take a moment)."""
    deadline = time.monotonic() + timeout
    idle, metrics = False, {}
    async with httpx.AsyncClient(headers=headers, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while time.monotonic() < deadline:
            try:
                health = await client.get(f"{url}/health", timeout=5)
                metrics = await scrape(client, url)
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            if (health.status_code == 200 and metrics.get("gristmill_num_requests_running", 1) == 0
                    and metrics.get("gristmill_num_requests_waiting", 0) == 0):
                idle = True
                break
            await asyncio.sleep(0.5)
    figures = {"idle": idle,
               "running": metrics.get("gristmill_num_requests_running"),
               "kv_deficit": (metrics["gristmill_kv_total_blocks"] - metrics["gristmill_kv_free_blocks"]
                              if "gristmill_kv_total_blocks" in metrics and "gristmill_kv_free_blocks" in metrics
                              else None),
               "kv_total": metrics.get("gristmill_kv_total_blocks"),
               "restarts_total": metrics.get("gristmill_engine_restarts_total", 0.0)}
    if pid is not None:
        last = None
        for _ in range(20):  # until two readings 0.5 s apart agree (at most 10 s)
            now = proc_figures(pid)
            if last is not None and now["fds"] == last["fds"] and now["threads"] == last["threads"]:
                break
            last = now
            await asyncio.sleep(0.5)
        figures.update(now)
    return figures


# -- outages ----------------------------------------------------------------------------

class Watcher:
    """Polls /health every `period` s; records intervals in which it was not 200."""

    def __init__(self, url: str, period: float = 0.1, process: subprocess.Popen | None = None):
        self.url = url
        self.period = period
        self.process = process
        self.intervals: list[list[float | None]] = []  # [first non-200 seen, first 200 after]
        self.statuses_seen: set[str] = set()
        self.probe_timeouts = 0
        self.healthy = asyncio.Event()
        self.healthy.set()
        self.server_exit: int | None = None
        self.stop = asyncio.Event()

    @property
    def down(self) -> bool:
        return not self.healthy.is_set()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while not self.stop.is_set():
                if self.process is not None and self.process.poll() is not None:
                    self.server_exit = self.process.returncode
                    self._mark(False, "server process exited")
                    return
                try:
                    r = await client.get(f"{self.url}/health")
                    ok = r.status_code == 200
                    try:
                        self.statuses_seen.add(f"{r.status_code} {r.json().get('status')}")
                    except ValueError:
                        self.statuses_seen.add(f"{r.status_code} (not JSON)")
                    self._mark(ok)
                except httpx.TimeoutException:
                    self.probe_timeouts += 1  # a slow answer says nothing about the state
                except httpx.HTTPError as exc:
                    self.statuses_seen.add(f"unreachable ({type(exc).__name__})")
                    self._mark(False)
                try:
                    await asyncio.wait_for(self.stop.wait(), self.period)
                except asyncio.TimeoutError:
                    pass

    def _mark(self, ok: bool, why: str | None = None) -> None:
        now = time.monotonic()
        if ok and self.down:
            self.intervals[-1][1] = now
            self.healthy.set()
        elif not ok and not self.down:
            self.intervals.append([now, None])
            self.healthy.clear()
        if why:
            self.statuses_seen.add(why)

    def down_since(self, t: float) -> list[float | None] | None:
        """The first outage that began at or after `t` (or was going on at `t`)."""
        for interval in self.intervals:
            if interval[1] is None or interval[1] >= t:
                return interval
        return None


@dataclass
class Death:
    kind: str               # "exit" or "hang"
    sent: float             # monotonic time the fault request was sent
    response: str = ""      # what the fault request got
    down_after: float | None = None     # s from sent to /health not 200
    healthy_after: float | None = None  # s from sent to /health 200 again
    bound: float | None = None


# -- requests ---------------------------------------------------------------------------

@dataclass
class Result:
    kind: str
    intent: str             # normal, detok, disconnect, invalid
    start: float
    end: float = 0.0
    outcome: str = "anomaly"
    detail: str = ""
    status: int | None = None
    ttft: float | None = None
    retry_after: bool | None = None  # for HTTP 503 answers: whether Retry-After came with it
    retry_after_s: float | None = None


def envelope_of(text: str) -> dict | None:
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) and "type" in error and "message" in error else None


def classify_error(result: Result, status: int, error: dict | None, streamed_event: bool) -> None:
    """A typed failure: an HTTP error answer, or a stream's error event (status 200)."""
    where = "stream error event" if streamed_event else f"HTTP {status}"
    if error is None:
        result.outcome, result.detail = "anomaly", f"{where} without an OpenAI error envelope"
        return
    kind = error.get("type")
    if kind == "engine_dead_error" and (streamed_event or status == 503):
        result.outcome = "engine_dead"
    elif kind == "internal_error" and (streamed_event or status == 500) and result.intent == "detok":
        result.outcome = "injected"
    elif kind == "invalid_request_error" and status == 400 and result.intent == "invalid":
        result.outcome = "invalid"
    elif kind == "overloaded_error" and (streamed_event or status in (429, 503)):
        result.outcome = "overloaded"
    else:
        result.outcome = "anomaly"
    result.detail = f"{where} {kind}: {str(error.get('message'))[:160]}"


def request_body(rng: random.Random, chat: bool, stream: bool, intent: str, args) -> dict | bytes:
    prompt = rng.choice(PROMPTS)
    if intent == "detok":
        prompt = f"{prompt} {DETOK}"
    body: dict = {"max_tokens": rng.randint(args.min_tokens, args.max_tokens), "stream": stream,
                  "temperature": rng.choice([0, 0.7, 1.0])}
    if intent == "disconnect":
        body["max_tokens"] = args.max_tokens  # enough left to leave in the middle of
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if intent == "invalid":
        broken = rng.choice(["temperature", "max_tokens", "top_p", "malformed", "empty"])
        if broken == "malformed":
            return json.dumps(body)[:-7].encode()
        if broken == "empty":  # no messages; completions: no choices (n=0)
            if chat:
                body["messages"] = []
            else:
                body["n"] = 0
        else:
            body[broken] = {"temperature": -1, "max_tokens": 0, "top_p": 0}[broken]
    return body


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, args, intent: str) -> Result:
    chat = rng.random() < 0.5
    stream = intent == "disconnect" or rng.random() < 0.5
    kind = ("chat" if chat else "cmpl") + ("-stream" if stream else "")
    result = Result(kind, intent, time.monotonic())
    body = request_body(rng, chat, stream, intent, args)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    send = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    try:
        async with asyncio.timeout(args.request_timeout):
            if stream:
                async with client.stream("POST", f"{url}{path}", **send) as r:
                    result.status = r.status_code
                    if r.status_code != 200:
                        text = (await r.aread()).decode(errors="replace")
                        note_retry_after(result, r)
                        classify_error(result, r.status_code, envelope_of(text), False)
                    else:
                        await read_stream(result, r, chat)
            else:
                r = await client.post(f"{url}{path}", **send)
                result.status = r.status_code
                if r.status_code == 200:
                    check_body(result, r.text, chat)
                else:
                    note_retry_after(result, r)
                    classify_error(result, r.status_code, envelope_of(r.text), False)
    except (TimeoutError, httpx.TimeoutException) as exc:
        result.outcome, result.detail = "hung", f"no end within {args.request_timeout:g} s ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        got = f"after HTTP {result.status}" if result.status is not None else "before any response"
        result.outcome, result.detail = "anomaly", (f"transport error {got}, {time.monotonic() - result.start:.1f} s "
                                                    f"in: {type(exc).__name__}: {exc}")[:200]
    result.end = time.monotonic()
    return result


def note_retry_after(result: Result, r: httpx.Response) -> None:
    if r.status_code == 503:
        result.retry_after = "retry-after" in r.headers
        try:
            result.retry_after_s = float(r.headers.get("retry-after", ""))
        except ValueError:
            pass


def check_body(result: Result, text: str, chat: bool) -> None:
    try:
        payload = json.loads(text)
        choices = payload["choices"]
        ok = bool(choices) and "usage" in payload and all(
            c.get("finish_reason") in ("stop", "length")
            and isinstance(c["message"]["content"] if chat else c["text"], str) for c in choices)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        result.outcome, result.detail = "anomaly", f"200 with an incomplete body: {text[:160]!r}"
    elif result.intent == "detok":
        result.outcome, result.detail = "anomaly", f"the {DETOK} fault did not fire (200 ok)"
    else:
        result.outcome = "ok"


async def read_stream(result: Result, r: httpx.Response, chat: bool) -> None:
    events: list[str] = []
    error, error_index, finished, bad = None, None, False, None
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        events.append(data)
        if data != "[DONE]":
            try:
                payload = json.loads(data)
                if "error" in payload:
                    if error is None:
                        error, error_index = payload["error"], len(events) - 1
                else:
                    for c in payload["choices"]:
                        text = c["delta"].get("content") if chat else c["text"]
                        if text and result.ttft is None:
                            result.ttft = time.monotonic() - result.start
                        finished = finished or c.get("finish_reason") is not None
            except (ValueError, KeyError, TypeError, AttributeError):
                bad = bad or f"unreadable event {data[:120]!r}"
        if result.intent == "disconnect" and len(events) >= 2 and error is None and data != "[DONE]":
            result.outcome, result.detail = "disconnected", ""
            return  # leaving the `async with` closes the connection mid-stream
    done_last = bool(events) and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    if bad:
        result.outcome, result.detail = "anomaly", bad
    elif not done_last:
        result.outcome = "anomaly"
        result.detail = (f"stream ended without [DONE] after {len(events)} events"
                         + (f" (error event {error.get('type')})" if isinstance(error, dict) else ""))
    elif error is not None:
        if error_index != len(events) - 2:
            result.outcome, result.detail = "anomaly", "a stream's error event was not followed by [DONE] at once"
        else:
            classify_error(result, 200, error if isinstance(error, dict) and "type" in error else None, True)
    elif not finished:
        result.outcome, result.detail = "anomaly", "stream ended with [DONE] but no finish_reason"
    elif result.intent == "detok":
        result.outcome, result.detail = "anomaly", f"the {DETOK} fault did not fire (stream ok)"
    else:
        result.outcome = "ok"


async def client_loop(i: int, client: httpx.AsyncClient, url: str, args, end: float, stop: asyncio.Event,
                      results: list[Result]) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.monotonic() < end and not stop.is_set():
        roll = rng.random()
        if roll < args.invalid_rate:
            intent = "invalid"
        elif roll < args.invalid_rate + args.disconnect_rate:
            intent = "disconnect"
        elif roll < args.invalid_rate + args.disconnect_rate + args.detok_rate:
            intent = "detok"
        else:
            intent = "normal"
        result = await one_request(client, url, rng, args, intent)
        results.append(result)
        if result.retry_after_s is not None and args.backoff_cap > 0:  # as a polite client would
            await asyncio.sleep(min(result.retry_after_s, args.backoff_cap) * rng.uniform(0.5, 1.0))


# -- faults -----------------------------------------------------------------------------

async def fault_task(client: httpx.AsyncClient, url: str, args, t0: float, end: float, watcher: Watcher,
                     startup_s: float, deaths: list[Death]) -> None:
    schedule = []
    if args.exit_every > 0:
        schedule += [(t, "exit") for t in _frange(args.exit_every, args.duration, args.exit_every)]
    if args.hang_at > 0 and args.hang_at < args.duration:
        schedule.append((args.hang_at, "hang"))
    for at, kind in sorted(schedule):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        while watcher.down and time.monotonic() < end and not watcher.stop.is_set():
            await asyncio.sleep(0.1)  # one death at a time: each gets its own recovery time
        if time.monotonic() >= end or watcher.stop.is_set():
            return
        bound = startup_s + args.restart_slack_s + (args.step_timeout_s if kind == "hang" else 0)
        death = Death(kind, time.monotonic(), bound=bound)
        deaths.append(death)
        prompt = f"{EXIT if kind == 'exit' else HANG} now"
        try:
            r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8},
                                  timeout=args.request_timeout)
            error = envelope_of(r.text) or {}
            death.response = f"{r.status_code} {error.get('type', '')}: {str(error.get('message', ''))[:70]}"
        except httpx.HTTPError as exc:
            death.response = f"transport error: {type(exc).__name__}"
        answered = time.monotonic()
        # The fault request's answer comes once the engine is dead: the outage began by then.
        deadline = death.sent + bound + 60
        while time.monotonic() < deadline and not watcher.stop.is_set():
            interval = watcher.down_since(death.sent)
            if interval is not None:
                death.down_after = max(0.0, interval[0] - death.sent)
                if interval[1] is not None:
                    death.healthy_after = interval[1] - death.sent
                    break
            elif not watcher.down and time.monotonic() - answered > 10:
                break  # answered 10 s ago, and /health never left 200: no death
            await asyncio.sleep(0.05)


def _frange(start: float, stop: float, step: float):
    t = start
    while t < stop:
        yield t
        t += step


# -- the run ----------------------------------------------------------------------------

async def warm_up(url: str, headers: dict, args) -> None:
    rng = random.Random(-1)
    async with httpx.AsyncClient(headers=headers, timeout=args.request_timeout) as client:
        for _ in range(2):
            await asyncio.gather(*(one_request(client, url, rng, args, "normal") for _ in range(min(args.clients, 8))))


async def soak(url: str, headers: dict, args, startup_s: float, server: LocalServer | None, pid: int | None) -> dict:
    print("warming up ...", flush=True)
    await warm_up(url, headers, args)
    before = await idle_snapshot(url, headers, pid)
    watcher = Watcher(url, process=server.process if server else None)
    results: list[Result] = []
    deaths: list[Death] = []
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    print(f"soak: {args.clients} clients for {args.duration:g} s ...", flush=True)
    t0 = time.monotonic()
    end = t0 + args.duration
    watch = asyncio.create_task(watcher.run())
    async with httpx.AsyncClient(headers=headers, timeout=args.request_timeout + 10, limits=limits) as client:
        faults = (asyncio.create_task(fault_task(client, url, args, t0, end, watcher, startup_s, deaths))
                  if args.faults == "on" else None)
        stopper = asyncio.create_task(_stop_on_exit(watcher))
        await asyncio.gather(*(client_loop(i, client, url, args, end, watcher.stop, results)
                               for i in range(args.clients)))
        clients_done = time.monotonic()
        if faults is not None:
            await faults
        stopper.cancel()
    # Let the last outage end (or give up) before the watcher stops.
    if watcher.server_exit is None:
        try:
            await asyncio.wait_for(watcher.healthy.wait(), startup_s + args.restart_slack_s + 60)
        except asyncio.TimeoutError:
            pass
    watcher.stop.set()
    await watch
    after = await idle_snapshot(url, headers, pid) if watcher.server_exit is None else {"idle": False}
    return {"t0": t0, "elapsed": clients_done - t0, "results": results, "deaths": deaths, "watcher": watcher,
            "before": before, "after": after}


async def _stop_on_exit(watcher: Watcher) -> None:
    while watcher.server_exit is None:
        await asyncio.sleep(0.2)
    watcher.stop.set()


# -- the report -------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value * 1000:.0f}"


def analyse(run: dict, args, startup_s: float, server_exit: int | None, left_behind: list[int]) -> dict:
    results: list[Result] = run["results"]
    deaths: list[Death] = run["deaths"]
    watcher: Watcher = run["watcher"]
    t0 = run["t0"]
    now = time.monotonic()
    outages = [(a, b if b is not None else now) for a, b in watcher.intervals]
    outages += [(d.sent, d.sent + d.healthy_after if d.healthy_after is not None else now) for d in deaths]

    def overlaps(r: Result, slack: float = 0.0) -> bool:
        return any(r.start < b + slack and r.end > a - slack for a, b in outages)

    for r in results:  # a dead engine's answer needs a dead engine
        if r.outcome == "engine_dead" and not overlaps(r, 1.0):
            r.outcome, r.detail = "anomaly", f"engine_dead outside any outage ({r.detail})"
        if r.outcome == "overloaded" and not args.allow_overloaded:
            r.outcome, r.detail = "anomaly", f"overloaded (--allow-overloaded not given): {r.detail}"

    counts = {o: {k: 0 for k in KINDS} for o in OUTCOMES}
    for r in results:
        counts[r.outcome][r.kind] += 1
    anomalies = [r for r in results if r.outcome in ("anomaly", "hung")]
    examples: dict[str, int] = {}
    for r in anomalies:
        key = f"{r.outcome}: {r.kind} {r.intent}: {r.detail}"
        examples[key] = examples.get(key, 0) + 1

    clean = [r for r in results if r.outcome == "ok" and not overlaps(r)]
    latency = {}
    for kind in (*KINDS, "all"):
        rows = [r for r in clean if kind == "all" or r.kind == kind]
        lat = [r.end - r.start for r in rows]
        ttft = [r.ttft for r in rows if r.ttft is not None]
        latency[kind] = {"n": len(rows), "latency_p50": pct(lat, 50), "latency_p99": pct(lat, 99),
                         "ttft_p50": pct(ttft, 50) if ttft else None, "ttft_p99": pct(ttft, 99) if ttft else None}

    five03 = [r for r in results if r.retry_after is not None]
    retry = {"http_503": len(five03), "with_retry_after": sum(r.retry_after for r in five03)}

    unexplained = [(a - t0, (b - t0) if b is not None else None) for a, b in watcher.intervals
                   if not any(d.sent <= a <= d.sent + (d.bound or 0) + 60 for d in deaths)]

    before, after = run["before"], run["after"]
    resources = {}
    for key in ("kv_deficit", "fds", "threads", "children", "engine_cores", "rss_mib"):
        if before.get(key) is not None and after.get(key) is not None:
            resources[key] = {"start": before[key], "end": after[key], "growth": after[key] - before[key]}

    reasons = []
    n_hung = sum(1 for r in results if r.outcome == "hung")
    n_anom = sum(1 for r in results if r.outcome == "anomaly")
    if n_hung:
        reasons.append(f"{n_hung} hung request(s)")
    if n_anom:
        reasons.append(f"{n_anom} anomal{'y' if n_anom == 1 else 'ies'}")
    if not results:
        reasons.append("no request was sent")
    for i, d in enumerate(deaths, 1):
        if d.down_after is None:
            reasons.append(f"death {i} ({d.kind}): /health never left 200 (the fault did not kill the engine?)")
        elif d.healthy_after is None:
            reasons.append(f"death {i} ({d.kind}): /health not 200 again")
        elif d.healthy_after > d.bound:
            reasons.append(f"death {i} ({d.kind}): healthy after {d.healthy_after:.1f} s > bound {d.bound:.1f} s")
    if unexplained:
        reasons.append(f"{len(unexplained)} outage(s) no injected fault explains: "
                       + ", ".join(f"{a:.1f}-{'...' if b is None else f'{b:.1f}'} s" for a, b in unexplained))
    bad_states = sorted(s for s in watcher.statuses_seen if not s.startswith(("200 ok", "503 restarting")))
    if bad_states:
        reasons.append(f"/health answered {', '.join(bad_states)}")
    caused = sum(1 for d in deaths if d.down_after is not None)
    restarts = None
    if before.get("restarts_total") is not None and after.get("restarts_total") is not None:
        restarts = after["restarts_total"] - before["restarts_total"]
        if restarts != caused:
            reasons.append(f"the server counted {restarts:g} engine restarts, {caused} deaths were caused")
    if not after.get("idle"):
        reasons.append(f"the server was not idle and healthy at the end (running: {after.get('running')})")
    if "kv_deficit" in resources and resources["kv_deficit"]["end"] > resources["kv_deficit"]["start"]:
        reasons.append(f"KV blocks held grew {resources['kv_deficit']['start']:g} -> {resources['kv_deficit']['end']:g}")
    for key in ("fds", "children"):
        if key in resources and resources[key]["growth"] > 0:
            reasons.append(f"{key} grew {resources[key]['start']} -> {resources[key]['end']}")
    if "engine_cores" in resources and resources["engine_cores"]["end"] != 1:
        reasons.append(f"{resources['engine_cores']['end']} engine-core processes at the end")
    if "threads" in resources and resources["threads"]["growth"] > args.thread_tolerance:
        reasons.append(f"threads grew {resources['threads']['start']} -> {resources['threads']['end']} "
                       f"(tolerance +{args.thread_tolerance})")
    if "rss_mib" in resources:
        growth = 100 * resources["rss_mib"]["growth"] / resources["rss_mib"]["start"]
        resources["rss_mib"]["growth_pct"] = growth
        if growth >= args.rss_growth_pct:
            reasons.append(f"RSS grew {growth:.1f}% (limit {args.rss_growth_pct:g}%)")
    if watcher.server_exit is not None:
        reasons.append(f"the server process exited during the run (code {watcher.server_exit})")
    if server_exit not in (None, 0):
        reasons.append(f"the server exited with code {server_exit} on SIGTERM")
    if left_behind:
        reasons.append(f"processes left behind after the server exited: {left_behind}")

    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "trace")},
        "startup_s": startup_s, "startup_measured": not args.url, "elapsed_s": run["elapsed"],
        "requests": len(results),
        "outcomes": counts, "anomalies": examples, "latency_excluding_outages": latency,
        "ok_in_outages": sum(1 for r in results if r.outcome == "ok") - len(clean), "retry_after": retry,
        "deaths": [{**asdict(d), "sent": d.sent - t0} for d in deaths],
        "outages": [(a - t0, (b - t0) if b is not None else None) for a, b in watcher.intervals],
        "health_states": sorted(watcher.statuses_seen), "health_probe_timeouts": watcher.probe_timeouts,
        "restarts_counted": restarts, "deaths_caused": caused,
        "resources": resources, "resources_before": before, "resources_after": after,
        "server_exit_code": server_exit, "verdict": "FAIL" if reasons else "PASS", "reasons": reasons,
    }


def print_report(s: dict) -> None:
    print()
    duration = s["config"]["duration"]
    startup = f"{s['startup_s']:.1f} s" + ("" if s["startup_measured"] else " (assumed: --startup-s)")
    print(f"{s['requests']} requests in {duration:g} s (+{max(0.0, s['elapsed_s'] - duration):.0f} s for the last "
          f"to end); server start-up {startup}")
    print()
    print(f"{'outcome':<14}{'total':>7}" + "".join(f"{k:>13}" for k in KINDS))
    for outcome, by_kind in s["outcomes"].items():
        total = sum(by_kind.values())
        print(f"{outcome:<14}{total:>7}" + "".join(f"{by_kind[k]:>13}" for k in KINDS))
    if s["anomalies"]:
        print("\nanomalies (count  what):")
        for what, n in sorted(s["anomalies"].items(), key=lambda kv: -kv[1])[:20]:
            print(f"  {n:>5}  {what}")
    ra = s["retry_after"]
    print(f"\nHTTP 503 answers: {ra['http_503']}, with Retry-After: {ra['with_retry_after']}")

    print(f"\nok requests outside outages ({s['ok_in_outages']} ok requests overlapping an outage left out), ms:")
    print(f"{'':<13}{'n':>6}{'lat p50':>9}{'p99':>8}{'TTFT p50':>10}{'p99':>8}")
    for kind, row in s["latency_excluding_outages"].items():
        print(f"{kind:<13}{row['n']:>6}{ms(row['latency_p50']):>9}{ms(row['latency_p99']):>8}"
              f"{ms(row['ttft_p50']):>10}{ms(row['ttft_p99']):>8}")

    deaths = s["deaths"]
    counted = "-" if s["restarts_counted"] is None else f"{s['restarts_counted']:g}"
    print(f"\ndeaths: {len(deaths)} injected, {s['deaths_caused']} caused, restarts counted by the server: {counted}")
    if deaths:
        print(f"{'#':>3} {'kind':<5}{'sent at':>8}{'down':>7}{'healthy':>9}{'bound':>7}  fault request got")
        for i, d in enumerate(deaths, 1):
            down = "-" if d["down_after"] is None else f"{d['down_after']:.1f}"
            up = "-" if d["healthy_after"] is None else f"{d['healthy_after']:.1f}"
            print(f"{i:>3} {d['kind']:<5}{d['sent']:>7.1f}s{down:>7}{up:>9}{d['bound']:>7.1f}  {d['response']}")
        ups = [d["healthy_after"] for d in deaths if d["healthy_after"] is not None]
        if ups:
            print(f"max time to healthy: {max(ups):.1f} s (server start-up: {s['startup_s']:.1f} s)")
    print(f"/health states seen: {', '.join(s['health_states'])}; probes timed out: {s['health_probe_timeouts']}")

    res = s["resources"]
    if res:
        print(f"\n{'resource (idle)':<16}{'start':>10}{'end':>10}{'growth':>18}")
        names = {"kv_deficit": "KV blocks held", "fds": "open fds", "threads": "threads", "children": "children",
                 "engine_cores": "engine cores", "rss_mib": "RSS MiB"}
        for key, row in res.items():
            growth = f"{row['growth']:+.1f}" if key == "rss_mib" else f"{row['growth']:+g}"
            if key == "rss_mib":
                growth += f" ({row['growth_pct']:+.1f}%)"
                print(f"{names[key]:<16}{row['start']:>10.1f}{row['end']:>10.1f}{growth:>18}")
            else:
                print(f"{names[key]:<16}{row['start']:>10g}{row['end']:>10g}{growth:>18}")
    print()
    if s["verdict"] == "PASS":
        print("PASS")
    else:
        print("FAIL: " + "; ".join(s["reasons"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600, help="seconds the clients run (default 600)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client loops (default 32)")
    parser.add_argument("--exit-every", type=float, default=30,
                        help="send a CHAOS_EXIT request every this many seconds; 0: never (default 30)")
    parser.add_argument("--hang-at", type=float, default=None,
                        help="send one CHAOS_HANG request this many seconds in; 0: never (default: half the run)")
    parser.add_argument("--detok-rate", type=float, default=0.05, help="share of requests carrying CHAOS_DETOK")
    parser.add_argument("--disconnect-rate", type=float, default=0.05, help="share of streams the client leaves early")
    parser.add_argument("--invalid-rate", type=float, default=0.03, help="share of requests with an invalid body")
    parser.add_argument("--min-tokens", type=int, default=8, help="max_tokens is drawn from [min, max]")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=120,
                        help="a request not over after this many seconds is hung (default 120)")
    parser.add_argument("--step-timeout-s", type=float, default=5.0,
                        help="passed to the server we start; the hang's detection time in its bound (default 5)")
    parser.add_argument("--max-engine-restarts", type=int, default=1000,
                        help="passed to the server we start when faults are on (default 1000)")
    parser.add_argument("--restart-slack-s", type=float, default=0.0,
                        help="a death must be followed by /health 200 within start-up time + this (default 0)")
    parser.add_argument("--rss-growth-pct", type=float, default=10.0, help="largest RSS growth that passes")
    parser.add_argument("--thread-tolerance", type=int, default=0,
                        help="threads the server may gain over the run (lazily created executor threads)")
    parser.add_argument("--backoff-cap", type=float, default=2.0,
                        help="after a 503 with Retry-After a client waits min(Retry-After, this) s, jittered; "
                             "0: retry at once (default 2)")
    parser.add_argument("--allow-overloaded", action="store_true",
                        help="count overloaded_error answers (--max-waiting-requests) as fine, not anomalies")
    parser.add_argument("--server-args", default="",
                        help="more arguments for `gristmill serve`, one string (e.g. \"--model DIR --device cpu\")")
    parser.add_argument("--server-log", type=Path, default=None, help="where the server's output goes")
    parser.add_argument("--startup-timeout", type=float, default=900, help="longest wait for the server to start")
    parser.add_argument("--url", default=None, help="an already running server to soak (nothing is started)")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: the server's pid on this host, for its fds, threads, RSS and children")
    parser.add_argument("--startup-s", type=float, default=None,
                        help="with --url: the deployment's start-up time, for the death bound (default 60)")
    parser.add_argument("--faults", choices=("on", "off"), default=None,
                        help="inject faults (default: on when we start the server, off with --url)")
    parser.add_argument("--print-faults", action="store_true", help="print the GRISTMILL_FAULTS value and exit")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write every request (kind, intent, start/end s, outcome, detail) here, JSON lines")
    args = parser.parse_args()
    if args.print_faults:
        print(FAULTS)
        return 0
    if args.faults is None:
        args.faults = "off" if args.url else "on"
    if args.hang_at is None:
        args.hang_at = args.duration / 2
    if args.faults == "off":
        args.exit_every, args.hang_at, args.detok_rate = 0, 0, 0.0
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    server = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.server_pid
        startup_s = args.startup_s if args.startup_s is not None else 60.0
    else:
        extra = shlex.split(args.server_args)
        if args.faults == "on":
            extra = ["--max-engine-restarts", str(args.max_engine_restarts), "--step-timeout-s",
                     f"{args.step_timeout_s:g}", *extra]
        if args.api_key and "--api-key" not in extra:
            extra += ["--api-key", args.api_key]
        log_path = args.server_log or Path(tempfile.mkdtemp(prefix="serve_chaos_")) / "server.log"
        print(f"starting gristmill serve {shlex.join(extra)}"
              + (f" with GRISTMILL_FAULTS={FAULTS}" if args.faults == "on" else "") + f"; log: {log_path}",
              flush=True)
        server = LocalServer(free_port(), extra, FAULTS if args.faults == "on" else None, log_path,
                             args.startup_timeout)
        url, pid = server.url, server.pid
        startup_s = server.startup_s
        print(f"healthy after {startup_s:.1f} s (pid {pid})", flush=True)

    server_exit, left_behind = None, []
    try:
        run = asyncio.run(soak(url, headers, args, startup_s, server, pid))
    finally:
        if server is not None:
            kids = descendants(server.pid) if server.process.poll() is None else []
            server_exit = server.stop()
            time.sleep(1.0)
            left_behind = [k for k in kids if alive(k)]
    summary = analyse(run, args, startup_s, server_exit, left_behind)
    print_report(summary)
    if server is not None:
        tracebacks = server.log_path.read_text(errors="replace").count("Traceback")
        print(f"server log: {server.log_path} ({tracebacks} traceback(s))")
        summary["server_log"] = str(server.log_path)
        summary["server_log_tracebacks"] = tracebacks
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    if args.trace:
        with open(args.trace, "w") as f:
            for r in run["results"]:
                f.write(json.dumps({**asdict(r), "start": r.start - run["t0"], "end": r.end - run["t0"]}) + "\n")
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
