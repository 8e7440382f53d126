"""A chat answer, read once for every face (chat completions, Responses, Anthropic's
Messages, `LLM.chat`, batch rows): the model's text in, typed pieces out — its reasoning
(on a model with a reasoning parser), its content and its tool calls, in the order it
wrote them — and the finish reason ("tool_calls" when it stopped after calling).

`AnswerReader` reads a stream (`feed` each new text, then `finish`); `read_answer` reads a
whole answer by the same stream, so a whole answer is always the same pieces as its
stream. Text that may begin `</think>` or a call waits in the reader until decided.
`constrain` puts a chat's tool constraint on its sampling params, as every face does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gristmill.chat.call_text import ToolCall, ToolDelta
from gristmill.chat.reasoning import CONTENT, REASONING, ReasoningParser
from gristmill.chat.tool_choice import ToolRequest

REASONING_PIECE, CONTENT_PIECE, CALL_PIECE = REASONING, CONTENT, "call"


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of an answer. `kind` "reasoning" or "content": `text`. `kind` "call": a piece
    of call `index`: its first has `id` and `name` (`text` ""), later ones carry more of
    its arguments' JSON in `text`."""

    kind: str
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None

    def openai_call(self) -> dict:
        """A call piece as an entry of an OpenAI `delta.tool_calls` list."""
        return ToolDelta(index=self.index, id=self.id, name=self.name, arguments=self.text).openai()


@dataclass(slots=True)
class Answer:
    """A whole answer: `reasoning` (None when it had none), `content` (the text outside
    calls; with no calls, the answer as written), `calls` with their `call_ids`, the
    finish reason, and `error`: why some would-be call stayed text."""

    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class AnswerReader:
    """The reading of one answer as it streams. `reasoning`: the engine's reasoning parser
    (None: the answer is all content); `prompt_text`: the rendered prompt (whether the
    template opened or closed the reasoning); `tools`: the chat's tool request (None, or
    choice "none": no calls are read)."""

    def __init__(self, reasoning: ReasoningParser | None, prompt_text: str | None, tools: ToolRequest | None):
        self._reasoning = reasoning.stream(prompt_text) if reasoning is not None else None
        parser = tools.parser if tools is not None else None
        self._calls = parser.stream() if parser is not None else None
        self._raw_content: list[str] = []
        self.call_ids: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls.calls if self._calls is not None else []

    @property
    def error(self) -> str | None:
        return self._calls.error if self._calls is not None else None

    @property
    def reasoning_started(self) -> bool:
        return self._reasoning is not None and self._reasoning.reasoning_started

    def feed(self, text: str) -> list[Piece]:
        return self._read(text, final=False)

    def finish(self) -> list[Piece]:
        """The pieces still held back: the answer ended."""
        return self._read("", final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        """The answer's finish reason: "tool_calls" when the model stopped after calling."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _read(self, text: str, final: bool) -> list[Piece]:
        if self._reasoning is None:
            split = [(CONTENT, text)] if text else []
        else:
            deltas = self._reasoning.feed(text) + (self._reasoning.finish() if final else [])
            split = [(d.field, d.text) for d in deltas]
        pieces = [Piece(REASONING_PIECE, t) for f, t in split if f == REASONING]
        content = "".join(t for f, t in split if f == CONTENT)
        self._raw_content.append(content)
        if self._calls is None:
            return pieces + ([Piece(CONTENT_PIECE, content)] if content else [])
        found = self._calls.feed(content) + (self._calls.finish() if final else [])
        for d in found:
            if d.index is None:
                pieces.append(Piece(CONTENT_PIECE, d.content))
            else:
                if d.id is not None:
                    self.call_ids.append(d.id)
                pieces.append(Piece(CALL_PIECE, d.arguments or "", d.index, d.id, d.name))
        return pieces

    def answer(self, pieces: list[Piece], finish_reason: str | None) -> Answer:
        """The whole answer of all the `pieces` this reader gave."""
        reasoning = "".join(p.text for p in pieces if p.kind == REASONING_PIECE)
        content = "".join(p.text for p in pieces if p.kind == CONTENT_PIECE) if self.calls \
            else "".join(self._raw_content)
        return Answer(reasoning if self.reasoning_started else None, content, list(self.calls),
                      list(self.call_ids), self.finish_reason(finish_reason), self.error)


def read_answer(text: str, finish_reason: str | None, reasoning: ReasoningParser | None,
                prompt_text: str | None, tools: ToolRequest | None) -> Answer:
    """A whole answer, read as one stream (the same pieces as streaming it would give)."""
    reader = AnswerReader(reasoning, prompt_text, tools)
    return reader.answer(reader.feed(text) + reader.finish(), finish_reason)


def merged(pieces: list[Piece]) -> list[Piece]:
    """`pieces` with consecutive reasoning or content pieces joined."""
    out: list[Piece] = []
    for piece in pieces:
        if out and piece.kind != CALL_PIECE and out[-1].kind == piece.kind:
            out[-1] = Piece(piece.kind, out[-1].text + piece.text)
        else:
            out.append(piece)
    return out


def constrain(params, tools: ToolRequest | None, field: str = "sampling_params.structured_output"):
    """`params` (SamplingParams) with the chat's tool constraint: a forced call's grammar,
    or under "auto" the grammar that holds once a call starts; a forced call and a
    constraint the params give the answer already are a RequestError (send one of them);
    under "auto" the answer's own constraint wins. `field` names where the params'
    constraint came from, for the error. No tools: `params` as they are."""
    if tools is None or tools.parser is None:
        return params
    constraint, _ = tools.answer_constraint(params.structured_output, field)
    return params.clone(structured_output=constraint)
