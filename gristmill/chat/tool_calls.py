"""Tool-call parsers: find the function calls in a model's answer, whole (`parse`) or as a
stream of OpenAI-style deltas (`stream`), so that a call handed to a user always parses.

Parsers are registered by name in `TOOL_PARSERS` ("hermes", "llama3_json", "pythonic";
their text formats are in `call_formats`); `get_tool_parser` takes a name,
`tool_parser_for` reads a model's chat template. The text a parser reads is the answer:
after a reasoning parser has taken the reasoning out.

The contract, whole and streamed alike (`parse` runs the stream on the whole text):
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
- `call_schema` gives the structure one call must follow (for `tool_choice="required"`, a
  named function, or a call once `call_start` has begun one), for the grammar engine.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from gristmill.chat.call_formats import Hermes, Llama3Json, Pythonic, ToolCall
from gristmill.errors import RequestError

__all__ = ["ToolCall", "ParsedCalls", "ToolDelta", "ToolCallParser", "ToolCallStream", "TOOL_PARSERS",
           "get_tool_parser", "tool_parser_for", "choose_tool_parser", "tool_function", "call_schema", "new_call_id", "NO_PARSER"]

#: The `tool_call_parser` setting that turns tool-call parsing off, whatever the template.
NO_PARSER = "none"


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


@dataclass(frozen=True, slots=True)
class ToolCallParser:
    """One family's tool-call format. `call_start`: the text that starts a call (a lazy
    grammar switches on there; llama3_json and pythonic calls may also start the output
    with a bare `{` or `[`); `call_begin`, `call_end`, `call_separator`: what a forced
    call is written inside; `arguments_key`: the JSON key of a call's arguments."""

    name: str
    format: Hermes | Llama3Json | Pythonic
    call_start: str
    call_begin: str
    call_end: str
    call_separator: str
    arguments_key: str = "arguments"
    syntax: str = "json"  # how a call is written: "json", or "python" (name(key=value, ...))
    #: The marker texts of the format that a vocabulary may hold as single (special)
    #: tokens: a grammar writes them as those tokens, and the text must keep them.
    markers: tuple[str, ...] = ()
    #: Where a call starts under tool_choice "auto", where a lazy grammar switches on:
    #: texts anywhere in the answer, and texts only at its start (or right after a call).
    triggers: tuple[str, ...] = ()
    start_triggers: tuple[str, ...] = ()

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def parse(self, text: str) -> ParsedCalls:
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        return ParsedCalls("".join(d.content for d in deltas if d.content is not None), list(stream.calls),
                           stream.error)


class ToolCallStream:
    """The incremental parse of one answer. `calls` and `error` hold what was found so far."""

    def __init__(self, parser: ToolCallParser):
        self._format = parser.format
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


TOOL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": ToolCallParser("hermes", Hermes(), call_start="<tool_call>", call_begin="<tool_call>\n",
                             call_end="\n</tool_call>", call_separator="\n",
                             markers=("<tool_call>", "</tool_call>"), triggers=("<tool_call>",)),
    # (a bare JSON object at the start is a call only when it starts with its "name")
    "llama3_json": ToolCallParser("llama3_json", Llama3Json(), call_start="<|python_tag|>", call_begin="",
                                  call_end="", call_separator="; ", arguments_key="parameters",
                                  markers=("<|python_tag|>",), triggers=("<|python_tag|>",),
                                  start_triggers=('{"name"',)),
    # (a list at the start is a call once it reads `[name(` for one of the tools: see
    # structured.tool_grammar, which adds those)
    "pythonic": ToolCallParser("pythonic", Pythonic(), call_start="<|python_start|>", call_begin="[",
                               call_end="]", call_separator=", ", syntax="python",
                               markers=("<|python_start|>", "<|python_end|>"), triggers=("<|python_start|>",)),
}


def get_tool_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; an unknown name is a ValueError listing the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; the known ones are "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


def choose_tool_parser(setting: str | None, chat_template: str | None) -> ToolCallParser | None:
    """The parser an engine reads its chats' calls with: `setting` (EngineConfig.tool_call_parser)
    by name; None: the one the model's chat template calls for (`tool_parser_for`), if any;
    "none": none."""
    if setting == NO_PARSER:
        return None
    name = setting if setting is not None else tool_parser_for(chat_template)
    return None if name is None else get_tool_parser(name)


def tool_parser_for(chat_template: str | None) -> str | None:
    """The name of the tool-call parser a chat template calls for, or None: `<tool_call>`
    (Hermes, Qwen 2.5, Qwen3) is "hermes"; the `[func_name1(params_name1=...` instruction
    (Llama 3.2 pythonic, Llama 4) is "pythonic"; `<|python_tag|>` or a `"parameters"` key
    (Llama 3.1 / 3.2 JSON) is "llama3_json"."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[func_name1(" in chat_template:
        return "pythonic"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3_json"
    return None


def call_schema(tools: list[dict], tool_choice, parser_name: str) -> dict:
    """The structure one call must follow, for a grammar engine: `{"schema": the JSON
    schema of the call, "begin": text before it, "end": text after it, "separator": text
    between parallel calls, "syntax": "json" or "python", "parser": its name, "markers":
    the format's call markers (`<tool_call>`, ...), "functions": the functions a call may
    name}`. The schema is
    `{"name": const, <arguments key>: the function's parameters schema}`; with
    `tool_choice` "required" or "auto" (the call a `call_start` begins) an anyOf over
    `tools`, with `{"type": "function", "function": {"name": ...}}` that function's alone.
    For syntax "python" the same call is written `name(key=value, ...)`. `tools` are
    OpenAI tool entries; anything else, or a choice that forces no call, is a RequestError."""
    parser = get_tool_parser(parser_name)
    functions = [tool_function(tool) for tool in tools or ()]
    if not functions:
        raise RequestError("tool_choice forces a tool call but the request lists no tools; send tools",
                           param="tools")
    if tool_choice in ("required", "auto"):
        chosen = functions
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise RequestError(f"tool_choice names function {name!r}, which is not among the tools "
                               f"({', '.join(f['name'] for f in functions)})", param="tool_choice")
    else:
        raise RequestError(f"tool_choice {tool_choice!r} forces no call; send \"required\", \"auto\" or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param="tool_choice")
    schemas = [{"type": "object",
                "properties": {"name": {"const": f["name"]}, parser.arguments_key: f["parameters"]},
                "required": ["name", parser.arguments_key], "additionalProperties": False} for f in chosen]
    return {"schema": schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, "begin": parser.call_begin,
            "end": parser.call_end, "separator": parser.call_separator, "syntax": parser.syntax,
            "parser": parser.name, "markers": parser.markers, "functions": chosen}


def tool_function(tool) -> dict:
    """An OpenAI tool entry -> {"name", "parameters"} (parameters default to any object)."""
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RequestError(f"each tool must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"parameters\": {{...}}}}}}, got {str(tool)[:200]}", param="tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise RequestError(f"the parameters of tool {function['name']} must be a JSON schema object",
                           param="tools")
    return {"name": function["name"], "parameters": parameters}
