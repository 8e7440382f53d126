"""/v1/completions and /v1/chat/completions over the AsyncEngine.

Every prompt of a request is validated and submitted before any byte is sent, so
validation errors come back as plain HTTP errors; once a stream started, a failure is
one SSE error event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gristmill.chat.tool_choice import tool_request
from gristmill.engine.async_engine import AsyncEngine, RequestStream
from gristmill.errors import EngineDeadError, RequestError
from gristmill.lora import LoRARequest
from gristmill.openai_fields import sampling_kwargs
from gristmill.structured.spec import named_for, openai_constraint
from gristmill.tokenizer import render_chat, token_bytes
from gristmill.outputs import RequestOutput
from gristmill.sampling import SamplingParams
from gristmill.server.errors import ModelNotFoundError, error_event, exception_response
from gristmill.server.limits import ServerLimits, check_chat, check_common, check_completion
from gristmill.server.lora_modules import LoRAModules
from gristmill.server.metrics import RequestTimer, ServerMetrics
from gristmill.server.protocol import CHAT_PATH, COMPLETIONS_PATH, ChatCompletionRequest, CompletionRequest
from gristmill.server.responses import ChoiceStates, Job, ResponseWriter, overall_reason, sse, usage
from gristmill.server.supervisor import EngineSupervisor


class ClientDisconnected(Exception):
    pass


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics, *,
                 supervisor: EngineSupervisor | None = None, limits: ServerLimits | None = None):
        self.engine = engine
        self.model_name = model_name
        self.writer = ResponseWriter(model_name,
                                     lambda token_id, text: token_bytes(self.engine.tokenizer, token_id, text),
                                     lambda token_id: self.engine.tokenizer.decode([token_id]),
                                     frozenset(engine.tokenizer.all_special_ids))
        self.metrics = metrics
        self.supervisor = supervisor
        self.limits = limits or ServerLimits()
        #: The LoRA adapters served by name (None: none).
        self.loras: LoRAModules | None = None

    # -- entry points ---------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(self._completion_job, body, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._serve(self.chat_job, body, request)

    async def _serve(self, make_job, body, request: Request):
        try:
            job, prompts, params = make_job(body)
        except Exception as exc:  # noqa: BLE001 - answered like a failure inside run
            return self.rejected(exc)
        return await self.run(job, prompts, params, body.stream, request)

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

    def _check_generates(self, path: str) -> None:
        task = self.engine.capacity.task
        if task != "generate":
            endpoints = {"embed": "/v1/embeddings, /v1/score, /v1/rerank", "classify": "/v1/classify",
                         "score": "/v1/score, /v1/rerank"}[task]
            raise RequestError(f"{path} needs an engine that generates text; this server runs task {task!r}: send "
                               f"{endpoints} requests, or serve a generative model", param="task")

    def _check_limits(self, body) -> None:
        check_common(body, self.limits, self.engine.config.max_num_seqs, self.engine.max_model_len)

    def _completion_job(self, body: CompletionRequest):
        lora = self.check_model(body.model)
        self._check_generates(COMPLETIONS_PATH)
        self._check_limits(body)
        check_completion(body, self.limits)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("prompt is empty; send a string, a list of strings or token ids",
                               param="prompt")
        echo_logprobs = body.echo and body.logprobs is not None
        if echo_logprobs and body.stream:
            raise RequestError("echo with logprobs returns the prompt's logprobs, known once the whole prompt is "
                               "computed, and is not streamed; send it with stream off", param="echo")
        prompt_only = body.max_tokens == 0
        if prompt_only and body.stream:
            raise RequestError("max_tokens 0 returns the prompt alone, with its logprobs; send it with stream off",
                               param="max_tokens")
        if prompt_only and not body.echo:
            raise RequestError("max_tokens 0 generates nothing, so it needs echo (with logprobs: the prompt's "
                               "scores); send max_tokens >= 1, or echo: true", param="max_tokens")
        # (max_tokens 0: the engine makes one token, which the response leaves out)
        max_tokens = 1 if prompt_only else 16 if body.max_tokens is None else body.max_tokens
        params, field = self._params(body, max_tokens, body.logprobs)
        if echo_logprobs:  # the prompt's own, as OpenAI's legacy completions return them
            params = params.clone(prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
        job = Job(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.n, body.logprobs is not None,
                   bool(body.stream_options and body.stream_options.include_usage), body.logprobs or 0,
                   constraint_field=field, continuous_usage=_continuous_usage(body))
        job.return_token_ids = body.return_token_ids
        job.prompt_only, job.echo_logprobs, job.prompt_logprobs = prompt_only, echo_logprobs, body.prompt_logprobs
        if body.echo:
            job.echo_texts = [self._prompt_text(p) for p in prompts]
        job.lora = lora
        return job, [(p, body.add_special_tokens) for p in prompts], params

    def chat_job(self, body: ChatCompletionRequest):
        lora = self.check_model(body.model)
        self._check_generates(CHAT_PATH)
        self._check_limits(body)
        check_chat(body, self.limits)
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, self.engine.tool_parser)
        messages = [m.model_dump() for m in body.messages]
        text = render_chat(self.engine.tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           template_kwargs=body.chat_template_kwargs, tools=tools and tools.tools)
        # None, as vLLM: whatever room the context leaves (counted where the prompt is tokenized).
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params, field = self._params(body, max_tokens, top, tools)
        job = Job(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.n, body.logprobs,
                   bool(body.stream_options and body.stream_options.include_usage), top or 0,
                   constraint_field=field, continuous_usage=_continuous_usage(body))
        job.return_token_ids = body.return_token_ids
        job.prompt_logprobs = body.prompt_logprobs
        job.reasoning_parser, job.prompt_text = self.engine.reasoning_parser, text
        job.tools, job.lora = tools, lora
        return job, [(text, body.add_special_tokens)], params

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """The prompt as echo returns it: token ids are decoded as the engine reads them."""
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)

    def _params(self, body, max_tokens: int | None, logprobs: int | None,
                tools=None) -> tuple[SamplingParams, str | None]:
        """The request's SamplingParams, and the field its constraint came from; `tools`:
        a chat's ToolRequest, whose calls' grammar is the constraint."""
        unsupported = body.unsupported_field()
        if unsupported == "extra_body":
            raise RequestError("extra_body is the openai client's keyword argument, not a field: send its fields "
                               "(structured_outputs, top_k, ...) at the top level of the body", param="extra_body")
        if unsupported is not None:
            raise RequestError(f"{unsupported} would change the output and is not supported by this server; "
                               f"leave it out", param=unsupported)
        if body.prompt_logprobs is not None and body.stream:
            raise RequestError("prompt_logprobs come with a whole response, not a stream; send it with stream off",
                               param="prompt_logprobs")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        structured, field = openai_constraint(body.response_format, body.structured_outputs)
        if tools is not None:
            structured, field = tools.answer_constraint(structured, field)
        try:
            return SamplingParams(**sampling_kwargs(body), max_tokens=max_tokens, logprobs=logprobs,
                                  structured_output=structured), field
        except RequestError as exc:
            raise named_for(exc, field) from None

    # -- running a job --------------------------------------------------------------

    async def response(self, chat: bool, body) -> dict:
        """The response body of a non-streamed chat or completions request, for callers
        other than HTTP (a Ray Serve deployment): a failure raises its typed error instead."""
        return await self.whole_response(body.stream, lambda: (self.chat_job if chat else self._completion_job)(body))

    async def whole_response(self, stream: bool | None, make_job, respond=None) -> dict:
        """The body `respond(job, finals)` gives (default: a chat or completion) of the job
        `make_job()` makes (job, prompts, params), run whole, for callers other than HTTP;
        a failure raises its typed error. `stream`: the request asked for a stream (refused)."""
        respond = respond or self.writer.response
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

    async def _submit(self, job: Job, prompts, params: SamplingParams, output_kind: str) -> None:
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

    async def run(self, job: Job, prompts, params: SamplingParams, stream: bool, request: Request, *,
                  respond=None, events=None):
        """Answer the job: `respond(job, finals)` gives the body of a whole response
        (default: a chat or completion), `events(job, timer)` the SSE text of a stream."""
        respond = respond or self.writer.response
        events = events or self._stream
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

    async def _collect(self, job: Job, timer: RequestTimer) -> list[RequestOutput]:
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

    async def _stream(self, job: Job, timer: RequestTimer):
        finals: list[RequestOutput] = []
        completion_tokens = 0

        def event(chunk: dict) -> str:
            if job.continuous_usage:
                chunk["usage"] = usage(job, completion_tokens)
            return sse(chunk)

        try:
            if job.chat:
                for i in range(job.n):
                    yield event(self.writer.chunk(job, i, {"role": "assistant", "content": ""}, None, None))
            if job.echo_texts is not None:  # the prompt opens each choice's text
                for prompt_index, text in enumerate(job.echo_texts):
                    for i in range(job.n):
                        yield event(self.writer.chunk(job, prompt_index * job.n + i, text, None, None))
            choices = ChoiceStates(len(job.streams), job.n)
            # "delta" outputs (only what is new) of all the prompts, as they come: every
            # prompt generates at once, so none may wait for another's end.
            async with contextlib.aclosing(merged_outputs(job.streams)) as merged:
                async for prompt_index, out in merged:
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        timer.tokens(len(c.token_ids))
                        chunk = self.writer.delta_chunk(job, prompt_index, c, choices)
                        if chunk is not None:
                            yield event(chunk)
                    if out.finished:
                        finals.append(out)
            if job.include_usage:
                totals = usage(job, completion_tokens)
                yield sse({**self.writer.envelope(job, chunk=True), "choices": [], "usage": totals})
            timer.finished(overall_reason(finals))
        except Exception as exc:  # noqa: BLE001 - the stream started: one error event, then [DONE]
            timer.failed(exc)
            yield error_event(named_for(exc, job.constraint_field) if isinstance(exc, RequestError) else exc)
        finally:
            await close_all(job)
        yield "data: [DONE]\n\n"


class JobStreamingResponse(StreamingResponse):
    """Closes the job's engine streams even if the body never started (the client left
    before the first byte), when the generator's own `finally` would never run; a stream
    that did not send its last byte is counted as a client disconnect."""

    def __init__(self, job: Job, timer: RequestTimer, content, **kwargs):
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


async def close_all(job: Job) -> None:
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


def _continuous_usage(body) -> bool:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    (with include_usage, as vLLM has it)."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)
