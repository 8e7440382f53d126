"""A chat request's tools, checked once for every face (server, `LLM.chat`, batch rows):
`tools`, `tool_choice` and `parallel_tool_calls` as OpenAI takes them, and what they ask of
the engine: the tools for the chat template, the parser that reads the answer's calls,
and for a forced call (`"required"`, a named function) the grammar that writes it."""

from __future__ import annotations

from dataclasses import dataclass

from gristmill.chat.tool_calls import JSON_CALLS, ToolCallParser, call_schema, tool_function
from gristmill.errors import RequestError
from gristmill.structured.spec import ToolCallGrammar

CHOICES = ("none", "auto", "required")
_NAMED = '{"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What a chat asks of tools. `tools`: OpenAI tool entries, for the template (None:
    none); `choice`: "none", "auto", "required" or a named function's entry; `parallel`:
    an answer may hold several calls (False: a forced answer is one call, and under "auto"
    the first call ends the answer); `parser`: what reads the answer's calls (None
    with choice "none": the answer is plain content)."""

    tools: list[dict] | None
    choice: str | dict
    parallel: bool
    parser: ToolCallParser | None

    @property
    def forces_call(self) -> bool:
        return self.choice not in ("none", "auto")

    def constraint(self) -> ToolCallGrammar | None:
        """The `structured_output` value of the calls: with a forced call, the grammar that
        writes it; with "auto" and tools, the lazy grammar that holds each call the model
        starts to its schema (the answer is free until then); else None. Under "auto" a
        constraint the request gives its answer (`response_format`) takes the place of
        this one (`answer_constraint`)."""
        if self.forces_call:
            return self.parser.forced(call_schema(self.tools, self.choice, self.parser.name), self.parallel)
        if self.choice == "auto" and self.tools:
            return self.parser.lazy(call_schema(self.tools, "auto", self.parser.name), self.parallel)
        return None

    def answer_constraint(self, answer: dict | None, field: str | None) -> tuple[dict | None, str | None]:
        """(the request's `structured_output`, the field it came from) given the answer's own
        constraint `answer` from request field `field` (None: none): a forced call and
        an answer constraint are refused together, and so are one call under "auto"
        (`parallel_tool_calls: false`, which the call grammar holds) and an answer
        constraint; else under "auto" the answer's wins (its calls are then parsed, not
        held to their schema)."""
        if answer is not None:
            if self.forces_call:
                raise RequestError(f"tool_choice forces a tool call, whose arguments follow the tool's schema, and "
                                   f"{field} constrains the answer too; send one of them", param="tool_choice")
            if self.choice == "auto" and self.tools and not self.parallel:
                raise RequestError(f"parallel_tool_calls false ends the answer at its first call, which the call "
                                   f"grammar holds, and {field} constrains the answer instead; leave out one of "
                                   "them", param="parallel_tool_calls")
            return answer, field
        calls = self.constraint()
        return calls, None if calls is None else "tool_choice"


def tool_request(tools, tool_choice, parallel_tool_calls, parser: ToolCallParser | None) -> ToolRequest | None:
    """The checked ToolRequest of a chat's fields, or None when it has no tools and no
    choice. A malformed field is a RequestError naming it and what to send. With no
    tool-call `parser` (none from the chat template or the engine's setting) a forced call
    is written in the JSON form (`tool_calls.JSON_CALLS`); "auto" is refused, never
    ignored, as it needs the model's own format."""
    if tools is None and tool_choice in (None, "none") and parallel_tool_calls is None:
        return None
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools must be a list of {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"parameters\": {{...}}}}}} entries, got {type(tools).__name__}", param="tools")
    for tool in tools or ():
        tool_function(tool)  # (a RequestError naming the tool that is not a function tool)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise RequestError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}",
                           param="parallel_tool_calls")
    choice = _choice(tool_choice, tools)
    if parser is None and choice not in ("none", "auto"):
        parser = JSON_CALLS  # (the grammar writes the call, so nothing needs to recognise the model's form)
    if choice == "auto" and parser is None:
        raise RequestError("tool_choice \"auto\" needs the model's own tool-call format to find the calls it "
                           "makes, and this model's chat template has none the server knows; start the engine "
                           "with --tool-call-parser NAME (EngineConfig.tool_call_parser: hermes, llama3_json, "
                           "pythonic or json), or send tool_choice \"required\", a named function or \"none\"",
                           param="tool_choice")
    return ToolRequest(tools or None, choice, parallel_tool_calls is not False,
                       None if choice == "none" else parser)


def _choice(tool_choice, tools) -> str | dict:
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError(f"tool_choice as an object must be {_NAMED}, got {str(tool_choice)[:120]}",
                               param="tool_choice")
    elif tool_choice not in CHOICES:
        raise RequestError(f"tool_choice must be \"none\", \"auto\", \"required\" or {_NAMED}, "
                           f"got {str(tool_choice)[:80]!r}", param="tool_choice")
    if tool_choice not in ("none", "auto") and not tools:
        raise RequestError("tool_choice forces a tool call but the request lists no tools; send tools, or "
                           "leave tool_choice out", param="tool_choice")
    if isinstance(tool_choice, dict):
        names = [tool_function(tool)["name"] for tool in tools]
        if tool_choice["function"]["name"] not in names:
            raise RequestError(f"tool_choice names function {tool_choice['function']['name']!r}, which is not "
                               f"among the tools ({', '.join(names)})", param="tool_choice")
    return tool_choice
