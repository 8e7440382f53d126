"""Chat completions with tools, through the real `openai` client, on a tiny random-weight
Qwen3 whose chat template writes tools and calls as Qwen's do (`<tool_call>` blocks): a
forced call (`required`, a named function) always parses and matches its schema, whole
and streamed; `auto` reads the calls the model writes and leaves a malformed one as text,
and with `parallel_tool_calls: false` its first call ends the answer; the call -> tool
result -> answer round trip; malformed fields are 400s naming them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.chat.reasoning_models import token_id
from tests.chat.tools import MESSAGES, SCHEMAS, TOOLS


@pytest.fixture(scope="module")
def client(tools_client):
    return tools_client


def chat(client, **fields):
    body = dict(model="tiny-qwen3", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    return client.chat.completions.create(**{**body, **fields})


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_always_parse_and_match_their_schema(client):
    for seed in range(4):
        response = chat(client, tool_choice="required", n=5, seed=seed, temperature=1.0)
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            check_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = chat(client, tool_choice=named, parallel_tool_calls=False, n=4, seed=1, temperature=1.0)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, names=("get_time",))


def test_streamed_calls_come_as_tool_call_deltas(client):
    whole = chat(client, tool_choice="required", temperature=0).choices[0]
    chunks = list(chat(client, tool_choice="required", temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # (no piece of a call as content)
    pieces = [p for d in deltas for p in d.tool_calls or ()]
    streamed = {}
    for piece in pieces:
        call = streamed.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
        if piece.id:
            assert call["id"] is None  # (an id and a name once per call, first)
            call.update(id=piece.id, name=piece.function.name)
        call["arguments"] += piece.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_reads_a_call_and_leaves_a_malformed_one_as_text(client):
    """The output is pinned with a regex (structured_outputs) to a call, then to a broken one."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "(UTC|CET)"}}\n</tool_call>'
    good = chat(client, tool_choice="auto", temperature=0,
                extra_body={"structured_outputs": {"regex": call.replace("{", r"\{").replace("}", r"\}")}})
    choice = good.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, names=("get_time",))
    broken = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": (UTC|CET)\}\}\n</tool_call>'
    choice = chat(client, tool_choice="auto", temperature=0,
                  extra_body={"structured_outputs": {"regex": broken}}).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content.startswith("<tool_call>") and choice.message.content.endswith("</tool_call>")
    chunks = list(chat(client, tool_choice="auto", temperature=0, stream=True,
                       extra_body={"structured_outputs": {"regex": broken}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_without_parallel_calls_the_first_auto_call_ends_the_answer(marker_tools_client, marker_tools_engine):
    """The model is biased to open a call wherever it may (`<tool_call>` is one token of
    this vocabulary): left free after a call, it opens another."""
    bias = {str(token_id(marker_tools_engine.tokenizer, "<tool_call>")): 100}
    fields = dict(tool_choice="auto", temperature=0, logit_bias=bias)
    parallel = chat(marker_tools_client, **fields).choices[0]
    assert len(parallel.message.tool_calls) >= 2
    one = chat(marker_tools_client, **fields, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and one.message.content is None
    assert [c.function.model_dump() for c in one.message.tool_calls] == \
        [parallel.message.tool_calls[0].function.model_dump()]
    check_calls(one.message.tool_calls)
    chunks = list(chat(marker_tools_client, **fields, parallel_tool_calls=False, stream=True))
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or ()]
    assert {p.index for p in pieces} == {0} and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_none_leaves_the_answer_as_text(client):
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
    choice = chat(client, tool_choice="none", extra_body={"structured_outputs": {"regex": call}}).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("<tool_call>\n") and choice.message.content.endswith("</tool_call>")


def test_a_call_and_its_result_go_back_into_the_chat(client, tools_engine):
    call = chat(client, tool_choice="required", temperature=0).choices[0].message
    history = [*MESSAGES, call.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny, 21 C"}]
    answer = chat(client, messages=history, tool_choice="none", max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.prompt_tokens > 0
    # The template wrote the call and the result into the prompt the model read.
    arguments = json.loads(call.tool_calls[0].function.arguments)
    history[1]["tool_calls"][0]["function"]["arguments"] = arguments
    rendered = tools_engine.tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False,
                                                          add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C" in rendered and call.tool_calls[0].function.name in rendered
    assert answer.usage.prompt_tokens == len(tools_engine.tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("fields, param, says", [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "send tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "get_weather"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "each tool must be"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "one of them"),
    ({"parallel_tool_calls": False, "response_format": {"type": "json_object"}}, "parallel_tool_calls",
     "leave out one of them"),
])
def test_malformed_tool_fields_are_400s_naming_them(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, **fields)
    error = raised.value.body
    assert error["param"] == param and says in error["message"], error
