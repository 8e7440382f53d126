"""The server's outermost layer, in front of every /v1 request: refuses new requests
while the server drains, counts the requests in progress (for the drain), and reads
each body under the size limit, refusing malformed UTF-8 and JSON nested too deep
before anything parses it into objects."""

from __future__ import annotations

import asyncio
import json

from gristmill.server.errors import envelope
from gristmill.server.limits import ServerLimits
from gristmill.server.messages_protocol import MESSAGES_PATH
from gristmill.server.pooling_protocol import POOLING_PATHS
from gristmill.server.protocol import CHAT_PATH, COMPLETIONS_PATH
from gristmill.server.responses_protocol import RESPONSES_PATH

#: Paths whose bodies are engine requests, generation or pooling (their failures are
#: counted in /metrics).
ENGINE_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH, RESPONSES_PATH, MESSAGES_PATH, *POOLING_PATHS})


class Traffic:
    """The /v1 requests in progress, from their first byte in to their last byte out."""

    def __init__(self):
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no /v1 request is in progress; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class Gate:
    """ASGI middleware (see the module's docstring)."""

    def __init__(self, app, limits: ServerLimits, supervisor, metrics, traffic: Traffic):
        self.app = app
        self.limits = limits
        self.supervisor = supervisor
        self.metrics = metrics
        self.traffic = traffic

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(("/v1/", "/v2/")):
            await self.app(scope, receive, send)
            return
        if self.supervisor.draining:
            await self._refuse(scope, send, 503, "the server is shutting down and takes no new requests; send the "
                                                 "request to another server", "engine_dead_error",
                               retry_after=self.supervisor.retry_after_s)
            return
        self.traffic.enter()
        try:
            if scope["method"] == "POST":
                body = await self._read_body(scope, receive, send)
                if body is None:
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            self.traffic.leave()

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None when it was refused (or the client left)."""
        limit = self.limits.max_request_bytes
        too_big = (f"the request body is larger than {limit} bytes (the server's --max-request-bytes); "
                   f"send a smaller request")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, send, 400, too_big, param="body")
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if scope["path"] in ENGINE_PATHS:
                    self.metrics.client_disconnected()
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, send, 400, too_big, param="body")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if scope["path"] in ENGINE_PATHS and body:
            problem = self._json_problem(body)
            if problem is not None:
                await self._refuse(scope, send, 400, problem, param="body")
                return None
        return body

    def _json_problem(self, body: bytes) -> str | None:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"the request body is not valid UTF-8 (byte {exc.start}); send JSON encoded as UTF-8"
        depth = self.limits.max_json_depth
        if body.count(b"[") + body.count(b"{") <= depth:
            return None  # too few brackets to nest deeper: the app parses it once, as usual
        too_deep = f"the request body's JSON nests deeper than {depth} levels; send a flatter request"
        try:
            value = json.loads(text)
        except RecursionError:
            return too_deep
        except ValueError:
            return None  # not JSON: the app's own parsing says so
        return too_deep if _deeper_than(value, depth) else None

    async def _refuse(self, scope, send, status: int, message: str, type_: str = "invalid_request_error",
                      param: str | None = None, retry_after: int | None = None) -> None:
        if scope["path"] in ENGINE_PATHS:
            self.metrics.request_failed("EngineDeadError" if status == 503 else "RequestError")
        payload = json.dumps(envelope(message, type_, param, status)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive):
    """A `receive` that gives the body read already, then the client's own messages
    (a disconnect) as they come."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _deeper_than(value, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests more than `limit` levels of lists and objects."""
    level = [value] if isinstance(value, (list, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (list, dict))]
    return False
