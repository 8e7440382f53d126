"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), served by
the chat path: the body is mapped onto a chat completion request (messages_protocol), run
as one, and its answer, read by `chat.answer` into pieces, becomes content blocks —
`thinking` (the reasoning), `text`, `tool_use` — in the order the model wrote them, whole
or as Anthropic's stream events (`message_start`, `ping`, `content_block_start` /
`_delta` / `_stop`, `message_delta`, `message_stop`). A whole message is the blocks its
stream would make. Errors go out in Anthropic's envelope (`anthropic_error_body`)."""

from __future__ import annotations

import json
import uuid

from fastapi import Request

from gristmill.chat.answer import CALL_PIECE, REASONING_PIECE, AnswerReader, Piece
from gristmill.server.errors import exception_status_and_body
from gristmill.server.messages_protocol import MESSAGES_PATH, MessagesRequest, messages_error, to_chat_request
from gristmill.server.metrics import RequestTimer
from gristmill.server.openai_serving import OpenAIServing
from gristmill.server.serving import close_all
from gristmill.server.chat_output import ChatJob

#: Anthropic's error type for each HTTP status (others: api_error).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def anthropic_error_body(status: int, openai_body: dict) -> dict:
    """The server's error (OpenAI's envelope) in Anthropic's: {"type": "error", "error":
    {"type", "message"}}."""
    error = openai_body.get("error") or {}
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": error.get("message") or "error"}}


class AnthropicErrors:
    """ASGI middleware: the errors of the Messages API paths in Anthropic's envelope,
    wherever they were made (auth, the gate, validation, the face). Every other path, and
    every answer that is not a JSON error, passes through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(MESSAGES_PATH):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def rewrite(message):
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                if message["status"] >= 400 and headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = message  # (held until its body is whole)
                    return
            elif start is not None and message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                try:
                    payload = json.dumps(anthropic_error_body(start["status"], json.loads(b"".join(body)))).encode()
                except (ValueError, AttributeError):
                    payload = b"".join(body)
                headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(payload)).encode())]})
                await send({"type": "http.response.body", "body": payload})
                return
            await send(message)

        await self.app(scope, receive, rewrite)


class MessagesServing:
    def __init__(self, serving: OpenAIServing):
        """`serving`: the chat endpoint's, which runs the request."""
        self.serving = serving

    async def create(self, body: MessagesRequest, request: Request):
        """The HTTP answer: a whole message, or the stream's events."""
        try:
            job, prompts, params = self._chat_job(body)
        except Exception as exc:  # noqa: BLE001 - answered as the chat endpoint answers it
            return self.serving.rejected(messages_error(exc))
        omit = (body.thinking or {}).get("display") == "omitted"
        return await self.serving.run(job, prompts, params, bool(body.stream), request,
                                      respond=lambda job, finals: self._whole(job, finals, omit),
                                      events=lambda job, timer: self._events(job, timer, omit))

    async def count_tokens(self, body: MessagesRequest) -> dict:
        """{"input_tokens": the tokens of the prompt the chat template renders of `body`}."""
        try:
            chat = to_chat_request(body, self._reasoning_model(), self._template_tools(), count_only=True)
            self.serving.check_model(chat.model)
            job, prompts, _ = self.serving.chat_job(chat)
        except Exception as exc:  # noqa: BLE001 - reworded to name the Messages field
            raise messages_error(exc) from None
        [(text, special)] = prompts
        return {"input_tokens": len(await self.serving.engine.tokenize(text, special))}

    def _reasoning_model(self) -> bool:
        return self.serving.engine.reasoning_parser is not None

    def _template_tools(self) -> bool:
        return self.serving.engine.tool_parser is not None

    def _chat_job(self, body: MessagesRequest):
        return self.serving.chat_job(to_chat_request(body, self._reasoning_model(), self._template_tools()))

    def _whole(self, job: ChatJob, finals, omit_thinking: bool) -> dict:
        [c] = finals[0].outputs
        message = MessageBlocks(job, self.serving.model_name, omit_thinking)
        message.read(c.text, final=True)
        return message.whole(job.prompt_tokens, len(c.token_ids), c.finish_reason, c.stop_reason)

    async def _events(self, job: ChatJob, timer: RequestTimer, omit_thinking: bool):
        message = MessageBlocks(job, self.serving.model_name, omit_thinking)
        output_tokens, finish_reason, stop_reason = 0, None, None
        try:
            yield event("message_start", {"message": message.shell(job.prompt_tokens)})
            yield event("ping", {})
            async for out in job.streams[0]:
                for c in out.outputs:
                    output_tokens += len(c.token_ids)
                    timer.tokens(len(c.token_ids))
                    finish_reason, stop_reason = c.finish_reason or finish_reason, c.stop_reason or stop_reason
                    for name, data in message.read(c.delta_text, final=c.finish_reason is not None):
                        yield event(name, data)
            for name, data in message.close_block():
                yield event(name, data)
            reason, sequence = message.stop_reason(finish_reason, stop_reason)
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"output_tokens": output_tokens}})
            yield event("message_stop", {})
            timer.finished("length" if finish_reason == "length" else "stop")
        except Exception as exc:  # noqa: BLE001 - the stream started: it ends with one error event
            timer.failed(exc)
            status, body, _ = exception_status_and_body(messages_error(exc))
            yield event("error", anthropic_error_body(status, body))
        finally:
            await close_all(job)


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class MessageBlocks:
    """The content blocks of one answer, as its text arrives (`read`): each call gives the
    stream events of what it decided, and the blocks so far are kept for the whole message.
    `omit_thinking` (thinking.display "omitted"): thinking blocks without their text."""

    def __init__(self, job: ChatJob, model_name: str, omit_thinking: bool = False):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model_name = model_name
        self.omit_thinking = omit_thinking
        self.reader = AnswerReader(job.reasoning_parser, job.prompt_text, job.tools)
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the block being written
        self.arguments = ""  # the open tool_use block's input, as JSON text

    def shell(self, input_tokens: int) -> dict:
        """The message as `message_start` carries it: no content yet."""
        return {"id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model_name,
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0}}

    def read(self, text: str, final: bool) -> list[tuple[str, dict]]:
        pieces = self.reader.feed(text) + (self.reader.finish() if final else [])
        events: list[tuple[str, dict]] = []
        for piece in pieces:
            events += self._piece(piece)
        return events

    def _piece(self, piece: Piece) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if piece.kind == CALL_PIECE:
            if piece.id is not None:  # a new call: its block
                events += self.close_block()
                block = {"type": "tool_use", "id": "toolu_" + piece.id.removeprefix("call_"), "name": piece.name,
                         "input": {}}
                events += self._open(block)
            if piece.text:
                self.arguments += piece.text
                events.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                       "delta": {"type": "input_json_delta",
                                                                 "partial_json": piece.text}}))
            return events
        kind = "thinking" if piece.kind == REASONING_PIECE else "text"
        if kind == "thinking" and self.omit_thinking:
            piece = Piece(piece.kind, "")
        if self.open is None or self.open["type"] != kind:
            events += self.close_block()
            events += self._open({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                 else {"type": "text", "text": ""})
        self.open[kind] += piece.text
        if not piece.text:
            return events
        delta = {"type": "thinking_delta", "thinking": piece.text} if kind == "thinking" \
            else {"type": "text_delta", "text": piece.text}
        events.append(("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta}))
        return events

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        self.open = block
        self.blocks.append(block)
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [("content_block_start", {"index": len(self.blocks) - 1, "content_block": start})]

    def close_block(self) -> list[tuple[str, dict]]:
        """The end of the block being written, if any."""
        if self.open is None:
            return []
        if self.open["type"] == "tool_use":
            self.open["input"] = json.loads(self.arguments) if self.arguments else {}
            self.arguments = ""
        self.open = None
        return [("content_block_stop", {"index": len(self.blocks) - 1})]

    def stop_reason(self, finish_reason: str | None, stop_reason) -> tuple[str, str | None]:
        """(Anthropic's stop_reason, stop_sequence) of the engine's finish and stop reasons."""
        reason = self.reader.finish_reason(finish_reason)
        if reason == "stop" and isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        return _STOP_REASONS.get(reason, "end_turn"), None

    def whole(self, input_tokens: int, output_tokens: int, finish_reason, stop_reason) -> dict:
        self.close_block()
        reason, sequence = self.stop_reason(finish_reason, stop_reason)
        return {**self.shell(input_tokens), "content": self.blocks, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

