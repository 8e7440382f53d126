"""Forced tool calls on a model whose chat template has no call format (the bundled Gemma 3
270M), with no flags: `tool_choice="required"` or a named function is written by the
grammar in the JSON form (`[{"name": ..., "arguments": {...}}]`) and comes back as
`tool_calls` whose arguments match their schema, on every face: the `openai` client (whole
and streamed), `LLM.chat` and batch rows. `auto` cannot find calls in a form the model was
never told, so it is a 400 naming `--tool-call-parser`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from gristmill import EngineConfig
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, build_processor
from tests.chat.tools import MESSAGES, SCHEMAS, TOOLS
from tests.server.conftest import API_KEY

NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def chat(client, **fields):
    body = dict(model="gemma-3-270m", messages=MESSAGES, tools=TOOLS, max_tokens=80)
    return client.chat.completions.create(**{**body, **fields})


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])


def test_required_and_named_calls_come_back_as_tool_calls(client):
    # One call a choice: the grammar then ends every sampled choice within ~26 tokens.
    response = chat(client, tool_choice="required", parallel_tool_calls=False, n=3, seed=0, temperature=1.0)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert len(choice.message.tool_calls) == 1
        assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
        check_calls([(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls])
    named = chat(client, tool_choice=NAMED, parallel_tool_calls=False, temperature=0).choices[0]
    assert named.finish_reason == "tool_calls" and len(named.message.tool_calls) == 1
    check_calls([(c.function.name, json.loads(c.function.arguments)) for c in named.message.tool_calls],
                names=("get_time",))


def test_parallel_required_calls_are_whole_calls_or_cut_at_max_tokens(client):
    # With parallel calls the array may go on (the 270M model, sampling, repeats its call
    # until max_tokens on some seeds): a choice that ends is calls matching their schemas;
    # one cut at max_tokens is "length", its text the calls' JSON so far, never prose.
    response = chat(client, tool_choice="required", n=6, seed=0, temperature=1.0)
    for choice in response.choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and choice.message.tool_calls, choice
            check_calls([(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls])
        else:
            assert choice.finish_reason == "length" and choice.message.tool_calls is None, choice
            assert choice.message.content.startswith('[{"name": "'), choice
    assert response.usage.completion_tokens <= 6 * 80


def test_a_streamed_forced_call_is_the_same_calls_as_deltas(client):
    fields = dict(tool_choice=NAMED, parallel_tool_calls=False, temperature=0)
    whole = chat(client, **fields).choices[0]
    chunks = list(chat(client, **fields, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    pieces = [p for d in deltas for p in d.tool_calls or ()]
    names = [p.function.name for p in pieces if p.id]
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert names == [c.function.name for c in whole.message.tool_calls]
    assert json.loads(arguments) == json.loads(whole.message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_a_format_is_a_400_naming_the_flag(client):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, tool_choice="auto")
    error = raised.value.body
    assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"], error
    # tools with no tool_choice mean "auto", as in OpenAI's API
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        chat(client)
    assert chat(client, tool_choice="none", max_tokens=4).choices[0].message.tool_calls is None


def test_llm_chat_writes_and_reads_forced_calls(default_llm):
    from gristmill import SamplingParams
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=2)
    [out] = default_llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False)
    for completion in out.outputs:
        assert completion.finish_reason == "tool_calls" and completion.text == "", completion
        check_calls([(c.name, c.arguments) for c in completion.tool_calls])


def test_batch_rows_with_forced_calls_get_their_tool_calls():
    processor = build_processor(EngineProcessorConfig(engine=EngineConfig(device="cpu"), id_column="id",
                                                      should_continue_on_error=True))
    rows = [{"id": "required", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
             "parallel_tool_calls": False, "sampling_params": {"max_tokens": 80, "temperature": 1.0, "seed": 1}},
            {"id": "named", "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED,
             "sampling_params": {"max_tokens": 80}},
            {"id": "auto", "messages": MESSAGES, "tools": TOOLS, "sampling_params": {"max_tokens": 8}}]
    out = {row["id"]: row for row in processor(rows)}
    for name in ("required", "named"):
        row = out[name]
        assert row[ERROR_COLUMN] == "" and row["finish_reason"] == "tool_calls", row
        check_calls([(c["name"], c["arguments"]) for c in row["tool_calls"]],
                    names=("get_time",) if name == "named" else tuple(SCHEMAS))
    assert "--tool-call-parser" in out["auto"][ERROR_COLUMN] and out["auto"]["finish_reason"] == "error"
