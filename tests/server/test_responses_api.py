"""The Responses API (`POST /v1/responses`) through the real `openai` client, on tiny
random-weight Qwen3 models: input strings and items answer as the same chat does; a
reasoning model's reasoning is an item apart from the message; a json_schema format and
forced function calls validate; calls and their outputs go back in as input items; with
`parallel_tool_calls: false` the first call ends an `auto` answer; the stream is the event
sequence `responses.stream` reads, ending in the whole response, whose items (text around
calls included) are those of the same response not streamed; and what a stateless server
cannot do is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.chat.reasoning_models import token_id
from tests.chat.tools import WEATHER
from tests.server.conftest import openai_client

MODEL = "tiny-qwen3"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER,
          "strict": True}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}}, "required": ["answer"]}
#: Sampling pinned, so a response and the chat it maps onto write the same tokens.
FIXED = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(tools_client):
    return tools_client


@pytest.fixture(scope="module")
def reasoning_client(server_loop, reasoning_engine):
    with openai_client(server_loop, reasoning_engine) as served:
        yield served


def chat_text(client, messages, max_tokens) -> tuple[str, int]:
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **FIXED)
    return response.choices[0].message.content, response.usage.prompt_tokens


def test_string_input_answers_as_the_same_chat(client):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, **FIXED)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    text, prompt_tokens = chat_text(client, [{"role": "user", "content": "Hi"}], 6)
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text == message.content[0].text == text
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (prompt_tokens, 6, prompt_tokens + 6)
    # ignore_eos ran it to the limit:
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_message_items_and_instructions_answer_as_the_same_chat(client):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"role": "developer", "content": [{"type": "input_text", "text": "Say more"}]}]
    response = client.responses.create(model=MODEL, input=items, instructions="Be brief", max_output_tokens=4,
                                       **FIXED)
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "Be brief"},
                                             {"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello"},
                                             {"role": "system", "content": "Say more"}], 4)
    assert response.output_text == text and response.usage.input_tokens == prompt_tokens
    assert response.instructions == "Be brief" and response.store is False


def test_a_reasoning_model_gives_a_reasoning_item_then_a_schema_valid_message(reasoning_client):
    fields = dict(model=MODEL, input="What is 2+2?", max_output_tokens=48, temperature=0,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
                  extra_body={"max_reasoning_tokens": 4})
    response = reasoning_client.responses.create(**fields)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text and "</think>" not in reasoning.content[0].text
    assert response.status == "completed" and message.type == "message"
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    with reasoning_client.responses.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert shape(streamed) == shape(response)


def shape(response) -> list[dict]:
    """A response's output and usage, without the ids made fresh for each response."""
    output = [item.model_dump(exclude={"id", "call_id", "parsed_arguments"}, exclude_none=True)
              for item in response.output]
    for item in output:
        for part in item.get("content") or ():
            part.pop("parsed", None)
    return [*output, response.usage.model_dump(), response.status]


def test_required_calls_validate_and_go_back_in_as_items(client, tools_engine):
    response = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, tool_choice="required",
                                       max_output_tokens=120, temperature=1.0, extra_body={"seed": 3})
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and len(calls) == len(response.output) and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    results = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"} for call in calls]
    answer = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "Weather?"}, *(c.model_dump(exclude_none=True) for c in calls),
                            *results],
        tools=TOOLS, tool_choice="none", max_output_tokens=4, **FIXED)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    # The template wrote the calls and their results into the prompt the model read.
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": c.call_id, "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]},
               *({"role": "tool", "tool_call_id": c.call_id, "content": "sunny, 21 C"} for c in calls)]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    rendered = tools_engine.tokenizer.apply_chat_template(history, tools=chat_tools, tokenize=False,
                                                          add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C" in rendered
    assert answer.usage.input_tokens == len(tools_engine.tokenizer.encode(rendered, add_special_tokens=False))


def test_a_streamed_call_comes_as_events_in_order_ending_in_the_whole_response(client):
    fields = dict(model=MODEL, input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                  parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") \
        == final.output[0].arguments
    assert shape(final) == shape(whole) and len(final.output) == 1
    jsonschema.validate(json.loads(final.output[0].arguments), WEATHER)


def call_bias(engine, bias: float) -> dict:
    """logit_bias toward opening a call (`<tool_call>`, one token of `marker_tools_engine`'s vocabulary)."""
    return {"logit_bias": {str(token_id(engine.tokenizer, "<tool_call>")): bias}}


def test_without_parallel_calls_the_first_auto_call_ends_the_response(marker_tools_client, marker_tools_engine):
    fields = dict(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=120, temperature=0,
                  extra_body=call_bias(marker_tools_engine, 100))
    parallel = marker_tools_client.responses.create(**fields)
    assert [item.type for item in parallel.output][:2] == ["function_call", "function_call"]
    one = marker_tools_client.responses.create(**fields, parallel_tool_calls=False)
    assert [item.type for item in one.output] == ["function_call"] and one.status == "completed"
    assert (one.output[0].name, one.output[0].arguments) == (parallel.output[0].name, parallel.output[0].arguments)
    assert one.parallel_tool_calls is False
    with marker_tools_client.responses.stream(**fields, parallel_tool_calls=False) as stream:
        assert shape(stream.get_final_response()) == shape(one)


def test_text_around_a_call_is_the_same_items_streamed_or_not(marker_tools_client, marker_tools_engine):
    """A milder bias: the model writes text, a call, then text again (which a stop string
    ends, so the stream completes)."""
    fields = dict(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=120, temperature=0,
                  extra_body={**call_bias(marker_tools_engine, 20), "stop": [" and"]})
    whole = marker_tools_client.responses.create(**fields)
    assert [item.type for item in whole.output] == ["message", "function_call", "message"], \
        "the model no longer writes text around a call: the case tests nothing"
    with marker_tools_client.responses.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert shape(streamed) == shape(whole) and whole.status == "completed"
    assert kinds.count("response.output_item.added") == 3
    # (the text after the call starts without the whitespace between them)
    assert whole.output[2].content[0].text == whole.output[2].content[0].text.lstrip()


def test_streamed_text_joins_to_the_whole_text(client):
    fields = dict(model=MODEL, input="Hi", max_output_tokens=6, **FIXED)
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    # (a stream that hits max_output_tokens ends in response.incomplete, which the client
    # does not take as a final response)
    assert "".join(deltas) == whole.output_text


@pytest.mark.parametrize("fields, param, says", [
    ({"store": True}, "store", "store: false"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the earlier turns"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type", "function_call_output"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "input_text"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, "input[0].call_id",
     "before its output"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "leave it out"),
    ({"extra_body": {"top_logprobs": 3}}, "top_logprobs", "leave top_logprobs out"),
    ({"extra_body": {"conversation": "conv_1"}}, "conversation", "leave it out"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format",
     "text.format"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "max_model_len"),
])
def test_what_the_server_cannot_do_is_a_400_naming_the_field(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields})
    error = raised.value.body
    assert error["param"] == param and says in error["message"], error


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model="gpt-5", input="Hi")
    assert raised.value.body["param"] == "model"
