"""Tool calls as a grammar, in the model's own call syntax (llguidance's Lark, with `%json`
for JSON values), so that every call parses and its arguments match the function's
`parameters` schema:

- `forced_calls`: `tool_choice="required"` or a named function: the whole answer is one
  call, or with parallel calls one or more;
- `lazy_calls`: `tool_choice="auto"`: the answer is free until the model starts a call (a
  trigger: `<tool_call>`, `<|python_tag|>`, ...), then the grammar of one call applies
  until the call ends, then the answer is free again (`structured.lazy_grammar`).

Both give a `structured_output` value `{"tool_calls": {"grammar", "markers", "triggers",
"start_triggers", "one_call"}}`; `one_call` (`parallel_tool_calls: false`) makes a lazy
grammar's first call the end of the answer: after it, only what ends the call (an end
marker) and the end-of-sequence token. The grammar names each call marker of the format (`<tool_call>`, ...)
as a rule `marker_K` that the grammar engine defines for its vocabulary: the marker's
special token where the vocabulary has it as one, else its text.

Syntaxes: Hermes `<tool_call>\\n{json}\\n</tool_call>` (parallel calls one per line);
Llama 3 JSON `{"name": ..., "parameters": {...}}` (parallel calls joined by `; `); pythonic
`[f(a=1, b="x")]`. A pythonic call follows its schema's `properties`, in their order,
required ones always and optional ones when the model writes them, each value a JSON
literal (`true`, `null`, `"x"`: the parser reads them) matching its property's schema;
what the schema says outside `properties` (anyOf at its top, patternProperties,
dependencies) does not shape a pythonic call.
"""

from __future__ import annotations

import json

from gristmill.errors import RequestError
from gristmill.structured.grammars import closed_objects

#: The layout of a call's JSON, as for a JSON schema constraint (grammars._JSON_LAYOUT):
#: one space after ',' and ':', none elsewhere, so a model cannot pad a call forever.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def forced_calls(spec: dict, parallel: bool) -> dict:
    """The `structured_output` value that forces a call of `spec` (what
    `chat.tool_calls.call_schema` gives), or with `parallel` one or more calls."""
    parser, markers = spec["parser"], spec["markers"]
    if parser == "hermes":
        call = f'marker_0 "\\n" body "\\n" marker_1\n{_json_rule("body", spec["schema"])}'
        rules = (f"start: call (\"\\n\" call)*" if parallel else "start: call") + f"\ncall: {call}"
    elif parser == "llama3_json":
        rules = (f'start: body ("; " body)*' if parallel else "start: body") + "\n" + \
            _json_rule("body", spec["schema"])
    else:
        rules = _pythonic_list(spec, parallel)
    return _value(rules, markers, one_call=not parallel)


def lazy_calls(spec: dict, parallel: bool = True) -> dict:
    """The `structured_output` value that lets an answer run free and holds each call it
    starts (at one of the format's triggers) to a call of `spec` (an "auto" `call_schema`);
    without `parallel`, the first call is the answer's last."""
    parser, markers = spec["parser"], spec["markers"]
    start_triggers: tuple[str, ...] = ()
    if parser == "hermes":
        rules = f'start: marker_0 "\\n" body "\\n" marker_1\n{_json_rule("body", spec["schema"])}'
        triggers = ("<tool_call>",)
    elif parser == "llama3_json":
        rules = f'start: marker_0? body\n{_json_rule("body", spec["schema"])}'
        triggers, start_triggers = ("<|python_tag|>",), ('{"name"',)
    else:
        # (one call: its list, and the `<|python_end|>` that closes a `<|python_start|>`,
        # before the end-of-sequence token; parallel calls are one list, the answer free after it)
        head = "start: marker_0? calls" if parallel else "start: marker_0 calls marker_1? | calls"
        rules = head + "\n" + _pythonic_list(spec, parallel, rule="calls")
        triggers = ("<|python_start|>",)
        start_triggers = tuple(f"[{f['name']}(" for f in spec["functions"])
    return _value(rules, markers, triggers, start_triggers, one_call=not parallel)


def _value(rules: str, markers, triggers=(), start_triggers=(), one_call: bool = False) -> dict:
    return {"tool_calls": {"grammar": rules + "\n", "markers": list(markers), "triggers": list(triggers),
                           "start_triggers": list(start_triggers), "one_call": one_call}}


def _json_rule(name: str, schema: dict) -> str:
    """A Lark rule `name` that matches one JSON value of `schema`, laid out as _LAYOUT says."""
    schema = {**json.loads(closed_objects(json.dumps(schema))), "x-guidance": _LAYOUT}
    return f"{name}: %json {json.dumps(schema)}"


def _pythonic_list(spec: dict, parallel: bool, rule: str = "start") -> str:
    """Lark rules for `[name(key=value, ...), ...]` over `spec`'s functions, the list as `rule`."""
    lines = [f'{rule}: "[" call (", " call)* "]"' if parallel else f'{rule}: "[" call "]"']
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(spec["functions"]))))
    for i, function in enumerate(spec["functions"]):
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
        lines.append(_json_rule(f"{rule}_v{k}", value))
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
