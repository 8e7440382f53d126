"""What every generation face of the server shares (completions, chat, Responses,
Anthropic's Messages): the model a request names (the base, or a LoRA adapter), the job's
prompts into the engine, the whole answer or the stream, and the errors and metrics of
each. A face makes the job (its prompts, sampling params, how to shape the answer) and
hands it to `run`.

Every prompt of a request is validated and submitted before any byte is sent, so
validation errors come back as plain HTTP errors; once a stream started, a failure is
the face's one error event.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gristmill.engine.async_engine import AsyncEngine, RequestStream
from gristmill.errors import EngineDeadError, RequestError
from gristmill.lora import LoRARequest
from gristmill.outputs import RequestOutput
from gristmill.sampling import SamplingParams
from gristmill.server.chat_output import ChatJob, overall_reason
from gristmill.server.errors import ModelNotFoundError, exception_response
from gristmill.server.limits import ServerLimits
from gristmill.server.lora_modules import LoRAModules
from gristmill.server.metrics import RequestTimer, ServerMetrics
from gristmill.server.supervisor import EngineSupervisor
from gristmill.structured.spec import named_for


class ClientDisconnected(Exception):
    pass


class EngineServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics, *,
                 supervisor: EngineSupervisor | None = None, limits: ServerLimits | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.supervisor = supervisor
        self.limits = limits or ServerLimits()
        #: The LoRA adapters served by name (None: none).
        self.loras: LoRAModules | None = None

    def rejected(self, exc: Exception):
        """A request that failed before reaching the engine: counted in /metrics as the
        failures inside `run` are, so every failed request shows there once."""
        RequestTimer(self.metrics).failed(exc)
        return self.error_response(exc)

    def error_response(self, exc: BaseException):
        retry_after = self.supervisor.retry_after(exc) if self.supervisor is not None else None
        return exception_response(exc, retry_after)

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model), once the
        engine is up; ModelNotFoundError for a name this server does not serve."""
        lora = self.loras.get(name) if self.loras is not None and name is not None else None
        if name is not None and name != self.model_name and lora is None:
            served = ", ".join(map(repr, [self.model_name, *(self.loras.adapters if self.loras else ())]))
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {served}",
                                     param="model")
        unavailable = self.supervisor.unavailable() if self.supervisor is not None else None
        if unavailable is not None:
            raise unavailable
        dead = self.engine.dead_error
        if dead is not None:
            raise EngineDeadError(dead.message)
        return lora

    # -- running a job --------------------------------------------------------------

    async def whole_response(self, stream: bool | None, make_job, respond) -> dict:
        """The body `respond(job, finals)` gives of the job
        `make_job()` makes (job, prompts, params), run whole, for callers other than HTTP;
        a failure raises its typed error. `stream`: the request asked for a stream (refused)."""
        timer = RequestTimer(self.metrics)
        try:
            if stream:
                raise RequestError("stream=True needs the HTTP server (gristmill serve); this entry point "
                                   "returns whole responses: leave stream out", param="stream")
            job, prompts, params = make_job()
            await self._submit(job, prompts, params, "final")
            timer.num_prompt_tokens = job.prompt_tokens
            try:
                finals = await self._collect(job, timer)
            finally:
                await close_all(job)
        except Exception as exc:
            timer.failed(exc)
            raise
        timer.finished(overall_reason(finals))
        return respond(job, finals)

    async def _submit(self, job: ChatJob, prompts, params: SamplingParams, output_kind: str) -> None:
        """Every prompt of the job into the engine, or none (a failure closes those in).
        `output_kind` "final" for a whole response: nothing is copied per step."""
        try:
            for i, (prompt, special) in enumerate(prompts):
                token_ids = await self.engine.tokenize(prompt, special)  # a long text off the loop
                handle = self.engine.add_request(prompt, params, f"{job.request_id}-{i}",
                                                 add_special_tokens=special,
                                                 max_buffered=self.limits.max_stream_buffer,
                                                 output_kind=output_kind, prompt_token_ids=token_ids,
                                                 chat_prompt=prompt if job.chat else None, lora_request=job.lora)
                job.streams.append(handle)
                job.prompt_tokens += len(handle.prompt_token_ids)
        except Exception:
            await close_all(job)
            raise

    async def run(self, job: ChatJob, prompts, params: SamplingParams, stream: bool, request: Request, *,
                  respond, events):
        """Answer the job: `respond(job, finals)` gives the body of a whole response,
        `events(job, timer)` the SSE text of a stream."""
        timer = RequestTimer(self.metrics)
        try:
            await self._submit(job, prompts, params, "delta" if stream else "final")
        except Exception as exc:
            timer.failed(exc)
            return self.error_response(exc)
        timer.num_prompt_tokens = job.prompt_tokens
        if stream:
            return JobStreamingResponse(job, timer, events(job, timer), media_type="text/event-stream")
        try:
            finals = await until_disconnect(request, self._collect(job, timer))
        except ClientDisconnected:
            timer.disconnected()
            return JSONResponse({}, status_code=499)
        except Exception as exc:
            timer.failed(exc)
            return self.error_response(exc)
        finally:
            await close_all(job)
        timer.finished(overall_reason(finals))
        return JSONResponse(respond(job, finals))

    async def _collect(self, job: ChatJob, timer: RequestTimer) -> list[RequestOutput]:
        """The final outputs of a job's streams (asked for with output_kind "final"); the
        timer gets their tokens at the times they arrived."""
        async def final(handle: RequestStream) -> RequestOutput:
            async for out in handle:
                pass
            return out

        try:
            finals = await asyncio.gather(*(final(h) for h in job.streams))
        except RequestError as exc:  # the core found it invalid (a grammar its tokenizer refuses)
            raise named_for(exc, job.constraint_field) from None
        for at, count in sorted(a for out in finals if out.metrics for a in out.metrics.token_arrivals):
            timer.tokens(count, at)
        return finals


class JobStreamingResponse(StreamingResponse):
    """Closes the job's engine streams even if the body never started (the client left
    before the first byte), when the generator's own `finally` would never run; a stream
    that did not send its last byte is counted as a client disconnect."""

    def __init__(self, job: ChatJob, timer: RequestTimer, content, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job
        self.timer = timer
        self.sent_all = False

    async def stream_response(self, send) -> None:
        await super().stream_response(send)
        self.sent_all = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.sent_all:
                self.timer.disconnected()
            await close_all(self.job)


async def merged_outputs(streams: list[RequestStream]):
    """(stream index, output) of every stream as they arrive. One task per stream moves
    its outputs into a queue of one place each: a stream the consumer has not read yet
    keeps its outputs, so a slow client still overflows `max_buffered` as with one."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, handle: RequestStream) -> None:
        try:
            async for out in handle:
                await queue.put((index, out, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))
        else:
            await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, handle)) for i, handle in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                running -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()


async def close_all(job: ChatJob) -> None:
    for handle in job.streams:
        await handle.aclose()


async def until_disconnect(request: Request, coro):
    """Run `coro`; if the client goes away first, cancel it and raise ClientDisconnected."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        raise ClientDisconnected()
    finally:
        watcher.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
