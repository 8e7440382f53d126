"""What every tool-call format shares: a parsed call (`ToolCall`), what the head of an
undecided text is (`Step`), and the incremental parse of one answer (`ToolCallStream`) that
turns a format's steps into content and call deltas.

The contract, whole and streamed alike (a whole answer runs the stream on all its text):
- a call is reported only once it is whole and parses: its name, and its arguments as a
  JSON object. A would-be call that does not parse (bad JSON, no name, a pythonic value
  that is not a literal, never closed) is never a call: its text stays in the content and
  `error` says why;
- content is the text outside calls, less the separators between calls (`;`,
  `<|python_end|>`); the whitespace around a run of calls is kept only between content
  before and after it, as the whitespace before the run ("A\n<call>\nB" -> "A\nB",
  "A\n<call>" -> "A", "<call>\nB" -> "B");
- streaming: `feed(delta_text)` returns `ToolDelta`s, `finish()` the rest. Text that may be
  the start of a call marker waits until decided; a call's deltas come when it is whole:
  one with its `index`, a new `id` and its `name` (arguments ""), then its arguments as
  JSON text. Any split of the text into deltas gives the same content, calls and errors.
A format never decides trailing whitespace while a call may still follow it: whitespace
before a call belongs to the call's step.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gristmill.chat.markers import undecided_tail


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Step:
    """What the first `size` undecided characters are. `kind`: "content" (text outside
    calls), "calls" (`calls`, whitespace before them included), "malformed" (a would-be
    call: its text is content, `error` says why). With `rest_is_content` the rest of the
    output is content too: after a malformed call whose end cannot be known, or an answer
    that turned out not to be a call."""

    kind: str
    size: int
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    rest_is_content: bool = False


class Malformed(ValueError):
    """A would-be call that is not one; the message says why."""


def content_before(text: str, marker: str, final: bool) -> Step | None:
    """The content at the head of `text` up to a call `marker` (or the end), less the
    whitespace before the marker and what may yet become one; None when nothing is decided."""
    cut = text.find(marker)
    if cut < 0 and final:
        return Step("content", len(text)) if text else None
    if cut < 0:
        cut = len(text) - undecided_tail(text, (marker,))
    cut = len(text[:cut].rstrip())  # whitespace that may touch a call waits
    return Step("content", cut) if cut else None


def call_from_object(value, arguments_keys: tuple[str, ...]) -> ToolCall:
    """A decoded `{"name": ..., <arguments key>: {...}}` -> ToolCall; arguments given as a
    JSON string of an object are taken too."""
    if not isinstance(value, dict):
        raise Malformed(f"a call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise Malformed('a call needs a "name" string')
    key = next((k for k in arguments_keys if k in value), None)
    arguments = value[key] if key else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise Malformed(f"the arguments of {name} are a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise Malformed(f"the arguments of {name} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


def not_a_call(text: str, tagged: bool, error: str) -> Step:
    """The rest of the output, as content: a malformed call after a tag, else plain content."""
    if tagged:
        return Step("malformed", len(text), error=error, rest_is_content=True)
    return Step("content", len(text), rest_is_content=True)


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    """A whole answer: its `content` (text outside calls, malformed calls included), its
    `calls` in order, and `error`: why some would-be call is content, or None."""

    content: str
    calls: list[ToolCall]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """A piece of a streamed answer: content text (`content`, `index` None), or a piece of
    call `index`: its first piece has `id` and `name` (and `arguments` ""), later pieces
    carry `arguments` text; a call's `arguments` pieces joined are its arguments' JSON."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def openai(self) -> dict:
        """A call piece as an entry of an OpenAI `delta.tool_calls` list."""
        entry: dict = {"index": self.index}
        function = {}
        if self.id is not None:
            entry.update(id=self.id, type="function")
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        entry["function"] = function
        return entry


def new_call_id() -> str:
    """An id for one call, as OpenAI writes them: "call_" and 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallStream:
    """The incremental parse of one answer. `calls` and `error` hold what was found so far."""

    def __init__(self, call_format):
        """`call_format`: what decides each step (a `call_formats.CallFormat`)."""
        self._format = call_format
        self._pending = ""  # received, not yet decided
        self._call_may_start = True  # at the start, and right after a call
        self._after_call = False  # whitespace and separators here are dropped
        self._rest_is_content = False
        self._content_seen = False
        self._deferred = ""  # whitespace before a run of calls: content if more content follows
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []

    @property
    def error(self) -> str | None:
        return "; ".join(self.errors) or None

    def feed(self, delta_text: str) -> list[ToolDelta]:
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> list[ToolDelta]:
        """Decide what is still held back: the answer ended; a call still open is content."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        while self._pending:
            if self._rest_is_content:
                self._content(out, self._pending)
                self._pending = ""
                break
            if self._after_call and not self._drop_after_call(final):
                break
            step = self._format.next_step(self._pending, final, self._call_may_start)
            if step is None:
                break
            text, self._pending = self._pending[:step.size], self._pending[step.size:]
            if step.kind == "calls":
                if self._content_seen and not self._deferred:
                    self._deferred = text[:len(text) - len(text.lstrip())]
                for call in step.calls:
                    self._emit_call(out, call)
                self._after_call = self._call_may_start = True
                continue
            self._content(out, text)
            if step.error:
                self.errors.append(step.error)
            self._call_may_start = False
            self._rest_is_content = step.rest_is_content
        return out

    def _drop_after_call(self, final: bool) -> bool:
        """Drop the whitespace and separators after a call; False while what follows may
        still be one."""
        separators = self._format.separators
        while True:
            head = self._pending.lstrip()
            separator = next((s for s in separators if head.startswith(s)), None)
            if separator is None:
                break
            self._pending = head[len(separator):]
        self._pending = head
        if not final and (not head or any(s.startswith(head) for s in separators)):
            return False
        self._after_call = False
        return bool(head)

    def _emit_call(self, out: list[ToolDelta], call: ToolCall) -> None:
        index = len(self.calls)
        self.calls.append(call)
        out.append(ToolDelta(index=index, id=new_call_id(), name=call.name, arguments=""))
        out.append(ToolDelta(index=index, arguments=json.dumps(call.arguments, ensure_ascii=False)))

    def _content(self, out: list[ToolDelta], text: str) -> None:
        if not text:
            return
        text, self._deferred, self._content_seen = self._deferred + text, "", True
        if out     and out[-1].content is not None:
            out[-1] = ToolDelta(content=out[-1].content + text)
        else:
            out.append(ToolDelta(content=text))
