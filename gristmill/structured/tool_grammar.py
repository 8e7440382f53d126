"""Forced tool calls as a grammar: `tool_choice="required"` or a named function becomes a
Lark grammar (llguidance's, with `%json` for each call's JSON) that admits only whole
calls in the model's own syntax, so every call parses and its arguments match the
function's `parameters` schema."""

from __future__ import annotations

import json

from gristmill.errors import RequestError
from gristmill.structured.grammars import closed_objects

#: The layout of a call's JSON, as for a JSON schema constraint (grammars._JSON_LAYOUT):
#: one space after ',' and ':', none elsewhere, so a model cannot pad a call forever.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def forced_calls(spec: dict, parallel: bool) -> dict:
    """A `structured_output` value ({"grammar": Lark text}) of `spec` (what
    `chat.tool_calls.call_schema` gives): one call, or with `parallel` one or more calls
    joined by the parser's separator."""
    if spec["syntax"] != "json":
        raise RequestError(f"this model writes its calls in {spec['syntax']} syntax, which cannot be forced yet; "
                           "send tool_choice \"auto\" (its calls are parsed) or \"none\"", param="tool_choice")
    schema = {**json.loads(closed_objects(json.dumps(spec["schema"]))), "x-guidance": _LAYOUT}
    call = " ".join(p for p in (_literal(spec["begin"]), "body", _literal(spec["end"])) if p)
    calls = f"call ({_literal(spec['separator'])} call)*" if parallel else "call"
    return {"grammar": f"start: {calls}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"}


def _literal(text: str) -> str:
    """`text` as a Lark string literal ("" when empty: no literal)."""
    return json.dumps(text) if text else ""
