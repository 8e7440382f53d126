"""`POST /v1/responses`, stateless, served by the chat path: the request is mapped onto a
chat completion request (responses_protocol), run as one, and its answer reshaped
into a `response` object or the Responses stream's events (responses_output)."""

from __future__ import annotations

from fastapi import Request

from gristmill.server.metrics import RequestTimer
from gristmill.server.openai_serving import OpenAIServing, close_all
from gristmill.server.responses import ChoiceStates, Job
from gristmill.server.responses_output import OutputEvents, ResponseShape
from gristmill.server.responses_protocol import ResponsesRequest, responses_error, to_chat_request


class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        """`serving`: the chat endpoint's, which runs the request."""
        self.serving = serving

    async def create(self, body: ResponsesRequest, request: Request):
        try:
            chat = to_chat_request(body)
            job, prompts, params = self.serving.chat_job(chat)
        except Exception as exc:  # noqa: BLE001 - answered as the chat endpoint answers it
            return self.serving.rejected(responses_error(exc))
        if job.constraint_field == "response_format":
            job.constraint_field = "text.format"
        tokenizer = self.serving.engine.tokenizer
        shape = ResponseShape(body, self.serving.model_name,
                              lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
        return await self.serving.run(job, prompts, params, chat.stream, request,
                                      respond=lambda job, finals: shape.whole(self.serving.writer.response(job, finals)),
                                      events=lambda job, timer: self._events(shape, job, timer))

    async def _events(self, shape: ResponseShape, job: Job, timer: RequestTimer):
        """The stream of the job's one choice, as Responses events."""
        events = OutputEvents(shape)
        choices = ChoiceStates(1, 1)
        output_tokens, finish_reason = 0, None
        try:
            for event in events.start():
                yield event
            async for out in job.streams[0]:
                for c in out.outputs:
                    output_tokens += len(c.token_ids)
                    timer.tokens(len(c.token_ids))
                    chunk = self.serving.writer.delta_chunk(job, 0, c, choices)
                    if chunk is None:
                        continue
                    choice = chunk["choices"][0]
                    finish_reason = choice["finish_reason"] or finish_reason
                    for event in events.feed(choice["delta"]):
                        yield event
            for event in events.finish(job.prompt_tokens, output_tokens, finish_reason):
                yield event
            timer.finished("length" if finish_reason == "length" else "stop")
        except Exception as exc:  # noqa: BLE001 - the stream started: it ends with one error event
            timer.failed(exc)
            yield events.error(responses_error(exc))
        finally:
            await close_all(job)
