"""The FastAPI app: routes, auth, health, metrics and the error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gristmill.engine.async_engine import AsyncEngine
from gristmill.errors import EngineDeadError, GristmillError, RequestError
from gristmill.server.errors import (ModelNotFoundError, error_response, exception_response, validation_message,
                                     validation_param)
from gristmill.server.gate import ENGINE_PATHS, Gate, Traffic
from gristmill.lora import LoRARequest
from gristmill.server.limits import ServerLimits
from gristmill.server.lora_modules import LOAD_PATH, UNLOAD_PATH, LoadLoRARequest, LoRAModules, UnloadLoRARequest
from gristmill.server.messages_api import AnthropicErrors, MessagesServing
from gristmill.server.messages_protocol import COUNT_TOKENS_PATH, MESSAGES_PATH, MessagesRequest
from gristmill.server.metrics import ServerMetrics
from gristmill.server.openai_serving import OpenAIServing
from gristmill.server.pooling import PoolingServing
from gristmill.server.pooling_protocol import (CLASSIFY_PATH, EMBEDDINGS_PATH, RERANK_PATHS, SCORE_PATH,
                                               ClassificationRequest, EmbeddingRequest, RerankRequest, ScoreRequest)
from gristmill.server.protocol import CHAT_PATH, COMPLETIONS_PATH, ChatCompletionRequest, CompletionRequest
from gristmill.server.responses_api import ResponsesServing
from gristmill.server.responses_protocol import RESPONSES_PATH, ResponsesRequest
from gristmill.server.supervisor import EngineSupervisor
from gristmill.server.tokenize_api import (DETOKENIZE_PATH, TOKENIZE_PATH, DetokenizeRequest, TokenizeRequest,
                                           detokenize, tokenize)

logger = logging.getLogger("gristmill.serve")


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, *,
              max_engine_restarts: int = 0, restart_window_s: float = 600.0, start_seconds: float = 5.0,
              on_give_up: Callable[[EngineDeadError], None] | None = None,
              limits: ServerLimits | None = None, loras: LoRAModules | None = None) -> FastAPI:
    """The server's app over `engine`. A dead engine is restarted up to
    `max_engine_restarts` times within `restart_window_s` (see EngineSupervisor);
    `on_give_up(error)` is called when the budget is spent. `loras`: the LoRA adapters
    served by name (default: none, and runtime loading off)."""
    metrics = ServerMetrics()
    supervisor = EngineSupervisor(engine, metrics, max_engine_restarts, restart_window_s, start_seconds, on_give_up)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        supervisor.attach(asyncio.get_running_loop())
        yield
        await supervisor.stop()

    app = FastAPI(title="gristmill", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    limits = limits or ServerLimits()
    serving = OpenAIServing(engine, model_name, metrics, supervisor=supervisor, limits=limits)
    serving.loras = loras = loras or LoRAModules(model_name, engine.config.enable_lora, engine.config.max_lora_rank)
    pooling = PoolingServing(engine, model_name, metrics, limits, serving)
    responses = ResponsesServing(serving)
    messages = MessagesServing(serving)
    created = int(time.time())
    traffic = Traffic()
    app.state.engine, app.state.metrics, app.state.supervisor, app.state.traffic = engine, metrics, supervisor, traffic
    app.add_middleware(Gate, limits=limits, supervisor=supervisor, metrics=metrics, traffic=traffic)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path.startswith(("/v1", "/v2")):
            scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
            # (the scheme is case-insensitive, RFC 9110; the key is not; Anthropic's
            # clients send theirs as x-api-key)
            if scheme.lower() != "bearer":
                given = request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
                return error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or "
                                           "'x-api-key: <key>')", "invalid_request_error", code="invalid_api_key")
        return await call_next(request)

    app.add_middleware(AnthropicErrors)  # (outermost: auth and gate refusals too)

    @app.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post(EMBEDDINGS_PATH)
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await pooling.embeddings(body, request)

    @app.post(CLASSIFY_PATH)
    async def classify(body: ClassificationRequest, request: Request):
        return await pooling.classify(body, request)

    @app.post(SCORE_PATH)
    async def score(body: ScoreRequest, request: Request):
        return await pooling.score(body, request)

    for path in RERANK_PATHS:
        @app.post(path)
        async def rerank(body: RerankRequest, request: Request):
            return await pooling.rerank(body, request)

    @app.post(CHAT_PATH)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.post(RESPONSES_PATH)
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create(body, request)

    @app.post(MESSAGES_PATH)
    async def create_message(body: MessagesRequest, request: Request):
        return await messages.create(body, request)

    @app.post(COUNT_TOKENS_PATH)
    async def count_message_tokens(body: MessagesRequest):
        return await messages.count_tokens(body)

    @app.post(TOKENIZE_PATH)
    async def tokenize_prompt(body: TokenizeRequest):
        serving.check_model(body.model)
        return await tokenize(engine, body)

    @app.post(DETOKENIZE_PATH)
    async def detokenize_tokens(body: DetokenizeRequest):
        serving.check_model(body.model)
        return detokenize(engine, body)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "gristmill",
                "max_model_len": engine.max_model_len, "task": engine.capacity.task}

    def model_cards() -> list[dict]:
        return [model_card(), *loras.cards(created, engine.max_model_len)]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        card = next((c for c in model_cards() if c["id"] == model), None)
        if card is None:
            served = ", ".join(repr(c["id"]) for c in model_cards())
            raise ModelNotFoundError(f"the model {model!r} does not exist; this server serves {served}",
                                     param="model")
        return card

    @app.post(LOAD_PATH)
    async def load_lora_adapter(body: LoadLoRARequest):
        loras.check_runtime()
        lora = loras.add(LoRARequest(body.lora_name, 1, body.lora_path))
        return Response(f"Success: LoRA adapter '{lora.lora_name}' added successfully.", media_type="text/plain")

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        loras.check_runtime()
        loras.remove(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.get("/health")
    async def health():
        status, body = supervisor.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.engine_dead.set(1 if engine.errored else 0)
        if not engine.errored:
            try:
                stats = await engine.stats()
            except EngineDeadError:
                metrics.engine_dead.set(1)
            else:
                metrics.engine_stats(stats)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        if request.url.path in ENGINE_PATHS:  # an engine request that failed
            metrics.request_failed(RequestError.__name__)
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "the request body is not valid JSON; send a JSON object",
                                  "invalid_request_error")
        first = errors[0] if errors else {}
        content_type = request.headers.get("content-type", "")
        if first.get("loc") == ("body",) and "json" not in content_type:  # (curl -d, requests' data=)
            return error_response(400, f"the body was not read as JSON: its Content-Type is "
                                       f"{content_type or 'missing'}; send the header Content-Type: "
                                       f"application/json", "invalid_request_error")
        message = validation_message(errors)
        return error_response(400, f"invalid request: {message or 'the body is not valid JSON'}",
                              "invalid_request_error", validation_param(first.get("loc", ())))

    @app.exception_handler(GristmillError)
    async def gristmill_error(request: Request, exc: GristmillError):
        return exception_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(exc.status_code, str(exc.detail), kind, code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return exception_response(exc)

    return app
