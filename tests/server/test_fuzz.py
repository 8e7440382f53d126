"""Bad input never makes a 500: hypothesis throws odd bodies at the real app of
`gristmill serve --max-model-len 48` (in process, over real HTTP), on the tiny
random-weight model (what the app does with a body is the point, not the text)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.batch.inprocess import tiny_model
from tests.server.conftest import AppServer, start_engine

odd = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([2**64, -2**63 - 1]),
                st.floats(allow_nan=True),
                st.text(max_size=12), st.lists(st.integers(-5, 300_000), max_size=4),
                st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(),
                                                                          max_size=2))
small_int = st.one_of(st.integers(-3, 40), odd)
sampling = {
    "model": st.one_of(st.just("gemma-3-270m"), odd), "max_tokens": small_int,
    "temperature": st.one_of(st.floats(0, 2), odd),
    "top_p": odd, "top_k": small_int, "min_p": odd, "seed": odd, "stop": odd, "n": st.one_of(st.integers(-1, 3), odd),
    "logprobs": odd, "stream": st.one_of(st.booleans(), odd), "ignore_eos": odd, "stop_token_ids": odd,
    "stream_options": st.one_of(st.just({"include_usage": True}), odd),
    "presence_penalty": odd, "frequency_penalty": odd,
}
completion_body = st.fixed_dictionaries(
    {}, optional={"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 300_000), max_size=5),
                                      st.lists(st.text(max_size=10), max_size=3), odd), **sampling})
message = st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), odd),
                                              "content": st.one_of(st.text(max_size=20), odd)})
chat_body = st.fixed_dictionaries(
    {}, optional={"messages": st.one_of(st.lists(message, max_size=3), odd), "top_logprobs": odd,
                  "max_completion_tokens": small_int, **sampling})


@pytest.fixture(scope="module")
def small_server(server_loop):
    engine = start_engine("--model", str(tiny_model()), "--max-model-len", "48")
    srv = AppServer(server_loop, engine, "--max-model-len", "48")
    srv.http = httpx.Client(timeout=60)  # one keep-alive connection for every example
    yield srv
    srv.http.close()
    srv.stop()
    engine.shutdown()


def check(response: httpx.Response):
    assert response.status_code != 500 and response.status_code < 600, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]


def post(srv, path: str, body) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode() if not isinstance(body, bytes) else body
    return srv.http.post(f"{srv.url}{path}", content=content, headers={"content-type": "application/json"})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=completion_body)
def test_completions_fuzz(small_server, body):
    check(post(small_server, "/v1/completions", body))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_body)
def test_chat_fuzz(small_server, body):
    check(post(small_server, "/v1/chat/completions", body))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=40))
def test_raw_bytes_fuzz(small_server, raw):
    check(post(small_server, "/v1/completions", raw))
