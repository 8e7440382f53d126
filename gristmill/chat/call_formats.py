"""The text formats of tool calls, one class per format: each reads the head of the text a
stream has not yet decided and says what it is (`Step`), or that it needs more text.

- `Hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere in
  the text, several in a row for parallel calls (Hermes, Qwen 2.5, Qwen3).
- `Llama3Json`: `{"name": ..., "parameters": {...}}` objects separated by `;`, at the start
  of the output or after `<|python_tag|>` (Llama 3.1 / 3.2).
- `Pythonic`: a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]`, at the
  start of the output or inside `<|python_start|>` ... `<|python_end|>` (Llama 3.2 / 4);
  read with `ast` as literals only, never evaluated.

A call is only a call once it is whole and parses; a call that cannot be one is reported
as a malformed step whose text stays content. A format never decides trailing whitespace
while a call may still follow it: whitespace before a call belongs to the call's step.
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
from dataclasses import dataclass, field

from gristmill.chat.markers import may_become, undecided_tail


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


class Hermes:
    """`<tool_call>` JSON `</tool_call>`, anywhere in the text."""

    start = "<tool_call>"
    end = "</tool_call>"
    separators: tuple[str, ...] = ()

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        head = text.lstrip()
        if not head.startswith(self.start):
            return content_before(text, self.start, final)
        body_at = len(text) - len(head) + len(self.start)
        close = text.find(self.end, body_at)
        if close < 0:
            return Step("malformed", len(text), error=f"{self.start} was never closed") if final else None
        size = close + len(self.end)
        try:
            value = json.loads(text[body_at:close])
        except ValueError as exc:
            return Step("malformed", size, error=f"the {self.start} body is not JSON: {exc}")
        try:
            return Step("calls", size, calls=(call_from_object(value, ("arguments", "parameters")),))
        except Malformed as exc:
            return Step("malformed", size, error=str(exc))


_DECODER = json.JSONDecoder()


class Llama3Json:
    """JSON calls separated by `;`: at the start of the output (a bare `{`) or after
    `<|python_tag|>`. A JSON object at the start that is not call-shaped (no "name" with
    "parameters" or "arguments") is content, without error: an answer in JSON."""

    start = "<|python_tag|>"
    separators = (";",)

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        head = text.lstrip()
        tagged = head.startswith(self.start)
        if not tagged and not (call_may_start and head.startswith("{")):
            if call_may_start and not final and (may_become(head, self.start) or not head):
                return None
            return content_before(text, self.start, final)
        body = head[len(self.start):].lstrip() if tagged else head
        if not body:
            return None if not final else _not_a_call(text, tagged, f"nothing after {self.start}")
        if body[0] != "{" or body[1:].lstrip()[:1] not in ('"', "}", ""):
            return _not_a_call(text, tagged, f"no JSON object after {self.start}")
        try:
            value, end = _DECODER.raw_decode(body)
        except ValueError as exc:
            return None if not final else _not_a_call(text, tagged, f"the call is not JSON: {exc}")
        size = len(text) - len(body) + end
        looks_like_call = isinstance(value, dict) and "name" in value and (
            "parameters" in value or "arguments" in value)
        if not (tagged or looks_like_call):
            return Step("content", len(text), rest_is_content=True)
        try:
            return Step("calls", size, calls=(call_from_object(value, ("parameters", "arguments")),))
        except Malformed as exc:
            return Step("malformed", len(text), error=str(exc), rest_is_content=True)


def _not_a_call(text: str, tagged: bool, error: str) -> Step:
    """The rest of the output, as content: a malformed call after a tag, else plain content."""
    if tagged:
        return Step("malformed", len(text), error=error, rest_is_content=True)
    return Step("content", len(text), rest_is_content=True)


# What the head of a call list may look like before its first call's `(`
_LIST_HEAD = re.compile(r"\[\s*(?:[^\W\d][\w.]*\s*)?")
_CALL_HEAD = re.compile(r"\[\s*[^\W\d][\w.]*\s*\(")


class Pythonic:
    """`[name(key=literal, ...), ...]` at the start of the output or after `<|python_start|>`
    (its `<|python_end|>` dropped). Values are Python or JSON literals (`true`, `null` too)."""

    start = "<|python_start|>"
    separators = ("<|python_end|>",)

    def next_step(self, text: str, final: bool, call_may_start: bool) -> Step | None:
        head = text.lstrip()
        tagged = head.startswith(self.start)
        if not tagged and not (call_may_start and head.startswith("[")):
            if call_may_start and not final and (may_become(head, self.start) or not head):
                return None
            return content_before(text, self.start, final)
        body = head[len(self.start):].lstrip() if tagged else head
        if not _CALL_HEAD.match(body):
            if not final and (not body or _LIST_HEAD.fullmatch(body)):
                return None
            return _not_a_call(text, tagged, f"no [name(...)] list after {self.start}")
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
