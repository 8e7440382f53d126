"""The server under test, two ways.

In process (most tests): the app `gristmill serve FLAGS` builds (`build_app`, the same
flags parsed by the real CLI parser) over an AsyncEngine started once per package and
shared, served by uvicorn on loopback from one event-loop thread. Real HTTP, real engine;
other flags (an API key, limits) are another app over the same engine, not another
process. (httpx's ASGITransport would skip the app's lifespan, which attaches the engine
supervisor, and in httpx 0.28 hands back a response only once the app has sent all of
it, so streams, disconnects and slow readers could not be tested through it.)

As a process (`Server`): a real `gristmill serve` subprocess, only where the process is
the point (signals and the drain, exit codes, engine-core death and restarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.harness import core_children

API_KEY = "test-key"
MODEL = "gemma-3-270m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str, every: float = 0.02):
    """Poll `condition()` until it is truthy (returned), or fail saying `what` never happened."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (waited {timeout:g} s)")
        time.sleep(every)


def metric(url: str, name: str, default: float | None = None) -> float:
    """A sample of the server's /metrics, by its full name (labels included)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if found is None:
        if default is None:
            raise AssertionError(f"{name} not in /metrics")
        return default
    return float(found.group(1))


def wait_running(url: str, count: int, timeout: float = 60.0) -> None:
    """Wait until at least `count` requests run in the server's engine."""
    wait_until(lambda: metric(url, "gristmill_num_requests_running") >= count, timeout,
               f"{count} request(s) never ran at once")


async def wait_running_async(client: httpx.AsyncClient, url: str, count: int, timeout: float = 60.0) -> None:
    """wait_running, from a coroutine (the requests it waits for run on the same loop)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get(f"{url}/metrics")).text
        running = float(re.search(r"^gristmill_num_requests_running (\S+)$", text, re.M).group(1))
        if running >= count:
            return
        assert time.monotonic() < deadline, f"{count} request(s) never ran at once"
        await asyncio.sleep(0.02)


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    def healthy():
        try:
            return httpx.get(f"{url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(healthy, timeout, "the server never became healthy", every=0.05)


# -- in process ---------------------------------------------------------------------------


def serve_args(*flags: str):
    """`gristmill serve --device cpu FLAGS`, parsed by the real CLI parser."""
    from gristmill.cli import build_parser
    return build_parser().parse_args(["serve", "--device", "cpu", *flags])


def start_engine(*flags: str):
    """The AsyncEngine `gristmill serve --device cpu FLAGS` starts (its engine flags)."""
    from gristmill import AsyncEngine
    from gristmill.engine_flags import engine_config
    return AsyncEngine(engine_config(serve_args(*flags)))


class ServerLoop:
    """One event loop on a thread of its own, where every in-process server runs: an
    AsyncEngine takes requests from one loop at a time, so apps that share an engine
    share this loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        """Run `coro` on the loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class AppServer:
    """The app `gristmill serve FLAGS` would build, over `engine`, under the server
    `serve` runs (DrainingServer, uvicorn) on a loopback port, on `loop`."""

    def __init__(self, loop: ServerLoop, engine, *flags: str, model: str = MODEL):
        import uvicorn

        from gristmill.server.app import build_app
        from gristmill.server.limits import ServerLimits
        from gristmill.server.lora_modules import served_loras
        from gristmill.server.run import DrainingServer, bind_socket

        args = serve_args(*flags)
        limits = ServerLimits(max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars,
                              max_stream_buffer=args.max_stream_buffer, max_inputs=args.max_inputs)
        self.engine = engine
        name = args.served_model_name or model
        loras = served_loras(name, engine.config, args.lora_modules, args.allow_runtime_lora)
        self.app = build_app(engine, name, api_key=args.api_key,
                             max_engine_restarts=args.max_engine_restarts, restart_window_s=args.restart_window_s,
                             start_seconds=engine.start_seconds, limits=limits, loras=loras)
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = DrainingServer(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_keep_alive=args.timeout_keep_alive,
                                                    timeout_graceful_shutdown=5),
                                     shutdown_grace_s=args.shutdown_grace_s)
        self._socket = sock
        self._serving = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[sock]), loop.loop)
        wait_until(lambda: self.server.started or self._serving.done(), 60, "the in-process server never started",
                   every=0.005)
        if self._serving.done():
            self._serving.result()  # (raises what stopped it)
            raise RuntimeError("the in-process server stopped at once")

    @property
    def traffic(self):
        """The app's /v1 requests in progress."""
        return self.app.state.traffic

    def stop(self) -> None:
        self.server.should_exit = True
        try:
            self._serving.result(30)
        finally:
            self._socket.close()


@pytest.fixture(scope="package")
def server_loop():
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="package")
def engine():
    """The engine `gristmill serve --device cpu` starts: the bundled model, the defaults;
    shared by every in-process server of the package."""
    engine = start_engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="package")
def server(server_loop, engine):
    """The main server: default model, an API key (`serve --api-key test-key`)."""
    srv = AppServer(server_loop, engine, "--api-key", API_KEY)
    yield srv
    srv.stop()


TINY_MODEL = "tiny-qwen3"


def start_tiny_engine(variant: str, control: tuple[str, ...] = ()):
    """An engine over a tiny random-weight Qwen3 with chat template `variant`
    (tests/chat/reasoning_models.py) and the special tokens `control` added to its
    vocabulary, on the exact float path."""
    from tests.chat.reasoning_models import cache_dir, tiny_reasoning_model
    return start_engine("--model", tiny_reasoning_model(variant, control), "--cache-dir", cache_dir(),
                        "--quantization", "none")


@contextlib.contextmanager
def openai_client(loop: ServerLoop, engine):
    """The real `openai` client of an in-process server over `engine` (model TINY_MODEL)."""
    import openai
    srv = AppServer(loop, engine, model=TINY_MODEL)
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    finally:
        srv.stop()


@pytest.fixture(scope="package")
def tools_engine():
    """A tiny Qwen3 whose chat template writes tools and calls as Qwen's do; shared by the
    package's tool-call tests."""
    engine = start_tiny_engine("hermes_tools")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="package")
def tools_client(server_loop, tools_engine):
    """The openai client of an in-process server over `tools_engine`."""
    with openai_client(server_loop, tools_engine) as served:
        yield served


@pytest.fixture(scope="package")
def marker_tools_engine():
    """`tools_engine`'s model with `<tool_call>` and `</tool_call>` special tokens of its
    vocabulary (as some Qwen ones have): one token opens a call, so a test can bias the
    model to call (logit_bias), again after each call where it may."""
    engine = start_tiny_engine("hermes_tools", control=("<tool_call>", "</tool_call>"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="package")
def marker_tools_client(server_loop, marker_tools_engine):
    """The openai client of an in-process server over `marker_tools_engine`."""
    with openai_client(server_loop, marker_tools_engine) as served:
        yield served


@pytest.fixture(scope="package")
def reasoning_engine():
    """A tiny Qwen3 whose chat template opens `<think>` in the prompt; shared by the
    package's reasoning tests."""
    engine = start_tiny_engine("qwen3_opened")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="package")
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


class faults_set:
    """GRISTMILL_FAULTS in this process's environment (read when an engine starts, by it
    and its core), and cleared again after (`faults.load()` forgets them)."""

    def __init__(self, spec: str):
        self.spec = spec

    def __enter__(self):
        self.before = os.environ.get("GRISTMILL_FAULTS")
        os.environ["GRISTMILL_FAULTS"] = self.spec
        return self

    def __exit__(self, *exc):
        from gristmill import faults
        if self.before is None:
            os.environ.pop("GRISTMILL_FAULTS", None)
        else:
            os.environ["GRISTMILL_FAULTS"] = self.before
        faults.load()


# -- as a process ---------------------------------------------------------------------------


class Server:
    """A real `gristmill serve --device cpu ARGS` process on a free loopback port, healthy."""

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
            time.sleep(0.05)
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
