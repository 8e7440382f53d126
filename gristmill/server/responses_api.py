"""`POST /v1/responses`, stateless, served by the chat path: the request is mapped onto a
chat completion request (responses_protocol), run as one, and its answer, read into
pieces by `chat.answer`, shaped into a `response` object or the Responses stream's events
(responses_output): over HTTP
(`create`), or whole for other callers (`response`: a Ray Serve deployment)."""

from __future__ import annotations

from fastapi import Request

from gristmill.server.metrics import RequestTimer
from gristmill.server.openai_serving import OpenAIServing
from gristmill.server.serving import close_all
from gristmill.chat.answer import AnswerReader
from gristmill.server.chat_output import ChatJob
from gristmill.server.responses_output import OutputEvents, ResponseShape
from gristmill.server.responses_protocol import ResponsesRequest, responses_error, to_chat_request


class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        """`serving`: the chat endpoint's, which runs the request."""
        self.serving = serving

    async def create(self, body: ResponsesRequest, request: Request):
        """The HTTP answer: a whole response, or the stream's events."""
        try:
            job, prompts, params = self._chat_job(body)
        except Exception as exc:  # noqa: BLE001 - answered as the chat endpoint answers it
            return self.serving.rejected(responses_error(exc))
        shape = self._shape(body)
        return await self.serving.run(job, prompts, params, bool(body.stream), request,
                                      respond=lambda job, finals: self._whole(shape, job, finals),
                                      events=lambda job, timer: self._events(shape, job, timer))

    async def response(self, body: ResponsesRequest) -> dict:
        """The whole response, for callers other than HTTP (a Ray Serve deployment): a
        failure raises its typed error, naming the Responses field."""
        shape = self._shape(body)
        try:
            return await self.serving.whole_response(body.stream, lambda: self._chat_job(body),
                                                     lambda job, finals: self._whole(shape, job, finals))
        except Exception as exc:  # noqa: BLE001 - re-raised, reworded
            raise responses_error(exc) from None

    def _chat_job(self, body: ResponsesRequest):
        """(job, prompts, params) of the chat completion that answers `body`."""
        job, prompts, params = self.serving.chat_job(to_chat_request(body))
        if job.constraint_field == "response_format":
            job.constraint_field = "text.format"
        return job, prompts, params

    def _shape(self, body: ResponsesRequest) -> ResponseShape:
        tokenizer = self.serving.engine.tokenizer
        return ResponseShape(body, self.serving.model_name,
                             lambda text: len(tokenizer.encode(text, add_special_tokens=False)))

    @staticmethod
    def _whole(shape: ResponseShape, job: ChatJob, finals) -> dict:
        """The response of the job's one choice, whole."""
        [c] = finals[0].outputs
        reader = AnswerReader(job.reasoning_parser, job.prompt_text, job.tools)
        return shape.whole(reader.feed(c.text) + reader.finish(), job.prompt_tokens, len(c.token_ids),
                           c.finish_reason)

    async def _events(self, shape: ResponseShape, job: ChatJob, timer: RequestTimer):
        """The stream of the job's one choice, as Responses events."""
        events = OutputEvents(shape)
        reader = AnswerReader(job.reasoning_parser, job.prompt_text, job.tools)
        output_tokens, finish_reason = 0, None
        try:
            for event in events.start():
                yield event
            async for out in job.streams[0]:
                for c in out.outputs:
                    output_tokens += len(c.token_ids)
                    timer.tokens(len(c.token_ids))
                    pieces = reader.feed(c.delta_text) + (reader.finish() if c.finish_reason is not None else [])
                    for event in events.feed(pieces):
                        yield event
                    finish_reason = c.finish_reason or finish_reason
            for event in events.finish(job.prompt_tokens, output_tokens, finish_reason):
                yield event
            timer.finished("length" if finish_reason == "length" else "stop")
        except Exception as exc:  # noqa: BLE001 - the stream started: it ends with one error event
            timer.failed(exc)
            yield events.error(responses_error(exc))
        finally:
            await close_all(job)
