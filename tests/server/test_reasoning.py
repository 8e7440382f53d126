"""Chat completions of a reasoning model (a tiny Qwen3 whose chat template opens `<think>`
in the prompt), through the real `openai` client: the reasoning comes back apart from the
answer, in `reasoning_content` and `reasoning`, whole and streamed; `enable_thinking`
reaches the template; a model without reasoning answers as before."""

from __future__ import annotations

import openai
import pytest

from tests.chat.reasoning_models import token_id
from tests.server.conftest import API_KEY, openai_client

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
#: Makes greedy decoding write </think> eleven tokens in (then again and again).
CLOSE_BIAS = 14


@pytest.fixture(scope="module")
def client(server_loop, reasoning_engine):
    with openai_client(server_loop, reasoning_engine) as served:
        yield served


@pytest.fixture(scope="module")
def request_body(reasoning_engine):
    close = token_id(reasoning_engine.tokenizer, "</think>")
    return dict(model="tiny-qwen3", messages=MESSAGES, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True}, logit_bias={str(close): CLOSE_BIAS})


def raw_output(client, reasoning_engine, body, **template_kwargs) -> str:
    """What the model wrote for the chat, unsplit: the same request as a completion of
    the rendered chat."""
    prompt = reasoning_engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                                            **template_kwargs)
    assert prompt.endswith("<think>\n") != bool(template_kwargs)
    extra = {**body["extra_body"], "add_special_tokens": False}
    return client.completions.create(model=body["model"], prompt=prompt, max_tokens=body["max_tokens"],
                                     temperature=0, logit_bias=body["logit_bias"], extra_body=extra).choices[0].text


def test_the_reasoning_comes_apart_from_the_answer(client, reasoning_engine, request_body):
    raw = raw_output(client, reasoning_engine, request_body)
    before, marker, after = raw.partition("</think>")
    assert marker and before.strip() and after  # (the bias made it close the reasoning mid-way)
    message = client.chat.completions.create(**request_body).choices[0].message
    assert message.reasoning_content == message.reasoning == before.strip()
    assert message.content == after.lstrip()  # (a later </think> is the answer's)


def test_streamed_deltas_put_each_piece_in_its_field(client, request_body):
    whole = client.chat.completions.create(**request_body).choices[0].message
    chunks = list(client.chat.completions.create(**request_body, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    assert reasoning and all(getattr(d, "reasoning", None) == getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(reasoning) == whole.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_enable_thinking_false_reaches_the_template(client, reasoning_engine, request_body):
    """The template closes the reasoning in the prompt: all the output is the answer,
    verbatim, </think> and all."""
    raw = raw_output(client, reasoning_engine, request_body, enable_thinking=False)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    message = client.chat.completions.create(
        **{**request_body, "extra_body": {**request_body["extra_body"], **kwargs}}).choices[0].message
    assert message.reasoning_content is None and message.reasoning is None
    assert message.content == raw and "</think>" in raw


def test_a_model_without_reasoning_answers_as_before(server):
    """The bundled Gemma 3 (no <think> in its template): no reasoning fields at all."""
    gemma = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    request = dict(model="gemma-3-270m", messages=MESSAGES, max_tokens=4, temperature=0)
    message = gemma.chat.completions.create(**request).choices[0].message
    assert message.content and "reasoning_content" not in message.model_extra
    deltas = [c.choices[0].delta for c in gemma.chat.completions.create(**request, stream=True)]
    assert not any(d.model_extra for d in deltas)
