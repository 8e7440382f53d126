"""The pieces tool-call grammars are made of (llguidance's Lark, with `%json` for JSON
values), so that every call parses and its arguments match the function's `parameters`
schema; each format in `chat.call_formats` puts them together in its own call syntax:

- a JSON value of a schema (`json_rule`), laid out with one space after ',' and ':';
- a pythonic call list `[f(a=1, b="x")]` (`pythonic_list`): each call follows its schema's
  `properties`, in their order, required ones always and optional ones when the model
  writes them, each value a JSON literal (`true`, `null`, `"x"`: the parser reads them)
  matching its property's schema; what the schema says outside `properties` (anyOf at its
  top, patternProperties, dependencies) does not shape a pythonic call.

A grammar names each call marker of its format (`<tool_call>`, ...) as a rule `marker_K`
that the grammar engine defines for its vocabulary: the marker's special token where the
vocabulary has it as one, else its text (`grammars.tool_calls_lark`).
"""

from __future__ import annotations

import json

from gristmill.errors import RequestError
from gristmill.structured.grammars import closed_objects

#: The layout of a call's JSON, as for a JSON schema constraint (grammars._JSON_LAYOUT):
#: one space after ',' and ':', none elsewhere, so a model cannot pad a call forever.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(name: str, schema: dict) -> str:
    """A Lark rule `name` that matches one JSON value of `schema`, laid out as _LAYOUT says."""
    schema = {**json.loads(closed_objects(json.dumps(schema))), "x-guidance": _LAYOUT}
    return f"{name}: %json {json.dumps(schema)}"


def pythonic_list(functions: list[dict], parallel: bool, rule: str = "start") -> str:
    """Lark rules for `[name(key=value, ...), ...]` over `functions` ({"name", "parameters"}),
    the list as `rule`."""
    lines = [f'{rule}: "[" call (", " call)* "]"' if parallel else f'{rule}: "[" call "]"']
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, function in enumerate(functions):
        lines += _pythonic_call(f"call_{i}", function)
    return "\n".join(lines)


def _pythonic_call(rule: str, function: dict) -> list[str]:
    """Rules for one pythonic call of `function`: its schema's properties as keyword
    arguments in order (`first_K`: the arguments from property K on, none written yet;
    `rest_K`: the same after one was written, each with its ", ")."""
    parameters = function["parameters"]
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    names = list(properties)
    for name in names:
        if not name.isidentifier():
            raise RequestError(f"tool {function['name']} has a parameter {name!r}, which cannot be a keyword "
                               "argument of a pythonic call; rename it, or send tool_choice \"auto\" or \"none\"",
                               param="tools")
    n = len(names)
    first = f" {rule}_first_0" if n else ""
    lines = [f'{rule}: {json.dumps(function["name"] + "(")}{first} ")"']
    for k, name in enumerate(names):
        value = properties[name] if isinstance(properties[name], dict) else {}
        lines.append(json_rule(f"{rule}_v{k}", value))
        pair = f'"{name}=" {rule}_v{k}'
        after = f" {rule}_rest_{k + 1}" if k + 1 < n else ""
        if name in required:
            lines.append(f"{rule}_first_{k}: {pair}{after}")
            lines.append(f'{rule}_rest_{k}: ", " {pair}{after}')
        else:
            lines.append(f"{rule}_first_{k}: {pair}{after} | {rule}_first_{k + 1}" if after
                         else f"{rule}_first_{k}: ({pair})?")
            lines.append(f'{rule}_rest_{k}: (", " {pair})?{after}')
    return lines
