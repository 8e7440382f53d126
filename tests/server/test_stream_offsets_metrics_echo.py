"""Streamed logprob offsets under stop strings, /metrics for requests rejected before
generation, and `echo` on /v1/completions, all over HTTP against a real server."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from gristmill.model.loader import resolve_model
from gristmill.tokenizer import load_tokenizer
from tests.server.conftest import API_KEY

MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


# -- text_offset of a streamed completion with a stop string -----------------------------


def test_streamed_text_offsets_equal_non_streamed_with_stop(client):
    # A stop string that never occurs: the server holds back its length - 1 characters
    # of text at every step, which must not shift the offsets.
    request = dict(model=MODEL, prompt="The history of the Roman empire", max_tokens=24, temperature=0,
                   logprobs=1, stop=["@@never-appears@@"], extra_body={"ignore_eos": True})
    plain = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True))
    streamed_tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.tokens]
    streamed_offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
                        for o in c.choices[0].logprobs.text_offset]
    expected = plain.choices[0].logprobs
    assert len(expected.tokens) == 24
    assert expected.text_offset[0] == 0
    assert streamed_tokens == expected.tokens
    assert streamed_offsets == expected.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text


# -- /metrics counts requests that fail before generation ------------------------------


def error_counts(server) -> tuple[float, dict[str, float]]:
    """(gristmill_requests_total{finish_reason="error"}, {error_type: count})."""
    text = httpx.get(f"{server.url}/metrics").text
    requests = re.search(r'^gristmill_requests_total\{finish_reason="error"\} (\S+)$', text, re.M)
    by_type = {m.group(1): float(m.group(2)) for m in
               re.finditer(r'^gristmill_request_errors_total\{error_type="([^"]+)"\} (\S+)$', text, re.M)}
    return float(requests.group(1)) if requests else 0.0, by_type


def test_requests_rejected_before_generation_are_counted_once(server, auth):
    completions, chat = f"{server.url}/v1/completions", f"{server.url}/v1/chat/completions"
    rejected = [
        (completions, {"prompt": "x", "best_of": 3}, 400),                  # unsupported parameter
        (completions, {"prompt": "x", "stop": [""]}, 400),                # SamplingParams rejects it
        (completions, {"prompt": "x", "top_k": -5}, 400),                 # body validation
        (chat, {"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400),
        (chat, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400),
        (completions, {"prompt": []}, 400),                               # empty prompt list
        (completions, {"prompt": ""}, 400),                               # rejected by the engine
        (completions, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400),
        (completions, {"prompt": "x", "model": "gpt-9"}, 404),
    ]
    requests_before, before = error_counts(server)
    for url, body, status in rejected:
        response = httpx.post(url, headers=auth, json=body, timeout=60)
        assert response.status_code == status, (body, response.text)
    # Not a request of this server's API: no key, so it never reaches the generation code.
    assert httpx.post(completions, json={"prompt": "x"}).status_code == 401
    requests_after, after = error_counts(server)
    moved = {kind: after[kind] - before.get(kind, 0.0) for kind in after if after[kind] != before.get(kind)}
    assert moved == {"RequestError": 8, "ModelNotFoundError": 1}
    assert requests_after - requests_before == 9


# -- echo ---------------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_the_completion(client):
    request = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    plain = client.completions.create(**request)
    echoed = client.completions.create(**request, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    assert plain.choices[0].text  # the completion itself is there too, after the prompt
    assert echoed.usage == plain.usage


def test_echo_of_token_ids_is_their_decoded_text(client):
    tokenizer = load_tokenizer(resolve_model(None), "gemma3")
    ids = tokenizer.encode("Water boils at", add_special_tokens=False)
    request = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    plain = client.completions.create(**request)
    echoed = client.completions.create(**request, echo=True)
    assert echoed.choices[0].text == "Water boils at" + plain.choices[0].text
    assert echoed.usage == plain.usage


def test_streamed_echo_sends_the_prompt_first_in_each_choice(client):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    request = dict(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    plain = client.completions.create(**request)
    chunks = list(client.completions.create(**request, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    for index, prompt in enumerate(prompts):
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
        assert texts[0] == prompt
        assert "".join(texts) == prompt + plain.choices[index].text
    assert chunks[-1].usage == plain.usage


def test_echo_with_logprobs_is_refused_only_when_streamed(server, auth):
    # The prompt's logprobs are known once it is all computed: a whole response carries
    # them (tests/server/test_prompt_scoring.py), a stream is refused.
    response = httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=60,
                          json={"prompt": "x", "echo": True, "logprobs": 0, "stream": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "echo"
    assert "not streamed; send it with stream off" in error["message"]


# -- return_token_ids (vLLM's extra field) ----------------------------------------------


def test_return_token_ids_gives_the_ids_of_the_text_and_the_prompt(client):
    tokenizer = load_tokenizer(resolve_model(None), "gemma3")
    request = dict(model=MODEL, prompt=["The capital of France is", "Water boils at"], max_tokens=6,
                   temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    completion = client.completions.create(**request).model_dump()
    for prompt, choice in zip(request["prompt"], completion["choices"]):
        assert len(choice["token_ids"]) == 6
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
        assert choice["prompt_token_ids"] == tokenizer.encode(prompt)
    chunks = [c.model_dump() for c in client.completions.create(**request, stream=True)]
    for index, choice in enumerate(completion["choices"]):
        streamed = [t for c in chunks for ch in c["choices"] if ch["index"] == index for t in ch["token_ids"]]
        assert streamed == choice["token_ids"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, extra_body={"return_token_ids": True}).model_dump()
    assert chat["prompt_token_ids"] and len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert tokenizer.decode(chat["choices"][0]["token_ids"], skip_special_tokens=True) == \
        chat["choices"][0]["message"]["content"]
    plain = client.completions.create(**{**request, "extra_body": {"ignore_eos": True}}).model_dump()
    assert "token_ids" not in plain["choices"][0]  # only when asked
    assert [c["text"] for c in plain["choices"]] == [c["text"] for c in completion["choices"]]
