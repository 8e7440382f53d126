"""Responses API output: the `response` object and its output items, built from the
model's answer as `chat.answer` reads it (typed pieces in the order it wrote them), and
the stream's events, in the order the `openai`
client's `responses.stream` reads them.

One rule makes the items, whole or streamed (a whole response is the items its stream
would make): the reasoning (on a model with a reasoning parser) is a `reasoning` item,
each run of text a `message` item, each call a `function_call` item, in the order the
model wrote them; text after a call starts without the whitespace between them, and an
item with nothing in it is left out.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator

from gristmill.chat.answer import CALL_PIECE, REASONING_PIECE, Piece
from gristmill.server.errors import exception_status_and_body
from gristmill.server.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """The model's reasoning, whole, as a `reasoning_text` content part (no summary is made)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseShape:
    """The response object of one request: its id, the request fields it echoes, and its
    usage (`count_tokens(text)`: the tokens of a text, for the reasoning's count)."""

    def __init__(self, body: ResponsesRequest, model_name: str, count_tokens: Callable[[str], int]):
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model_name = model_name
        self.count_tokens = count_tokens
        self.echo = {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                     "parallel_tool_calls": body.parallel_tool_calls is not False,
                     "temperature": body.temperature, "top_p": body.top_p,
                     "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
                     "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
                     "reasoning": body.reasoning, "metadata": (body.model_extra or {}).get("metadata"),
                     "store": False, "previous_response_id": None, "truncation": "disabled", "background": False}

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model_name, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, **self.echo}

    def usage(self, prompt_tokens: int, output_tokens: int, output: list[dict]) -> dict:
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning"
                            for part in item["content"])
        return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
                "total_tokens": prompt_tokens + output_tokens}

    def whole(self, pieces: list[Piece], prompt_tokens: int, output_tokens: int, finish_reason: str | None) -> dict:
        """The response of a whole answer: its `pieces` in order, made into items as a
        stream of them would be (its events dropped)."""
        events = OutputEvents(self)
        deque(events.feed(pieces), maxlen=0)
        deque(events.finish(prompt_tokens, output_tokens, finish_reason), maxlen=0)
        return events.final


class OutputEvents:
    """The SSE events of a streamed response, fed the answer's pieces; `items` are the
    output items finished so far."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.items: list[dict] = []
        self.sequence_number = 0
        #: The item being written: its kind ("reasoning", "message", "function_call"),
        #: id and text (a call's arguments), and a call's chat index, call_id and name.
        self.open: dict | None = None
        #: The whole response, once `finish` has run.
        self.final: dict | None = None

    def event(self, type_: str, **fields) -> str:
        payload = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> Iterator[str]:
        response = self.shape.response("in_progress", [], None)
        yield self.event("response.created", response=response)
        yield self.event("response.in_progress", response=response)

    def feed(self, pieces: list[Piece]) -> Iterator[str]:
        """The events of the answer's next pieces (reasoning, content, calls)."""
        for piece in pieces:
            if piece.kind == CALL_PIECE:
                yield from self._call(piece)
            elif piece.text:
                yield from self._text("reasoning" if piece.kind == REASONING_PIECE else "message", piece.text)

    def finish(self, prompt_tokens: int, output_tokens: int, finish_reason: str | None) -> Iterator[str]:
        status = "incomplete" if finish_reason == "length" else "completed"
        yield from self._close(status)
        usage = self.shape.usage(prompt_tokens, output_tokens, self.items)
        self.final = self.shape.response(status, self.items, usage)
        yield self.event(f"response.{status}", response=self.final)

    def error(self, exc: BaseException) -> str:
        """The `error` event a stream that failed after it started ends with."""
        _, body, _ = exception_status_and_body(exc)
        error = body["error"]
        return self.event("error", code=str(error["code"]) if error["code"] is not None else None,
                          message=error["message"], param=error["param"])

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _text(self, kind: str, text: str) -> Iterator[str]:
        if kind == "message" and (self.open or {}).get("kind") == "function_call":
            text = text.lstrip()  # (the whitespace between a call and the text after it)
            if not text:
                return
        if self.open is None or self.open["kind"] != kind:
            yield from self._close("completed")
            self.open = {"kind": kind, "id": new_id("rs" if kind == "reasoning" else "msg"), "text": ""}
            item = (reasoning_item if kind == "reasoning" else message_item)(self.open["id"], "", "in_progress")
            item["content"] = []
            yield self.event("response.output_item.added", output_index=len(self.items), item=item)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
            yield self.event("response.content_part.added", **self._where(), content_index=0, part=part)
        self.open["text"] += text
        if kind == "reasoning":
            yield self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        else:
            yield self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                             logprobs=[])

    def _call(self, piece: Piece) -> Iterator[str]:
        if self.open is None or self.open.get("index") != piece.index:
            yield from self._close("completed")
            self.open = {"kind": "function_call", "id": new_id("fc"), "text": "", "index": piece.index,
                         "call_id": piece.id, "name": piece.name}
            item = call_item(self.open["id"], piece.id, piece.name, "", "in_progress")
            yield self.event("response.output_item.added", output_index=len(self.items), item=item)
        if piece.text:
            self.open["text"] += piece.text
            yield self.event("response.function_call_arguments.delta", **self._where(), delta=piece.text)

    def _close(self, status: str) -> Iterator[str]:
        """The events that finish the open item (with `status`), if one is open."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.items)}
        text = item["text"]
        if item["kind"] == "function_call":
            yield self.event("response.function_call_arguments.done", **where, arguments=text)
            done = call_item(item["id"], item["call_id"], item["name"], text, status)
        elif item["kind"] == "reasoning":
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            done = reasoning_item(item["id"], text, status)
        else:
            yield self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            done = message_item(item["id"], text, status)
        if item["kind"] != "function_call":
            yield self.event("response.content_part.done", **where, content_index=0, part=done["content"][0])
        self.items.append(done)
        yield self.event("response.output_item.done", output_index=where["output_index"], item=done)
