"""Anthropic's Messages API through the real `anthropic` client against the server: on the
bundled Gemma 3 270M (text, a forced `tool_use` whose input matches its schema, a tool round
trip, stop sequences, count_tokens, streams whose events make the same message), on a tiny
reasoning Qwen3 (`thinking` blocks, `thinking` disabled and budgeted), and bad bodies, which
get Anthropic's error envelope with the right status. Also `/tokenize` and `/detokenize`."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.chat.tools import SCHEMAS
from tests.server.conftest import API_KEY, TINY_MODEL, AppServer, openai_client

MODEL = "gemma-3-270m"
HI = [{"role": "user", "content": "Write one sentence about the sea."}]
TOOLS = [{"name": name, "description": f"the {name.split('_')[1]}", "input_schema": schema}
         for name, schema in SCHEMAS.items()]


def sampled(**fields) -> dict:
    """The Messages fields with temperature, top_p and top_k as a body sends them (today's
    client takes them only through extra_body; agents and older clients send them)."""
    sampling = {k: fields.pop(k) for k in ("temperature", "top_p", "top_k") if k in fields}
    return {**fields, "extra_body": sampling}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_a_text_message_is_the_chat_answer_in_blocks(client, oai):
    message = client.messages.create(**sampled(model=MODEL, max_tokens=12, messages=HI, temperature=0))
    chat = oai.chat.completions.create(model=MODEL, max_tokens=12, messages=HI, temperature=0)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=HI)
    assert counted.input_tokens == chat.usage.prompt_tokens
    with_system = client.messages.count_tokens(model=MODEL, messages=HI, system="Answer in French.")
    assert with_system.input_tokens > counted.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    free = client.messages.create(**sampled(model=MODEL, max_tokens=24, messages=HI, temperature=0)).content[0].text
    word = next(w for w in free.split()[1:] if w.isalpha() and len(w) > 2)
    message = client.messages.create(**sampled(model=MODEL, max_tokens=24, messages=HI, temperature=0,
                                               stop_sequences=[word]))
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == free[:free.index(word)]


def test_a_forced_tool_use_has_input_that_matches_its_schema(client):
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_time"}):
        message = client.messages.create(**sampled(model=MODEL, max_tokens=80, messages=HI, tools=TOOLS, tool_choice=choice,
                                         temperature=1.0))
        assert message.stop_reason == "tool_use"
        uses = [b for b in message.content if b.type == "tool_use"]
        assert uses and all(b.id.startswith("toolu_") for b in uses)
        for use in uses:
            assert choice["type"] == "any" or use.name == "get_time"
            jsonschema.validate(use.input, SCHEMAS[use.name])


def test_a_tool_round_trip(client):
    first = client.messages.create(**sampled(model=MODEL, max_tokens=80, messages=HI, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True}, temperature=0))
    [use] = [b for b in first.content if b.type == "tool_use"]
    history = [*HI, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    answer = client.messages.create(**sampled(model=MODEL, max_tokens=8, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"}, temperature=0))
    assert answer.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in answer.content)
    assert answer.usage.input_tokens == client.messages.count_tokens(model=MODEL, messages=history,
                                                                     tools=TOOLS).input_tokens
    assert answer.usage.input_tokens > first.usage.input_tokens


def test_a_stream_makes_the_same_message(client):
    fields = sampled(model=MODEL, max_tokens=16, messages=HI, temperature=0)
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    forced = dict(fields, max_tokens=80, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    whole = client.messages.create(**forced)
    with client.messages.stream(**forced) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump(exclude={"id"}) | {"id": final.content[i].id}
                                                        for i, b in enumerate(whole.content)]
    assert final.stop_reason == "tool_use"
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events


def test_raw_events_are_anthropics(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}) as response:
        text = "".join(response.iter_text())
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 1


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": HI}, 400, "invalid_request_error", "max_tokens is required"),
    ({"max_tokens": 8, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "images and documents are not supported"),
    ({"max_tokens": 8, "messages": HI, "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error",
     "tool_choice must be"),
    ({"max_tokens": 8, "messages": HI, "top_logprobs": 3}, 400, "invalid_request_error", "top_logprobs"),
    ({"max_tokens": 8, "messages": HI, "tools": TOOLS}, 400, "invalid_request_error", "--tool-call-parser"),
    ({"max_tokens": 8, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 16}}, 400,
     "invalid_request_error", "thinking"),
    ({"model": "claude-3-opus", "max_tokens": 8, "messages": HI}, 404, "not_found_error", "does not exist"),
])
def test_bad_bodies_get_anthropics_error_envelope(server, body, status, kind, says):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, **body},
                          headers={"x-api-key": API_KEY})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"], error


def test_the_client_raises_the_typed_errors(server, client):
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=HI)
    assert raised.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=HI)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=MODEL, max_tokens=0, messages=HI)


def test_tokenize_and_detokenize(server, oai):
    chat = oai.chat.completions.create(model=MODEL, max_tokens=1, messages=HI)
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": HI}).json()
    assert tokens["count"] == len(tokens["tokens"]) == chat.usage.prompt_tokens and tokens["max_model_len"] > 0
    plain = httpx.post(f"{server.url}/tokenize", json={"prompt": "the sea", "return_token_strs": True}).json()
    assert len(plain["token_strs"]) == plain["count"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"]
    assert text.endswith("the sea")
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": HI})
    assert both.status_code == 400
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()[
        "data"][0]["max_model_len"] == tokens["max_model_len"]


@pytest.fixture(scope="module")
def reasoning(server_loop, reasoning_engine):
    srv = AppServer(server_loop, reasoning_engine, model=TINY_MODEL)
    with openai_client(server_loop, reasoning_engine) as chat:
        yield anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0), chat
    srv.stop()


def test_thinking_blocks_on_a_reasoning_model(reasoning):
    client, chat = reasoning
    fields = sampled(model=TINY_MODEL, max_tokens=16, messages=HI, temperature=0)
    message = client.messages.create(**fields)
    answer = chat.chat.completions.create(**fields).choices[0].message
    thinking = [b.thinking for b in message.content if b.type == "thinking"]
    assert thinking == [answer.reasoning_content]
    assert "".join(b.text for b in message.content if b.type == "text") == (answer.content or "")
    with client.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(deltas) == thinking[0] and [b.type for b in final.content] == [b.type for b in message.content]
    off = client.messages.create(**fields, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    budget = client.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": 3})
    bounded = chat.chat.completions.create(**{**fields, "extra_body": {**fields["extra_body"],
                                                                        "max_reasoning_tokens": 3}}).choices[0].message
    assert [b.thinking for b in budget.content if b.type == "thinking"] == [bounded.reasoning_content]
    assert "".join(b.text for b in budget.content if b.type == "text") == (bounded.content or "")
    assert budget.content[0].thinking != thinking[0]  # (the budget cut it short)


def test_output_config_format_holds_the_answer_to_the_schema(client):
    schema = SCHEMAS["get_weather"]
    message = client.messages.create(**sampled(model=MODEL, max_tokens=60, messages=HI, temperature=1.0,
                                               output_config={"format": {"type": "json_schema", "schema": schema}}))
    jsonschema.validate(json.loads(message.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError, match="output_config.effort"):
        client.messages.create(model=MODEL, max_tokens=4, messages=HI, output_config={"effort": "high"})
