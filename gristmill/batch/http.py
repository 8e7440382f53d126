"""HttpEngine: rows sent to any OpenAI-compatible server (`gristmill serve`, vLLM, OpenAI).

Requests run concurrently (at most `concurrency`, started at most `qps` per second).
A 429, 408, 5xx or a connection error is retried with exponential backoff and full
jitter (never sooner than the server's Retry-After); what is left after `max_retries`:
- a 4xx becomes the row's RequestError ("HTTP 400: <the server's message>");
- a 429 / 408 / 5xx becomes the row's GenerationError; a response that does not come
  within `request_timeout_s` the row's RequestTimeoutError, at once (a retry would only
  start the generation over);
- a server that stays unreachable, or refuses the processor itself (401 / 403: the API
  key; 404: no such API or model at the URL) is fatal: EngineDeadError stops the job;
  but a 404 for a model a row names itself (its `lora` or `model` column: a LoRA adapter
  the server maps by name) is that row's RequestError.

Pooling rows (task embed, classify, score) go to {url}/embeddings, /classify and /score
(OpenAI's API serves the first; vLLM and `gristmill serve` all three), one input a request.

`generated_tokens` are filled where the server returns token ids (`return_token_ids`, as
`gristmill serve` and vLLM do); OpenAI's own API returns text only, so there they are [].
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from gristmill.batch.config import HttpProcessorConfig
from gristmill.batch.openai_rows import generated_of, openai_request, pooled_of, pooling_request
from gristmill.batch.rows import Generated, Pooled, RowRequest
from gristmill.batch.stages import REMOTE_STAGES
from gristmill.errors import EngineDeadError, GenerationError, RequestError

_BACKOFF_BASE_S = 0.5
_BACKOFF_MAX_S = 10.0
_RETRIED_STATUSES = frozenset({408, 429})
#: Statuses that say the configuration is wrong (the key, the URL, the model), not the row.
_FATAL_STATUSES = {401: "the server refused the API key; set api_key (gristmill batch: --api-key or "
                        "OPENAI_API_KEY)",
                   403: "the server refused the API key; set api_key (gristmill batch: --api-key or "
                        "OPENAI_API_KEY) to one allowed to use it",
                   404: "no such API or model there; the url is the API's base (such as "
                        "'http://127.0.0.1:8000/v1'), and model one it serves"}


class RequestTimeoutError(GenerationError):
    """No response within request_timeout_s."""


class HttpEngine:
    #: The server applies its own chat template and tokenizer.
    stages = REMOTE_STAGES

    def __init__(self, config: HttpProcessorConfig):
        self.config = config
        self.model = config.model
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._pacing = asyncio.Lock()
        self._discovery: asyncio.Lock | None = None  # one GET /models, not one per row
        self._next_start = 0.0
        #: Ask for the generated token ids (vLLM's and gristmill's `return_token_ids`) until
        #: the server says it does not know the field (OpenAI's API has no token ids).
        self._ask_token_ids = True

    async def generate(self, request: RowRequest) -> Generated:
        await self._connect()
        method, body = openai_request(request, self.model)
        path = "/chat/completions" if method == "chat" else "/completions"
        tools = request.tool_fields is not None
        if self._ask_token_ids:
            try:
                return generated_of(await self._post(path, {**body, "return_token_ids": True}, request.model),
                                    f"{self.config.url}{path}", tools)
            except RequestError as exc:
                if "return_token_ids" not in str(exc):
                    raise
                self._ask_token_ids = False  # a server that refuses it: rows get text only
        return generated_of(await self._post(path, body, request.model), f"{self.config.url}{path}", tools)

    async def pool(self, request: RowRequest) -> Pooled:
        await self._connect()
        path, body = pooling_request(request, self.model)
        return pooled_of(request.task, await self._post(path, body, request.model), f"{self.config.url}{path}")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # -- HTTP ---------------------------------------------------------------------------

    async def _connect(self) -> None:
        if self._client is None:
            config = self.config
            headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
            self._client = httpx.AsyncClient(base_url=config.url.rstrip("/"), headers=headers,
                                             timeout=config.request_timeout_s,
                                             limits=httpx.Limits(max_connections=config.concurrency))
            self._slots = asyncio.Semaphore(config.concurrency)
            self._discovery = asyncio.Lock()
        if self.model is None:
            async with self._discovery:
                if self.model is None:
                    data = await self._send("GET", "/models", None)
                    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
                    if not models:
                        raise EngineDeadError(f"{self.config.url}/models lists no model; set "
                                              f"HttpProcessorConfig.model")
                    self.model = models[0]

    async def _post(self, path: str, body: dict, row_model: str | None = None) -> dict:
        """`row_model`: the model the row named (a 404 is then the row's, not the job's)."""
        return await self._send("POST", path, body, row_model)

    async def _send(self, method: str, path: str, body: dict | None, row_model: str | None = None) -> dict:
        url = f"{self.config.url.rstrip('/')}{path}"
        for attempt in range(self.config.max_retries + 1):
            last_try = attempt == self.config.max_retries
            await self._pace()
            try:
                async with self._slots:
                    response = await self._client.request(method, path, json=body)
            except httpx.TransportError as exc:  # timeouts included
                if last_try or isinstance(exc, httpx.ReadTimeout):
                    raise self._gave_up(exc, f"{method} {url}", attempt + 1) from exc
                await asyncio.sleep(_backoff(attempt))
                continue
            status = response.status_code
            if status < 400:
                return _json(response, url)
            if (status in _RETRIED_STATUSES or status >= 500) and not last_try:
                await asyncio.sleep(max(_backoff(attempt), _retry_after(response)))
                continue
            message = f"HTTP {status} from {url}: {_server_message(response)}"
            if status == 404 and row_model is not None:
                raise RequestError(f"{message}; the row names the model {row_model!r} (its 'lora' or 'model' "
                                   f"column), which the server does not serve", status=status, param="model")
            if status in _FATAL_STATUSES:
                raise EngineDeadError(f"{message}; {_FATAL_STATUSES[status]}")
            if status in _RETRIED_STATUSES or status >= 500:
                raise GenerationError(f"{message} (after {attempt + 1} tries)", status=status)
            raise RequestError(message, status=status)
        raise AssertionError("unreachable")

    def _gave_up(self, exc: httpx.TransportError, request: str, tries: int) -> Exception:
        """A timeout ends only its row; a server that cannot be reached ends the job."""
        if isinstance(exc, httpx.TimeoutException):
            return RequestTimeoutError(f"{request}: no response within request_timeout_s="
                                       f"{self.config.request_timeout_s}s; raise it or lower the load")
        return EngineDeadError(f"{request}: the server is unreachable after {tries} tries "
                               f"({type(exc).__name__}: {exc}); start the server or fix the URL")

    async def _pace(self) -> None:
        """Start at most `qps` requests per second."""
        if self.config.qps is None:
            return
        async with self._pacing:
            now = time.monotonic()
            wait = self._next_start - now
            self._next_start = max(now, self._next_start) + 1.0 / self.config.qps
            if wait > 0:
                await asyncio.sleep(wait)


def _backoff(attempt: int) -> float:
    """Full jitter: uniform in [0, base * 2**attempt], capped."""
    return random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** attempt))


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("retry-after", 0)), _BACKOFF_MAX_S)
    except ValueError:
        return 0.0


def _server_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return response.text[:300] or response.reason_phrase


def _json(response: httpx.Response, url: str) -> dict:
    try:
        return response.json()
    except ValueError as exc:
        raise GenerationError(f"{url} answered with something that is not JSON: {response.text[:200]!r}") from exc
