"""Structured output through the server, with the real `openai` client: OpenAI's
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` extra-body
fields on chat and completions, streamed and not; bad constraints are 400s in OpenAI's
envelope naming the field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY

MODEL = "gemma-3-270m"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_chat_response_format_json_schema_gives_a_valid_document(client):
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    value = json.loads(result.choices[0].message.content)
    assert list(value) == ["name", "age"] and isinstance(value["age"], int)
    assert result.choices[0].finish_reason == "stop"


def test_json_object_streamed_and_vllm_fields_on_completions(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}], max_tokens=40,
        temperature=0, stream=True, response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5,
                                       temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex.choices[0].text)


@pytest.mark.parametrize("extra,param,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format.json_schema must be an object with a 'schema'"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "response_format.json is not valid: Invalid type: objectx"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "structured_outputs.regex is not valid"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
     "not both"),
    # vLLM's options beside the constraint are named, never taken and dropped.
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}}, "structured_outputs",
     "structured_outputs takes exactly one of json, json_object, regex, choice, grammar and no other keys; "
     "leave out disable_any_whitespace"),
])
def test_bad_constraints_are_400s_naming_the_field(server, extra, param, says):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_response_format_text_is_no_constraint_beside_structured_outputs(client):
    """`{"type": "text"}` is OpenAI's default (clients send it unasked): with vLLM's
    `structured_outputs` it is no conflict, and the constraint applies (as in vLLM)."""
    regex = {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}
    for create, kwargs in ((client.chat.completions.create, {"messages": [{"role": "user", "content": "Call me."}],
                                                             "response_format": {"type": "text"}, "extra_body": regex}),
                           (client.completions.create, {"prompt": "Call me at",  # the client has no such argument
                                                        "extra_body": {**regex, "response_format": {"type": "text"}}})):
        result = create(model=MODEL, max_tokens=12, temperature=0, **kwargs)
        choice = result.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", text) and choice.finish_reason == "stop", text
