"""Tool-call parsers: fixed answers of each format give their calls and content; malformed
calls stay content with the reason; every cut of a stream into two or three deltas gives
`parse`'s result as OpenAI-style deltas (a marker cut anywhere never leaks); random
answers built from known pieces parse to those pieces; `call_schema` accepts the calls
the parsers return."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gristmill.chat.tool_calls import (TOOL_PARSERS, ToolCall, call_schema, get_tool_parser,
                                       tool_parser_for)
from gristmill.errors import RequestError


def hermes_call(name, arguments, key="arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: arguments}, ensure_ascii=False)}\n</tool_call>'


WEATHER = ToolCall("get_weather", {"city": "Paris"})
NESTED = {"f": {"t": ["a", {"b": [1.5, None]}], "on": True}}

# (parser, answer, content, calls, error fragment or None)
CASES = [
    ("hermes", hermes_call("get_weather", {"city": "Paris"}), "", [WEATHER], None),
    ("hermes", "Checking.\n\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n" + hermes_call("t", {}) +
     "\nDone.", "Checking.\n\nDone.", [WEATHER, ToolCall("t", {})], None),
    ("hermes", hermes_call("search", NESTED), "", [ToolCall("search", NESTED)], None),
    ("hermes", hermes_call("traduire", {"texte": "Ça coûte 5 €, 東京 🗼"}), "",
     [ToolCall("traduire", {"texte": "Ça coûte 5 €, 東京 🗼"})], None),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [ToolCall("f", {"a": 1})], None),
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {"a": 1</tool_call> B', 'A <tool_call>{"name": "f", '
     '"arguments": {"a": 1</tool_call> B', [], "not JSON"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', [], '"name"'),
    ("hermes", "Calling " + hermes_call("f", {"x": 1})[:-4], "Calling " + hermes_call("f", {"x": 1})[:-4], [],
     "never closed"),
    ("hermes", "x < y and <tool_cal> is not a marker", "x < y and <tool_cal> is not a marker", [], None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER], None),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": '
     + json.dumps(NESTED) + '}', "", [ToolCall("f", {"a": 1}), ToolCall("g", NESTED)], None),
    ("llama3_json", 'Sure. <|python_tag|>{"name": "f", "parameters": {"s": "é"}}', "Sure.", [ToolCall("f", {"s": "é"})],
     None),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', [], None),
    ("llama3_json", "The answer is 4.", "The answer is 4.", [], None),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', [],
     "no JSON object"),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, 2}}', '{"name": "f", "parameters": {"a": [1, 2}}', [], None),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1', '<|python_tag|>{"name": "f", "parameters": '
     '{"a": 1', [], "not JSON"),
    ("pythonic", '[get_weather(city="Paris"), f(a=1, b=[1, 2])]', "",
     [WEATHER, ToolCall("f", {"a": 1, "b": [1, 2]})], None),
    ("pythonic", "[search(f={'t': ('a', {'b': [1.5, null]}), 'on': true})]", "", [ToolCall("search", NESTED)], None),
    ("pythonic", '[send(from="a, to=1", to="b")]', "", [ToolCall("send", {"from": "a, to=1", "to": "b"})], None),
    ("pythonic", '<|python_start|>[web.search(q="東京 ]")]<|python_end|> Here.', "Here.",
     [ToolCall("web.search", {"q": "東京 ]"})], None),
    # names as the model wrote them, not as Python normalizes identifiers (NFKC: ª -> a)
    ("pythonic", "[ﬁnd.ª(ª=None, µ=1)]", "", [ToolCall("ﬁnd.ª", {"ª": None, "µ": 1})], None),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", [], None),
    ("pythonic", '[f(x=__import__("os").system("ls"))]', '[f(x=__import__("os").system("ls"))]', [], "not a literal"),
    ("pythonic", '[f("Paris")]', '[f("Paris")]', [], "must name each argument"),
    ("pythonic", "[f(s={1, 2})]", "[f(s={1, 2})]", [], "JSON cannot hold"),
    ("pythonic", '[f(a=1), g(b="x"', '[f(a=1), g(b="x"', [], "never closed"),
]


def _ids(case):
    return f"{case[0]}:{case[1][:30]!r}"


def streamed(parser, pieces):
    """The deltas of a stream fed `pieces` -> (content, calls, error), checking the OpenAI
    shape of every call's deltas on the way."""
    stream = parser.stream()
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content, calls, ids = "", [], []
    for delta in deltas:
        if delta.index is None:
            assert delta.content and delta.id is None and delta.arguments is None
            content += delta.content
        elif delta.id is not None:  # a call's first piece: a new index, its id and name
            assert delta.index == len(calls) and delta.id.startswith("call_") and delta.name
            assert delta.arguments == "" and delta.openai()["type"] == "function"
            calls.append([delta.name, ""])
            ids.append(delta.id)
        else:
            assert delta.index == len(calls) - 1 and delta.name is None
            calls[-1][1] += delta.arguments
    assert len(set(ids)) == len(ids)
    return content, [ToolCall(name, json.loads(arguments)) for name, arguments in calls], stream.error


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_parse_finds_the_calls_and_keeps_malformed_ones_as_content(case):
    name, answer, content, calls, error = case
    parsed = get_tool_parser(name).parse(answer)
    assert (parsed.content, parsed.calls) == (content, calls)
    if error is None:
        assert parsed.error is None
    else:
        assert error in parsed.error


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_cut_into_two_and_three_deltas_gives_the_same_calls_and_content(case):
    name, answer, content, calls, _ = case
    parser = get_tool_parser(name)
    error = parser.parse(answer).error
    for i in range(len(answer) + 1):
        assert streamed(parser, [answer[:i], answer[i:]]) == (content, calls, error), i
        for j in range(i, len(answer) + 1):
            assert streamed(parser, [answer[:i], answer[i:j], answer[j:]]) == (content, calls, error), (i, j)


def test_a_call_shows_only_once_whole_and_text_that_may_start_one_waits():
    stream = get_tool_parser("hermes").stream()
    assert [d.content for d in stream.feed("Checking \n<tool_")] == ["Checking"]
    assert stream.feed('call>\n{"name": "get_weather", "arguments": {"city": "Par') == []
    first, arguments = stream.feed('is"}}\n</tool_call>')
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert json.loads(arguments.arguments) == {"city": "Paris"} and arguments.id is None
    assert stream.feed("\n") == [] and stream.finish() == [] and stream.error is None
    assert arguments.openai() == {"index": 0, "function": {"arguments": arguments.arguments}}


def test_a_call_still_open_at_the_end_becomes_content_with_the_reason():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed('<tool_call>{"name": "f", "arguments": {') == []
    [delta] = stream.finish()
    assert delta.content == '<tool_call>{"name": "f", "arguments": {'
    assert stream.calls == [] and "never closed" in stream.error


# -- random answers built from known pieces ---------------------------------------------

_TEXT = st.text(st.sampled_from("ab é🗼<>/{}[]\"_:,"), min_size=1, max_size=8).map(str.strip).filter(
    lambda t: t and "<tool_call>" not in t)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=8)
_CALL = st.builds(ToolCall, st.sampled_from(["f", "get_weather", "名前"]), st.dictionaries(st.text(max_size=5), _JSON,
                                                                                         max_size=3))
_MALFORMED = st.sampled_from(['<tool_call>{"name": 1}</tool_call>', "<tool_call>nope</tool_call>",
                              '<tool_call>{"arguments": {}}</tool_call>'])
_PIECE = st.one_of(_TEXT.map(lambda t: ("content", t)), _CALL.map(lambda c: ("call", c)),
                   _MALFORMED.map(lambda m: ("malformed", m)))


def expected_hermes(pieces, gaps):
    """The contract for an answer of `pieces` joined by whitespace `gaps`: calls in order;
    content keeps the gaps between two non-calls, and the gap before a run of calls when
    content comes both before and after the run."""
    content, calls, pending_gap = "", [], None
    for (kind, value), gap in zip(pieces, ["", *gaps]):
        if kind == "call":
            calls.append(value)
            if content and pending_gap is None:
                pending_gap = gap
            continue
        content += (gap if pending_gap is None else pending_gap) if content else ""
        content += value
        pending_gap = None
    return content, calls


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(_PIECE, max_size=6), data=st.data())
def test_random_hermes_answers_cut_at_random_give_their_pieces(pieces, data):
    # whitespace between two content pieces (so they stay two) and around calls
    gaps = [data.draw(st.sampled_from([" ", "\n", "\n\n"] if a[0] != "call" and b[0] != "call" else ["", " ", "\n"]))
            for a, b in zip(pieces, pieces[1:])]
    rendered = [hermes_call(v.name, v.arguments) if kind == "call" else v for kind, v in pieces]
    answer = rendered[0] + "".join(gap + text for gap, text in zip(gaps, rendered[1:])) if pieces else ""
    content, calls = expected_hermes(pieces, gaps)
    parsed = get_tool_parser("hermes").parse(answer)
    assert (parsed.content, parsed.calls) == (content, calls)
    assert (parsed.error is None) == all(kind != "malformed" for kind, _ in pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(answer)), max_size=6)))
    bounds = [0, *cuts, len(answer)]
    assert streamed(get_tool_parser("hermes"), [answer[a:b] for a, b in zip(bounds, bounds[1:])]) == (
        content, calls, parsed.error)


@settings(max_examples=40, deadline=None)
@given(calls=st.lists(_CALL, min_size=1, max_size=3), tagged=st.booleans(), data=st.data())
def test_random_llama3_and_pythonic_calls_cut_at_random_parse_back(calls, tagged, data):
    llama = "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls)
    python = "[" + ", ".join(f"{c.name}(" + ", ".join(f"{k}={v!r}" for k, v in c.arguments.items() if k.isidentifier())
                             + ")" for c in calls) + "]"
    python_calls = [ToolCall(c.name, {k: v for k, v in c.arguments.items() if k.isidentifier()}) for c in calls]
    for name, answer, expected in [("llama3_json", ("<|python_tag|>" if tagged else "") + llama, calls),
                                   ("pythonic", ("<|python_start|>" if tagged else "") + python, python_calls)]:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(answer)), max_size=4)))
        bounds = [0, *cuts, len(answer)]
        assert streamed(get_tool_parser(name), [answer[a:b] for a, b in zip(bounds, bounds[1:])]) == (
            "", expected, None), answer


# -- choosing a parser, and the schema of a forced call ---------------------------------

def test_parsers_are_chosen_by_name_or_from_the_chat_template():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "pythonic", "json"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'.*hermes, json, llama3_json, pythonic"):
        get_tool_parser("mistral")
    qwen = "For each function call, return a json object ... within <tool_call></tool_call> XML tags"
    llama31 = ("{{- '<|python_tag|>' + tool_call.name + '.call(' }} ... Respond in the format "
               '{"name": function name, "parameters": dictionary of argument name and its value}')
    pythonic = "you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...)]"
    assert tool_parser_for(qwen) == "hermes"
    assert tool_parser_for(llama31) == "llama3_json"
    assert tool_parser_for(pythonic) == "pythonic"
    assert tool_parser_for("{{ bos_token }}{{ message.content }}") is None and tool_parser_for(None) is None
    assert get_tool_parser("hermes").call_start == "<tool_call>"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_a_forced_call_schema_accepts_the_calls_its_parser_returns(name):
    parser = get_tool_parser(name)
    key = parser.arguments_key
    required = call_schema(TOOLS, "required", name)
    named = call_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, name)
    answer = {"hermes": hermes_call("get_weather", {"city": "Paris"}),
              "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
              "pythonic": '[get_weather(city="Paris")]',
              "json": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'}[name]
    [call] = parser.parse(answer).calls
    as_json = {"name": call.name, key: call.arguments}
    jsonschema.validate(as_json, required["schema"])
    jsonschema.validate(as_json, named["schema"])
    jsonschema.validate({"name": "get_time", key: {}}, required["schema"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", key: {}}, named["schema"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", key: {}}, required["schema"])
    if name == "hermes":
        assert (named["begin"], named["end"]) == ("<tool_call>\n", "\n</tool_call>")
        assert parser.parse(named["begin"] + json.dumps(as_json) + named["end"]).calls == [call]


def test_a_call_schema_that_cannot_be_built_says_what_to_send():
    with pytest.raises(RequestError, match="not among the tools") as raised:
        call_schema(TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes")
    assert raised.value.param == "tool_choice"
    with pytest.raises(RequestError, match="forces no call"):
        call_schema(TOOLS, "none", "hermes")
    with pytest.raises(RequestError, match="lists no tools"):
        call_schema([], "required", "hermes")
    with pytest.raises(RequestError, match="each tool must be"):
        call_schema([{"type": "function", "function": {}}], "required", "hermes")


def test_the_parsers_load_neither_torch_nor_transformers():
    code = ("import sys, gristmill.chat.reasoning, gristmill.chat.tool_calls; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
