"""A chat row's tools: the row's `tools`, `tool_choice` and `parallel_tool_calls` (as
OpenAI takes them), checked against the engine's tool-call parser where the engine runs
beside the processor, and the calls of its answer as the `tool_calls` column: a list of
`{"name": ..., "arguments": {...}}` (arguments parsed), `generated_text` the text around
them (`engines` reads them with `chat.answer`). An engine that reads tools itself (a server)
gets the fields as they are."""

from __future__ import annotations

from dataclasses import replace

from gristmill.batch.rows import RowRequest, without_nulls
from gristmill.chat.answer import constrain
from gristmill.chat.tool_calls import ToolCallParser
from gristmill.chat.tool_choice import ToolRequest, tool_request

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def tool_fields_of(row: dict) -> dict | None:
    """The tool fields a row sets (a null is a missing value, and nulls inside a tool's
    schema are keys Arrow gave it from other rows' schemas), or None when it sets none."""
    fields = {name: without_nulls(row[name]) for name in TOOL_FIELDS if row.get(name) is not None}
    return fields or None


def resolved(fields: dict | None, parser: ToolCallParser | None) -> ToolRequest | None:
    """The checked ToolRequest of a row's tool fields (RequestError naming a bad one)."""
    if fields is None:
        return None
    return tool_request(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls"), parser)


def with_tools(request: RowRequest, parser: ToolCallParser | None) -> RowRequest:
    """`request` with its tool fields resolved for an engine beside the processor: its
    `tools` (for the template and the parser), and a forced call's grammar as its
    constraint."""
    tools = resolved(request.tool_fields, parser)
    # (a forced call and the row's own constraint, or the processor's default, are refused
    # together; under "auto" the row's constraint wins)
    return replace(request, tools=tools, tool_fields=None, sampling_params=constrain(request.sampling_params, tools))
