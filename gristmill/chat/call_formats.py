"""The text formats of tool calls, one class per format, each with everything about it:
the markers and triggers it writes, how it reads the head of an undecided text (`Step`),
and the grammars that write its calls (a forced call, and under "auto" a call once one of
its triggers starts it).

- `Hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere in
  the text, several in a row for parallel calls (Hermes, Qwen 2.5, Qwen3).
- `Llama3Json`: `{"name": ..., "parameters": {...}}` objects separated by `;`, at the start
  of the output or after `<|python_tag|>` (Llama 3.1 / 3.2).
- `Pythonic`: a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]`, at the
  start of the output or inside `<|python_start|>` ... `<|python_end|>` (Llama 3.2 / 4);
  read with `ast` as literals only, never evaluated.
- `JsonCalls`: a JSON list `[{"name": ..., "arguments": {...}}, ...]` as the whole answer:
  how a model whose chat template has no call format of its own writes a forced call
  (`tool_choice` "required" or a named function), the grammar deciding the form.

A call is only a call once it is whole and parses; a call that cannot be one is reported
as a malformed step whose text stays content (`call_text` holds what the formats share).
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import keyword
import math
import re
import tokenize

from gristmill.chat.call_text import (Malformed, ParsedCalls, Step, ToolCall, ToolCallStream, call_from_object,
                                      content_before, not_a_call)
from gristmill.chat.markers import may_become
from gristmill.structured.spec import ToolCallGrammar
from gristmill.structured.tool_grammar import json_rule, pythonic_list

_DECODER = json.JSONDecoder()


class CallFormat:
    """One family's tool-call format. `call_start`: the text that starts a call;
    `call_begin`, `call_end`, `call_separator`: what a forced call is written inside and
    between; `arguments_key`: the JSON key of a call's arguments; `syntax`: "json", or
    "python" (`name(key=value, ...)`); `markers`: the format's marker texts, which a
    vocabulary may hold as single special tokens (a grammar writes them as those tokens,
    and the text must keep them); `triggers`: where a call starts anywhere in an answer
    under tool_choice "auto" (where a lazy grammar switches on), `start_triggers`: texts
    that start one only at the start of the answer or right after a call."""

    name: str
    call_start: str = ""
    call_begin: str = ""
    call_end: str = ""
    call_separator: str = ""
    arguments_key: str = "arguments"
    syntax: str = "json"
    markers: tuple[str, ...] = ()
    triggers: tuple[str, ...] = ()
    start_triggers: tuple[str, ...] = ()
    #: What separates calls in a run of them (dropped from the content).
    separators: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        """What the head of `text` is (None: it needs more text); `final`: no more comes;
        `call_may_start`: at the start of the answer or right after a call."""
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def parse(self, text: str) -> ParsedCalls:
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        return ParsedCalls("".join(d.content for d in deltas if d.content is not None), list(stream.calls),
                           stream.error)

    def forced(self, spec: dict, parallel: bool) -> ToolCallGrammar:
        """The grammar whose whole answer is a call of `spec` (`tool_calls.call_schema`), or
        with `parallel` one or more calls."""
        return ToolCallGrammar(self.forced_rules(spec, parallel) + "\n", self.markers, one_call=not parallel)

    def lazy(self, spec: dict, parallel: bool = True) -> ToolCallGrammar:
        """The grammar that lets an answer run free and holds each call it starts (at one
        of the triggers) to a call of `spec` (an "auto" `call_schema`); without
        `parallel`, the first call is the answer's last."""
        return ToolCallGrammar(self.lazy_rules(spec, parallel) + "\n", self.markers, self.triggers,
                               self.lazy_start_triggers(spec), one_call=not parallel)

    def forced_rules(self, spec: dict, parallel: bool) -> str:
        raise NotImplementedError

    def lazy_rules(self, spec: dict, parallel: bool) -> str:
        raise NotImplementedError

    def lazy_start_triggers(self, spec: dict) -> tuple[str, ...]:
        return self.start_triggers


class Hermes(CallFormat):
    """`<tool_call>` JSON `</tool_call>`, anywhere in the text."""

    name = "hermes"
    call_start = "<tool_call>"
    call_begin, call_end, call_separator = "<tool_call>\n", "\n</tool_call>", "\n"
    end_marker = "</tool_call>"
    markers = ("<tool_call>", "</tool_call>")
    triggers = ("<tool_call>",)

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        start, end = self.call_start, self.end_marker
        head = text.lstrip()
        if not head.startswith(start):
            return content_before(text, start, final)
        body_at = len(text) - len(head) + len(start)
        close = text.find(end, body_at)
        if close < 0:
            return Step("malformed", len(text), error=f"{start} was never closed") if final else None
        size = close + len(end)
        try:
            value = json.loads(text[body_at:close])
        except ValueError as exc:
            return Step("malformed", size, error=f"the {start} body is not JSON: {exc}")
        try:
            return Step("calls", size, calls=(call_from_object(value, ("arguments", "parameters")),))
        except Malformed as exc:
            return Step("malformed", size, error=str(exc))

    def forced_rules(self, spec: dict, parallel: bool) -> str:
        call = f'marker_0 "\\n" body "\\n" marker_1\n{json_rule("body", spec["schema"])}'
        return ('start: call ("\\n" call)*' if parallel else "start: call") + f"\ncall: {call}"

    def lazy_rules(self, spec: dict, parallel: bool) -> str:
        return f'start: marker_0 "\\n" body "\\n" marker_1\n{json_rule("body", spec["schema"])}'


class Llama3Json(CallFormat):
    """JSON calls separated by `;`: at the start of the output (a bare `{`) or after
    `<|python_tag|>`. A JSON object at the start that is not call-shaped (no "name" with
    "parameters" or "arguments") is content, without error: an answer in JSON."""

    name = "llama3_json"
    call_start = "<|python_tag|>"
    call_separator = "; "
    arguments_key = "parameters"
    markers = triggers = ("<|python_tag|>",)
    # (a bare JSON object at the start is a call only when it starts with its "name")
    start_triggers = ('{"name"',)
    separators = (";",)

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        head = text.lstrip()
        tagged = head.startswith(self.call_start)
        if not tagged and not (call_may_start and head.startswith("{")):
            if call_may_start and not final and (may_become(head, self.call_start) or not head):
                return None
            return content_before(text, self.call_start, final)
        body = head[len(self.call_start):].lstrip() if tagged else head
        if not body:
            return None if not final else not_a_call(text, tagged, f"nothing after {self.call_start}")
        if body[0] != "{" or body[1:].lstrip()[:1] not in ('"', "}", ""):
            return not_a_call(text, tagged, f"no JSON object after {self.call_start}")
        try:
            value, end = _DECODER.raw_decode(body)
        except ValueError as exc:
            return None if not final else not_a_call(text, tagged, f"the call is not JSON: {exc}")
        size = len(text) - len(body) + end
        looks_like_call = isinstance(value, dict) and "name" in value and (
            "parameters" in value or "arguments" in value)
        if not (tagged or looks_like_call):
            return Step("content", len(text), rest_is_content=True)
        try:
            return Step("calls", size, calls=(call_from_object(value, ("parameters", "arguments")),))
        except Malformed as exc:
            return Step("malformed", len(text), error=str(exc), rest_is_content=True)

    def forced_rules(self, spec: dict, parallel: bool) -> str:
        return ('start: body ("; " body)*' if parallel else "start: body") + "\n" + json_rule("body", spec["schema"])

    def lazy_rules(self, spec: dict, parallel: bool) -> str:
        return f'start: marker_0? body\n{json_rule("body", spec["schema"])}'


# What the head of a call list may look like before its first call's `(`
_LIST_HEAD = re.compile(r"\[\s*(?:[^\W\d][\w.]*\s*)?")
_CALL_HEAD = re.compile(r"\[\s*[^\W\d][\w.]*\s*\(")


class Pythonic(CallFormat):
    """`[name(key=literal, ...), ...]` at the start of the output or after `<|python_start|>`
    (its `<|python_end|>` dropped). Values are Python or JSON literals (`true`, `null` too).
    Under "auto" a list at the start is a call once it reads `[name(` for one of the tools."""

    name = "pythonic"
    call_start = "<|python_start|>"
    call_begin, call_end, call_separator = "[", "]", ", "
    syntax = "python"
    markers = ("<|python_start|>", "<|python_end|>")
    triggers = ("<|python_start|>",)
    separators = ("<|python_end|>",)

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        head = text.lstrip()
        tagged = head.startswith(self.call_start)
        if not tagged and not (call_may_start and head.startswith("[")):
            if call_may_start and not final and (may_become(head, self.call_start) or not head):
                return None
            return content_before(text, self.call_start, final)
        body = head[len(self.call_start):].lstrip() if tagged else head
        if not _CALL_HEAD.match(body):
            if not final and (not body or _LIST_HEAD.fullmatch(body)):
                return None
            return not_a_call(text, tagged, f"no [name(...)] list after {self.call_start}")
        offset = len(text) - len(body)
        for close in (m.start() for m in re.finditer(r"\]", body)):
            try:
                source, renamed = _rename_keyword_arguments(body[:close + 1])
                tree = ast.parse(source, mode="eval")  # parsed, never run
            except (SyntaxError, ValueError):
                continue
            except (RecursionError, MemoryError):
                return Step("malformed", len(text), error="the call list is nested too deeply", rest_is_content=True)
            try:
                if not isinstance(tree.body, ast.List):
                    raise Malformed("the calls are not one [...] list")
                calls = tuple(_pythonic_call(node, renamed, source) for node in tree.body.elts)
            except Malformed as exc:
                return Step("malformed", len(text), error=str(exc), rest_is_content=True)
            return Step("calls", offset + close + 1, calls=calls)
        if final:
            return Step("malformed", len(text), error="the call list [...] was never closed", rest_is_content=True)
        return None

    def forced_rules(self, spec: dict, parallel: bool) -> str:
        return pythonic_list(spec["functions"], parallel)

    def lazy_rules(self, spec: dict, parallel: bool) -> str:
        # (one call: its list, and the `<|python_end|>` that closes a `<|python_start|>`,
        # before the end-of-sequence token; parallel calls are one list, the answer free after it)
        head = "start: marker_0? calls" if parallel else "start: marker_0 calls marker_1? | calls"
        return head + "\n" + pythonic_list(spec["functions"], parallel, rule="calls")

    def lazy_start_triggers(self, spec: dict) -> tuple[str, ...]:
        return tuple(f"[{f['name']}(" for f in spec["functions"])


class JsonCalls(CallFormat):
    """The answer is one JSON list of calls, `[{"name": ..., "arguments": {...}}, ...]` (one
    call in it for a named function, or without parallel calls): the form of a forced
    call on a model whose chat template has no call format (the grammar decides it, so
    nothing needs to recognise it). A list at the start that is not a list of calls is
    content."""

    name = "json"
    call_begin, call_end, call_separator = "[", "]", ", "
    start_triggers = ('[{"name"',)

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        head = text.lstrip()
        if not (call_may_start and head.startswith("[")):
            if call_may_start and not final and not head:
                return None
            return Step("content", len(text), rest_is_content=True) if text else None
        try:
            value, end = _DECODER.raw_decode(head)
        except ValueError as exc:
            if not final:
                return None
            return Step("malformed", len(text), error=f"the call list is not JSON: {exc}", rest_is_content=True)
        if not (isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value)):
            return Step("content", len(text), rest_is_content=True)
        try:
            calls = tuple(call_from_object(v, ("arguments", "parameters")) for v in value)
        except Malformed as exc:
            return Step("malformed", len(text), error=str(exc), rest_is_content=True)
        return Step("calls", len(text) - len(head) + end, calls=calls)

    def forced_rules(self, spec: dict, parallel: bool) -> str:
        # (a named function is called once, as vLLM does: a model that was never told the
        # form would repeat the call until max_tokens)
        schema = {"type": "array", "items": spec["schema"], "minItems": 1}
        if not parallel or spec["named"]:
            schema["maxItems"] = 1
        return "start: body\n" + json_rule("body", schema)

    def lazy_rules(self, spec: dict, parallel: bool) -> str:
        return self.forced_rules(spec, parallel)


def _rename_keyword_arguments(source: str) -> tuple[str, dict[str, str]]:
    """Arguments named by Python keywords (`send(from="a")`, a JSON schema allows any name)
    renamed so that `ast` can read the call: (source, new name -> original name). A
    source that does not tokenize is returned as it is, for `ast` to refuse."""
    if not any(keyword.iskeyword(word) for word in re.findall(r"[A-Za-z_]+(?=\s*=)", source)):
        return source, {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source, {}
    renamed, pieces, last = {}, [], 0
    lines = source.splitlines(keepends=True)
    starts = [0, *itertools.accumulate(len(line) for line in lines)]
    for before, token, after in zip(tokens, tokens[1:], tokens[2:]):
        if (token.type == tokenize.NAME and keyword.iskeyword(token.string) and before.string in ("(", ",")
                and after.string == "="):
            at = starts[token.start[0] - 1] + token.start[1]
            new_name = f"_gristmill_kw_{token.string}"
            renamed[new_name] = token.string
            pieces += [source[last:at], new_name]
            last = at + len(token.string)
    return "".join(pieces) + source[last:], renamed


def _pythonic_call(node: ast.expr, renamed: dict[str, str], source: str) -> ToolCall:
    if not isinstance(node, ast.Call):
        raise Malformed(f"the list holds {ast.unparse(node)!r}, which is not a call")
    if node.args or any(k.arg is None for k in node.keywords):
        raise Malformed(f"call {ast.unparse(node.func)} must name each argument (key=value)")
    _dotted_name(node.func)  # refuses what is not a (dotted) name
    # Names as written: `ast` NFKC-normalizes identifiers (`ª` reads as `a`), which would
    # rename a function or an argument the model wrote.
    name = "".join(ast.get_source_segment(source, node.func).split())
    arguments = {}
    for argument in node.keywords:
        written = ast.get_source_segment(source, argument).partition("=")[0].strip()
        key = renamed.get(written, written)
        try:
            value = ast.literal_eval(_JsonNames().visit(argument.value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise Malformed(f"argument {key} of {name} is not a literal: "
                            f"{ast.unparse(argument.value)[:80]}") from None
        arguments[key] = _as_json(value, f"argument {key} of {name}")
    return ToolCall(name, arguments)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise Malformed(f"{ast.unparse(node)!r} is not a function name")


class _JsonNames(ast.NodeTransformer):
    """`true`, `false`, `null` written JSON's way become Python's constants."""

    _CONSTANTS = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self._CONSTANTS:
            return ast.Constant(self._CONSTANTS[node.id])
        return node


def _as_json(value, where: str):
    """A literal -> the same value as JSON has it (tuples become lists); a value JSON cannot
    hold (a set, bytes, a complex or non-finite number, a non-string key) is Malformed."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise Malformed(f"{where} has a key that is not a string")
        return {k: _as_json(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool, int)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    raise Malformed(f"{where} is a {type(value).__name__}, which JSON cannot hold")
