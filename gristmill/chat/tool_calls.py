"""Tool-call parsers: find the function calls in a model's answer, whole (`parse`) or as a
stream of OpenAI-style deltas (`stream`), so that a call handed to a user always parses.

A parser is a call format (`call_formats`: one class each, with its markers, triggers and
grammars), registered by name in `TOOL_PARSERS` ("hermes", "llama3_json", "pythonic",
"json"); `get_tool_parser` takes a name, `tool_parser_for` reads a model's chat template.
`JSON_CALLS` ("json") is how a model with no call format of its own writes a forced call.
The text a parser reads is the answer: after a reasoning parser has taken the reasoning
out. What a parse promises is in `call_text`.

`call_schema` gives the structure one call must follow (for `tool_choice="required"`, a
named function, or a call once a trigger has begun one), for the grammar engine.
"""

from __future__ import annotations

from gristmill.chat.call_formats import CallFormat, Hermes, JsonCalls, Llama3Json, Pythonic
from gristmill.chat.call_text import ParsedCalls, ToolCall, ToolCallStream, ToolDelta, new_call_id
from gristmill.errors import RequestError

__all__ = ["ToolCall", "ParsedCalls", "ToolDelta", "ToolCallParser", "ToolCallStream", "TOOL_PARSERS", "JSON_CALLS",
           "get_tool_parser", "tool_parser_for", "choose_tool_parser", "tool_function", "call_schema", "new_call_id",
           "NO_PARSER"]

#: The `tool_call_parser` setting that turns tool-call parsing off, whatever the template.
NO_PARSER = "none"

#: What reads (and, with a grammar, writes) a model's calls: one call format.
ToolCallParser = CallFormat

TOOL_PARSERS: dict[str, ToolCallParser] = {f.name: f for f in (Hermes(), Llama3Json(), Pythonic(), JsonCalls())}
#: The form of a forced call on a model whose template has no call format.
JSON_CALLS = TOOL_PARSERS["json"]


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
    name, "named": whether the choice named one}`. The schema is
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
            "parser": parser.name, "markers": parser.markers, "functions": chosen,
            "named": isinstance(tool_choice, dict)}


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
