"""Constrained chat completions of a reasoning model (a tiny Qwen3 whose chat template opens
`<think>` in the prompt), through the real `openai` client: `response_format` and
`structured_outputs` apply after the reasoning, `max_reasoning_tokens` closes it, whole and
streamed; the field is refused where it has nothing to bound."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import openai_client

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}}, "required": ["answer"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def client(server_loop, reasoning_engine):
    with openai_client(server_loop, reasoning_engine) as served:
        yield served


def ask(client, stream=False, **fields):
    body = dict(model="tiny-qwen3", messages=MESSAGES, max_tokens=48, temperature=0,
                response_format=RESPONSE_FORMAT, extra_body={"max_reasoning_tokens": 4})
    body.update(fields)
    return client.chat.completions.create(**body, stream=stream)


def test_a_json_schema_applies_after_the_reasoning(client):
    choice = ask(client, n=2).choices
    for c in choice:
        assert c.finish_reason == "stop"
        assert c.message.reasoning_content and c.message.reasoning == c.message.reasoning_content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_streamed_the_fields_join_to_the_whole_response(client):
    whole = ask(client).choices[0].message
    chunks = list(ask(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.content
    jsonschema.validate(json.loads(whole.content), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllms_structured_outputs_apply_after_the_reasoning_too(client):
    message = ask(client, response_format=None,
                  extra_body={"max_reasoning_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}
                  ).choices[0].message
    assert message.reasoning_content and message.content in ("yes", "no")


def test_the_output_is_the_reasoning_the_forced_marker_then_the_answer(client, reasoning_engine):
    c = ask(client, extra_body={"max_reasoning_tokens": 4, "return_token_ids": True}).choices[0]
    assert len(c.token_ids) > 5
    text = reasoning_engine.tokenizer.decode(c.token_ids[:5])
    assert text.endswith("</think>") and text[:-len("</think>")].strip() == c.message.reasoning_content
    assert reasoning_engine.tokenizer.decode(c.token_ids[5:], skip_special_tokens=True).lstrip() == c.message.content


@pytest.mark.parametrize("value", [-1, True, 2.5])
def test_a_bad_budget_is_a_400(client, value):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, extra_body={"max_reasoning_tokens": value})
    assert "max_reasoning_tokens" in str(caught.value)


def test_a_budget_on_a_completion_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-qwen3", prompt="2+2=", max_tokens=4,
                                  extra_body={"max_reasoning_tokens": 4})
    assert caught.value.body["param"] == "max_reasoning_tokens"
    assert "this prompt is not one" in caught.value.body["message"]
