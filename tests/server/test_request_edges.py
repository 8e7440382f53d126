"""Requests a real client may send at the edges of what the API allows: sampling values
that would overflow float32, explicit nulls, fields other servers take, text that is not
valid Unicode, several prompts streamed at once. Each is answered, or refused with a 400
naming the field; none harms the engine or another request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import API_KEY, AppServer

MODEL = "gemma-3-270m"


def post(server, auth, path: str, body: dict) -> httpx.Response:
    # (ASCII JSON: a lone surrogate goes as the \ud800 escape a client would send)
    return httpx.post(f"{server.url}/v1/{path}", headers={**auth, "Content-Type": "application/json"},
                      content=json.dumps(body), timeout=120)


def refused(response: httpx.Response, param: str, says: str = "") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert says in error["message"], error


def test_extreme_sampling_values_never_reach_a_broken_distribution(server, auth):
    """Each of these once sampled a token id outside the vocabulary and killed the core,
    failing every request in flight; now a temperature below 1e-5 is greedy (as vLLM),
    the most likely token survives any top_p, and a repetition penalty that would
    overflow a logit is refused."""
    url = f"{server.url}/v1/completions"
    prompt = {"prompt": "The capital of France is", "max_tokens": 8}
    greedy = post(server, auth, "completions", {**prompt, "temperature": 0}).json()["choices"][0]["text"]

    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(headers=auth, timeout=120) as client:
            bystander = asyncio.create_task(client.post(url, json={
                "prompt": "Tell me a story.", "max_tokens": 48, "ignore_eos": True, "temperature": 0.8}))
            edges = [await client.post(url, json={**prompt, **fields}) for fields in (
                {"temperature": 1e-39}, {"temperature": 1e-300}, {"temperature": 1, "top_p": 1e-46},
                {"temperature": 1, "top_p": 1e-30, "top_k": 5, "min_p": 0.999})]
            return await bystander, edges

    bystander, edges = asyncio.run(run())
    assert bystander.status_code == 200 and bystander.json()["usage"]["completion_tokens"] == 48
    for response in edges:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == greedy
    refused(post(server, auth, "completions", {**prompt, "repetition_penalty": 1e-300}), "repetition_penalty")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_explicit_nulls_mean_the_defaults(server, auth):
    chat = post(server, auth, "chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "n": None,
        "stream": None, "logprobs": None, "ignore_eos": None, "skip_special_tokens": None, "top_logprobs": None})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    completion = post(server, auth, "completions", {"prompt": "Hi", "max_tokens": 4, "echo": None, "n": None,
                                                    "stream": None, "logprobs": None})
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"]) == 1


def test_fields_that_change_the_output_are_honoured_or_refused(server, auth):
    with_bos = post(server, auth, "completions", {"prompt": "Hello there", "max_tokens": 2, "temperature": 0})
    without = post(server, auth, "completions", {"prompt": "Hello there", "max_tokens": 2, "temperature": 0,
                                                 "add_special_tokens": False})
    assert without.json()["usage"]["prompt_tokens"] == with_bos.json()["usage"]["prompt_tokens"] - 1

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    continued = post(server, auth, "chat/completions", {
        "messages": messages, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
        "continue_final_message": True})
    opened = post(server, auth, "chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0})
    assert continued.status_code == opened.status_code == 200
    # The open message is one turn: fewer prompt tokens than closing it and opening another.
    assert continued.json()["usage"]["prompt_tokens"] < opened.json()["usage"]["prompt_tokens"]
    refused(post(server, auth, "chat/completions", {"messages": messages, "continue_final_message": True}),
            "continue_final_message", "add_generation_prompt")

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for field, value in (("chat_template", "{{ messages }}"), ("echo", True), ("reasoning_effort", "low"),
                         ("return_tokens_as_token_ids", True)):
        refused(post(server, auth, "chat/completions", {**chat, field: value}), field, "not supported")
    # Tools are taken now: a forced call with no tools to call is the client's mistake.
    refused(post(server, auth, "chat/completions", {**chat, "tool_choice": "required"}), "tool_choice", "send tools")
    assert post(server, auth, "chat/completions", {**chat, "tool_choice": "none", "echo": False}).status_code == 200
    refused(post(server, auth, "completions", {"prompt": "Hi", "prompt_embeds": "AAAA"}), "prompt_embeds")
    refused(post(server, auth, "chat/completions", {**chat, "chat_template_kwargs": {"tokenize": True}}),
            "chat_template_kwargs")


def test_text_that_is_not_valid_unicode_is_a_400(server, auth):
    """A lone surrogate (JSON "\\ud800") has no UTF-8 form: the client's mistake, not the server's."""
    lone = json.loads('"Hi \\ud800 there"')
    refused(post(server, auth, "completions", {"prompt": lone}), "prompt", "lone surrogate")
    refused(post(server, auth, "chat/completions", {"messages": [{"role": "user", "content": lone}]}),
            "messages", "lone surrogate")
    refused(post(server, auth, "completions", {"prompt": "Hi", "bad_words": [lone]}), "bad_words", "lone surrogate")


def test_options_that_need_another_are_refused_without_it(server, auth):
    refused(post(server, auth, "completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}),
            "stream_options", "stream")
    refused(post(server, auth, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                    "top_logprobs": 2}), "top_logprobs", "logprobs")
    refused(post(server, auth, "completions", {"prompt": "Hi", "logit_bias": {"999999999": 5}}),
            "logit_bias", "outside the vocabulary")


def test_the_bearer_scheme_is_case_insensitive(server):
    for header in (f"bearer {API_KEY}", f"BEARER  {API_KEY}"):
        response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": header}, timeout=10)
        assert response.status_code == 200, header
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}x"},
                     timeout=10).status_code == 401


@pytest.fixture(scope="module")
def small_buffer_server(server_loop, engine):
    """`serve --max-stream-buffer 4`: a server option, so the package's engine under
    another app."""
    srv = AppServer(server_loop, engine, "--max-stream-buffer", "4")
    yield srv
    srv.stop()


def test_several_prompts_stream_together(small_buffer_server):
    """All the prompts of a streamed request generate at once, and the server reads every
    stream as outputs come: the second prompt never waits unread behind the first (it
    used to overflow the stream buffer and fail as a "slow reader")."""
    body = {"prompt": ["Tell me a story.", "Tell me a joke."], "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{small_buffer_server.url}/v1/completions", json=body, timeout=120) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-2:]
    assert all("usage" in c for c in chunks), "with include_usage every chunk has the key (null but the last)"
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
             for i in (0, 1)}
    order = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert order.index(1) < len(order) - order[::-1].index(0) - 1, "the prompts' chunks interleave"
    plain = httpx.post(f"{small_buffer_server.url}/v1/completions",
                       json={**body, "stream": False, "stream_options": None}, timeout=120).json()
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert chunks[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 48
