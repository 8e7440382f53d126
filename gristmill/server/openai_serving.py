"""/v1/completions and /v1/chat/completions over the AsyncEngine (the run of a job:
`serving`). A stream that fails after it started sends one SSE error event, then
`data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import time
import uuid

from fastapi import Request

from gristmill.chat.tool_choice import tool_request
from gristmill.engine.async_engine import AsyncEngine
from gristmill.errors import RequestError
from gristmill.openai_fields import sampling_kwargs
from gristmill.outputs import RequestOutput
from gristmill.pooling_tasks import check_generates
from gristmill.sampling import SamplingParams
from gristmill.server.chat_output import ChatJob, ChoiceStates, ResponseWriter, overall_reason, sse, usage
from gristmill.server.errors import error_event
from gristmill.server.limits import ServerLimits, check_chat, check_common, check_completion
from gristmill.server.metrics import RequestTimer, ServerMetrics
from gristmill.server.protocol import CHAT_PATH, COMPLETIONS_PATH, ChatCompletionRequest, CompletionRequest
from gristmill.server.serving import EngineServing, close_all, merged_outputs
from gristmill.server.supervisor import EngineSupervisor
from gristmill.structured.spec import named_for, openai_constraint
from gristmill.tokenizer import render_chat, token_bytes


class OpenAIServing(EngineServing):
    """/v1/completions and /v1/chat/completions: the jobs of their bodies and their
    OpenAI responses (chat_output); the other generation faces (Responses, Messages)
    make a chat job here and shape its answer themselves."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics, *,
                 supervisor: EngineSupervisor | None = None, limits: ServerLimits | None = None):
        super().__init__(engine, model_name, metrics, supervisor=supervisor, limits=limits)
        self.writer = ResponseWriter(model_name,
                                     lambda token_id, text: token_bytes(self.engine.tokenizer, token_id, text),
                                     lambda token_id: self.engine.tokenizer.decode([token_id]),
                                     frozenset(engine.tokenizer.all_special_ids))

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
        return await self.run(job, prompts, params, body.stream, request, respond=self.writer.response,
                              events=self._stream)

    def _check_limits(self, body) -> None:
        check_common(body, self.limits, self.engine.config.max_num_seqs, self.engine.max_model_len)

    def _completion_job(self, body: CompletionRequest):
        lora = self.check_model(body.model)
        check_generates(self.engine.capacity, COMPLETIONS_PATH)
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
        job = ChatJob(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.n, body.logprobs is not None,
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
        check_generates(self.engine.capacity, CHAT_PATH)
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
        job = ChatJob(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.n, body.logprobs,
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
        return await self.whole_response(body.stream, lambda: (self.chat_job if chat else self._completion_job)(body),
                                         self.writer.response)

    async def _stream(self, job: ChatJob, timer: RequestTimer):
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


def _continuous_usage(body) -> bool:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    (with include_usage, as vLLM has it)."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)
