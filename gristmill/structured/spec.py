"""What a request asks its output to match: `SamplingParams.structured_output`, checked
for shape where it is built (no tokenizer, no grammar engine), as one `Constraint`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gristmill.errors import RequestError

#: What a request may constrain its answer with (what error messages name).
ANSWER_KINDS = ("json", "json_object", "regex", "choice", "grammar")
PARAM = "structured_output"


@dataclass(frozen=True, slots=True)
class Constraint:
    """One constraint, normalized: `kind` is one of ANSWER_KINDS or "tool_calls", `source` the text a grammar
    engine compiles (a JSON schema as canonical JSON; the choices as a JSON list)."""

    kind: str
    source: str


@dataclass(frozen=True, slots=True)
class ToolCallGrammar:
    """A chat's tool calls as a constraint (what a tool-call format writes from `tools`,
    never a request field): `grammar`, Lark text whose rules `marker_K` are the K-th of
    `markers` (the format's call markers, written as the vocabulary's special token where
    it has one); `triggers`: where a call starts anywhere in the answer, `start_triggers`:
    only at its start or right after a call (both empty: the whole answer is the grammar,
    a forced call); `one_call`: the first call ends the answer."""

    grammar: str
    markers: tuple[str, ...]
    triggers: tuple[str, ...] = ()
    start_triggers: tuple[str, ...] = ()
    one_call: bool = False

    def constraint(self) -> Constraint:
        fields = {"grammar": self.grammar, "markers": list(self.markers), "triggers": list(self.triggers),
                  "start_triggers": list(self.start_triggers), "one_call": self.one_call}
        return Constraint("tool_calls", json.dumps(fields, separators=(",", ":")))


def parse_constraint(value) -> Constraint | None:
    """A `structured_output` value -> Constraint (None for None). Exactly one of
    `{"json": schema dict or JSON text}`, `{"json_object": True}`, `{"regex": str}`,
    `{"choice": [str, ...]}`, `{"grammar": EBNF / GBNF text}`, or a chat's tool calls (a
    `ToolCallGrammar`); anything else is a RequestError saying what to send."""
    if value is None:
        return None
    if isinstance(value, Constraint):
        return value
    if isinstance(value, ToolCallGrammar):
        return value.constraint()
    value = given_kinds(value)
    others = sorted(str(key) for key in value if key not in ANSWER_KINDS) if isinstance(value, dict) else []
    if others:  # e.g. vLLM's options (disable_any_whitespace, ...): never taken and dropped
        raise RequestError(f"{PARAM} takes exactly one of {', '.join(ANSWER_KINDS)} and no other keys; "
                           f"leave out {', '.join(others)}", param=PARAM)
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in ANSWER_KINDS:
        raise RequestError(f"{PARAM} must be an object with exactly one of {', '.join(ANSWER_KINDS)}, "
                           f"got {short(value)}", param=PARAM)
    kind, spec = next(iter(value.items()))
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise RequestError(f"{PARAM}.json is not valid JSON: {exc}", param=PARAM) from None
        if not isinstance(spec, dict):  # (a schema `true` / `false` too: the grammar engine takes objects)
            raise RequestError(f"{PARAM}.json must be a JSON schema (an object), got {short(spec)}; for any "
                               f"JSON object send {{\"json_object\": true}}", param=PARAM)
        return Constraint("json", json.dumps(spec, separators=(",", ":")))  # property order kept
    if kind == "json_object":
        if spec is not True:
            raise RequestError(f"{PARAM}.json_object must be true, got {short(spec)}", param=PARAM)
        return Constraint("json_object", "")
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise RequestError(f"{PARAM}.choice must be a non-empty list of non-empty strings, "
                               f"got {short(spec)}", param=PARAM)
        return Constraint("choice", json.dumps(spec))
    if not isinstance(spec, str) or not spec.strip():
        raise RequestError(f"{PARAM}.{kind} must be a non-empty string, got {short(spec)}", param=PARAM)
    return Constraint(kind, spec)


def given_kinds(value):
    """A `structured_output` dict without the kinds set to None: rows that went through
    Arrow (Ray Data, Parquet) carry every kind any row of their block used, the others as
    None, and those are not given. None if no kind is left."""
    if isinstance(value, dict) and len(value) > 1:
        return {kind: spec for kind, spec in value.items() if spec is not None} or None
    return value


def openai_constraint(response_format, structured_outputs) -> tuple[dict | None, str | None]:
    """(a `structured_output` value, the request field it came from) of an OpenAI request
    body's `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}) or vLLM's `structured_outputs` (the same kinds as
    `structured_output`). `{"type": "text"}` is OpenAI's default, no constraint: it goes
    with `structured_outputs` (as in vLLM)."""
    if response_format is not None and not isinstance(response_format, dict):
        raise RequestError(f"response_format must be an object such as {{\"type\": \"json_object\"}}, "
                           f"got {short(response_format)}", param="response_format")
    kind = response_format.get("type") if response_format is not None else None
    if kind == "text":
        response_format = None
    if response_format is not None and structured_outputs is not None:
        raise RequestError("give response_format or structured_outputs, not both", param="response_format")
    if structured_outputs is not None:
        return structured_outputs, "structured_outputs"
    if response_format is None:
        return None, None
    if kind == "json_object":  # (with a "schema", as some OpenAI-compatible services take it: that schema)
        schema = response_format.get("schema")
        return ({"json_object": True} if schema is None else {"json": schema}), "response_format"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format.json_schema must be an object with a 'schema' (and a 'name'), "
                               "e.g. {\"name\": \"person\", \"schema\": {...}}", param="response_format")
        return {"json": spec["schema"]}, "response_format"
    raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param="response_format")


def named_for(exc: RequestError, field: str | None) -> RequestError:
    """A `structured_output` error of a constraint that came from the request field
    `field` (`response_format`, `structured_outputs`), reworded to name that field."""
    if exc.param != PARAM or field is None:
        return exc
    return RequestError(str(exc).replace(PARAM, field, 1), param=field)


def short(value) -> str:
    """A value as an error message shows it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
