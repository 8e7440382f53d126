"""What real users of the OpenAI API and vLLM send, against a real `gristmill serve`: the
edges of the wire a review found broken (types, fields, routes, bytes, messages). All
share the package's `server` fixture; the one that once killed the engine core runs last
and waits for the server to be healthy either way."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY

MODEL = "gemma-3-270m"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def post(server, auth, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", headers=auth, json=body, timeout=120)


def refused(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


# -- wrong JSON types -------------------------------------------------------------------


def test_completions_logprobs_false_returns_no_logprobs(server, auth):
    """`logprobs: false` (chat's way to turn them off) means no logprobs on completions
    too, so echo works with it; pydantic's lax mode once took it as the integer 0."""
    off = post(server, auth, "completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": False})
    assert off.status_code == 200, off.text
    assert off.json()["choices"][0]["logprobs"] is None, off.json()["choices"][0]["logprobs"]
    echo = post(server, auth, "completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": False, "echo": True})
    assert echo.status_code == 200, echo.text


def test_booleans_are_not_numbers(server, auth):
    """A JSON boolean in a numeric field is a client bug, and OpenAI answers 400 for it:
    never `max_tokens: true` as 1 token, `n: true` as one choice, a bias of 1."""
    base = {"prompt": "Hi", "max_tokens": 1}
    cases = {"max_tokens": {"max_tokens": True}, "n": {"n": True},
             "logit_bias": {"logit_bias": {"5": True}}}  # (temperature, top_p, top_k, seed, penalties alike)
    accepted = []
    for field, extra in cases.items():
        response = post(server, auth, "completions", {**base, **extra})
        if response.status_code != 400 or not (response.json()["error"]["param"] or "").startswith(field):
            accepted.append((field, response.status_code))
    assert not accepted, f"booleans taken as numbers: {accepted}"


def test_validation_error_param_names_the_field_not_a_union_branch(server, auth):
    """A wrong type in a union-typed field (`prompt`, `stop`, message `content`) is a 400
    whose `param` is the request field, not pydantic's branch ("prompt.str")."""
    for path, body, param in (
            ("completions", {"prompt": 5}, "prompt"),
            ("completions", {"prompt": None}, "prompt"),
            ("completions", {"prompt": "Hi", "stop": 5}, "stop"),
            ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content")):
        refused(post(server, auth, path, body), param)


def test_text_part_whose_text_is_not_a_string_is_a_400(server, auth):
    """A content part `{"type": "text", "text": null}` (or a number, an object) is a 400
    naming `messages`, never "None" or a repr in the prompt (which also escaped
    --max-prompt-chars)."""
    for text in (None, 12345, {"a": [1]}):
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}], "max_tokens": 1}
        refused(post(server, auth, "chat/completions", body), "messages")


# -- chat ---------------------------------------------------------------------------------


def test_developer_role_is_served_like_system(server, auth):
    """OpenAI's `developer` role is served as `system` (chat templates know only that;
    Gemma's refused [developer, user] with "roles must alternate")."""
    system = post(server, auth, "chat/completions", {"messages": [{"role": "system", "content": "Be brief."}, *HI],
                                                     "max_tokens": 2, "temperature": 0})
    developer = post(server, auth, "chat/completions", {
        "messages": [{"role": "developer", "content": "Be brief."}, *HI], "max_tokens": 2, "temperature": 0})
    assert system.status_code == 200, system.text
    assert developer.status_code == 200, developer.text
    assert developer.json()["usage"] == system.json()["usage"]


def test_chat_logprob_bytes_are_the_tokens_bytes(server, auth):
    """OpenAI's `logprobs.content[].bytes` is the token's own UTF-8 bytes, so that a client
    can rebuild a character split over several tokens: Gemma's byte token <0xF0> is
    [240], not the bytes of U+FFFD it decodes to alone."""
    byte_token = 478  # Gemma's <0xF0>
    body = {"messages": HI, "max_tokens": 1, "logprobs": True, "logit_bias": {str(byte_token): 100}}
    response = post(server, auth, "chat/completions", body)
    assert response.status_code == 200, response.text
    entry = response.json()["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == [0xF0], entry


def test_stream_options_continuous_usage_stats_is_not_silently_ignored(server, auth):
    """vLLM's `stream_options.continuous_usage_stats: true` puts the usage so far in every
    chunk (an option StreamOptions does not know is a 400, never dropped)."""
    body = {"messages": HI, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = post(server, auth, "chat/completions", body)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(c.get("usage") for c in chunks), [c.get("usage") for c in chunks]
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 3
    unknown = post(server, auth, "chat/completions", {**body, "stream_options": {"include_usage": True, "every": 1}})
    refused(unknown, "stream_options.every")


def test_a_literal_extra_body_field_is_refused(server, auth):
    """`extra_body` is the openai client's keyword argument; sent as a field (curl), its
    contents would be ignored: a 400 saying to put them at the top level."""
    response = post(server, auth, "completions", {"prompt": "Hi", "max_tokens": 2,
                                                  "extra_body": {"structured_outputs": {"choice": ["a", "b"]}}})
    assert "at the top level of the body" in refused(response, "extra_body")["message"]


def test_fields_that_would_be_ignored_are_refused(server, auth):
    """An assistant turn's `tool_calls` without a function (which the template could not
    write), OpenAI's deprecated `function_call` turn, and chat's `max_completion_tokens`
    sent to /v1/completions would change the output: 400s."""
    tool_turn = [*HI, {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}, *HI]
    refused(post(server, auth, "chat/completions", {"messages": tool_turn, "max_tokens": 2}), "messages")
    function_turn = [*HI, {"role": "assistant", "content": None, "function_call": {"name": "f"}}, *HI]
    refused(post(server, auth, "chat/completions", {"messages": function_turn, "max_tokens": 2}), "messages.1")
    refused(post(server, auth, "completions", {"prompt": "Hi", "max_completion_tokens": 2}), "max_completion_tokens")


def test_json_object_with_a_schema_follows_the_schema(server, auth):
    """`{"type": "json_object", "schema": {...}}` (as some OpenAI-compatible services take
    it) follows that schema, not any JSON object."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    response = post(server, auth, "chat/completions", {"messages": HI, "max_tokens": 12, "temperature": 0,
                                                       "response_format": {"type": "json_object", "schema": schema}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["message"]["content"])) == {"ok"}


def test_completion_top_logprobs_hold_the_sampled_token(server, auth):
    """OpenAI's legacy completions return the sampled token's logprob among the top ones
    (up to logprobs + 1 entries), also when it is not among the most likely."""
    response = post(server, auth, "completions", {"prompt": "Hi", "max_tokens": 8, "temperature": 2.0, "seed": 3,
                                                  "logprobs": 1})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert all(token in top and 1 <= len(top) <= 2 for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]))
    assert any(len(top) == 2 for top in logprobs["top_logprobs"])  # (temperature 2: some token is not the likeliest)


def test_include_stop_str_in_output(server, auth):
    """vLLM's extra field keeps the stop string at the end of the text, streamed or not."""
    body = {"prompt": "Hi", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = post(server, auth, "completions", body).json()["choices"][0]["text"]
    stop = text[6:9]
    kept = {**body, "stop": [stop], "include_stop_str_in_output": True}
    plain = post(server, auth, "completions", kept).json()["choices"][0]
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=auth, json={**kept, "stream": True},
                      timeout=60) as response:
        events = [e[6:] for e in response.read().decode().split("\n\n") if e.startswith("data: {")]
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events)
    assert plain["finish_reason"] == "stop" and plain["text"] == text[:text.find(stop) + len(stop)] == streamed


# -- routes and the wire ------------------------------------------------------------------


def test_models_retrieve(client):
    """OpenAI's `GET /v1/models/{model}` (the openai client's `models.retrieve`)."""
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")


def test_json_body_without_content_type(server, auth):
    """A JSON body sent without `Content-Type: application/json` (`requests.post(url,
    data=...)`, `curl -d`) is not read as JSON (FastAPI refuses to, against CSRF): the
    400 says which header to send."""
    raw = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for headers in (auth, {**auth, "Content-Type": "application/x-www-form-urlencoded"}):
        response = httpx.post(f"{server.url}/v1/completions", headers=headers, content=raw, timeout=60)
        assert response.status_code == 400
        assert "send the header Content-Type: application/json" in response.json()["error"]["message"]


def test_prompt_longer_than_the_context_is_not_told_to_use_max_tokens_0(server, auth):
    """A prompt longer than max_model_len is told how long it may be, never to "lower
    max_tokens to at most 0" (max_tokens must be >= 1)."""
    response = post(server, auth, "completions", {"prompt": "x " * 33_000, "max_tokens": 1})
    error = refused(response, "prompt")
    assert "at most 0" not in error["message"], error["message"]
    assert "shorten the prompt to at most" in error["message"] and "max_tokens" not in error["message"]


# -- last: it once killed the engine core --------------------------------------------------


def test_huge_top_k_does_not_kill_the_engine(server, auth):
    """A top_k past the vocabulary keeps every token, however large: 2**63 once overflowed
    `torch.tensor` in the sampler and killed the engine core (503 for everyone in flight)."""
    try:
        body = {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0, "seed": 5}
        huge = post(server, auth, "completions", {**body, "top_k": 2**63})
        assert huge.status_code == 200, huge.text
        every = post(server, auth, "completions", {**body, "top_k": -1})
        assert huge.json()["choices"][0]["text"] == every.json()["choices"][0]["text"]
    finally:  # let the server heal for whatever runs next
        deadline = time.monotonic() + 120
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.25)
