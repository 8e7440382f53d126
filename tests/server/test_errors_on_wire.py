"""Each error of the taxonomy as a client sees it: status, OpenAI envelope, message."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, AppServer, faults_set, start_engine

MODEL = "gemma-3-270m"


def assert_envelope(response, status, type_, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_request_errors_are_400_with_param(server, auth):
    url = f"{server.url}/v1/completions"
    long_prompt = "hello " * 40
    too_long = httpx.post(url, headers=auth, json={"prompt": long_prompt, "max_tokens": 32_760}, timeout=60)
    error = assert_envelope(too_long, 400, "invalid_request_error", "max_tokens")
    assert re.search(r"prompt \(\d+ tokens\) \+ max_tokens \(32760\)", error["message"])
    assert "max_model_len (32768)" in error["message"]
    over_context = httpx.post(url, headers=auth, json={"prompt": long_prompt, "max_tokens": 40_000}, timeout=60)
    error = assert_envelope(over_context, 400, "invalid_request_error", "max_tokens")
    assert "max_tokens is 40000; at most 32768" in error["message"]
    bad_json = httpx.post(url, headers={**auth, "content-type": "application/json"}, content=b"{nope", timeout=60)
    error = assert_envelope(bad_json, 400, "invalid_request_error")
    assert "not valid JSON" in error["message"] and error["code"] == 400  # as every other 400's
    bad_field = httpx.post(url, headers=auth, json={"prompt": "x", "temperature": -1}, timeout=60)
    assert "temperature" in assert_envelope(bad_field, 400, "invalid_request_error", "temperature")["message"]
    missing = httpx.post(url, headers=auth, json={"max_tokens": 3}, timeout=60)
    assert assert_envelope(missing, 400, "invalid_request_error", "prompt")["code"] == 400
    empty = httpx.post(url, headers=auth, json={"prompt": ""}, timeout=60)
    error = assert_envelope(empty, 400, "invalid_request_error", "prompt")
    assert "empty" in error["message"] and error["code"] == 400
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=auth,
                      json={"messages": [{"role": "assistant", "content": "x"}, {"role": "assistant",
                                                                                  "content": "y"}]})
    assert_envelope(chat, 400, "invalid_request_error", "messages")
    unknown = httpx.post(url, headers=auth, json={"prompt": "x", "model": "gpt-9"}, timeout=60)
    error = assert_envelope(unknown, 404, "invalid_request_error", "model")
    assert error["code"] == "model_not_found"


def test_validation_error_on_a_stream_is_a_plain_http_error(server, auth):
    body = {"prompt": "x", "max_tokens": 40_000, "stream": True}
    response = httpx.post(f"{server.url}/v1/completions", headers=auth, json=body, timeout=60)
    assert_envelope(response, 400, "invalid_request_error", "max_tokens")
    assert not response.headers["content-type"].startswith("text/event-stream")
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=40_000, stream=True)


@pytest.fixture(scope="module")
def faulty(server_loop):
    """`serve --max-num-seqs 2 --max-waiting-requests 1` with failing detokenizers, in
    process (an engine of its own: its limits are the engine's)."""
    flags = ("--max-num-seqs", "2", "--max-waiting-requests", "1")
    with faults_set("detokenize@prompt~BOOM,detokenize_init@prompt~KABOOM"):
        engine = start_engine(*flags)
        srv = AppServer(server_loop, engine, *flags)
        yield srv
        srv.stop()
        engine.shutdown()


def test_generation_error_is_500_and_others_are_unaffected(faulty):
    url = f"{faulty.url}/v1/completions"
    ok = httpx.post(url, json={"prompt": "Water boils at", "max_tokens": 4, "temperature": 0}, timeout=60)
    failed = httpx.post(url, json={"prompt": "BOOM goes", "max_tokens": 4, "temperature": 0}, timeout=60)
    error = assert_envelope(failed, 500, "internal_error")
    assert "detokenizing failed" in error["message"] and "injected fault" in error["message"]
    failed_init = httpx.post(url, json={"prompt": "KABOOM goes", "max_tokens": 4}, timeout=60)
    assert "detokenizer" in assert_envelope(failed_init, 500, "internal_error")["message"]
    again = httpx.post(url, json={"prompt": "Water boils at", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert ok.status_code == again.status_code == 200
    assert ok.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


def test_stream_that_fails_sends_one_error_event_then_done(faulty):
    body = {"prompt": "BOOM in a stream", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{faulty.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    errors = [json.loads(e[6:]) for e in events[:-1] if '"error"' in e]
    assert len(errors) == 1 and events[-2] == f"data: {json.dumps(errors[0])}"
    assert errors[0]["error"]["type"] == "internal_error" and "detokenizing" in errors[0]["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "BOOM"}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{faulty.url}/v1/chat/completions", json=chat, timeout=60) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]


def test_errors_stay_out_of_latency_histograms(faulty):
    def count():
        text = httpx.get(f"{faulty.url}/metrics", timeout=60).text
        e2e = float(re.search(r"^gristmill_e2e_request_latency_seconds_count (\S+)$", text, re.M).group(1))
        errors = re.search(r'^gristmill_request_errors_total\{error_type="GenerationError"\} (\S+)$', text, re.M)
        return e2e, float(errors.group(1)) if errors else 0.0

    before = count()
    httpx.post(f"{faulty.url}/v1/completions", json={"prompt": "BOOM", "max_tokens": 4}, timeout=60)
    after = count()
    assert after[0] == before[0] and after[1] == before[1] + 1
    httpx.post(f"{faulty.url}/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=60)
    assert count()[0] == before[0] + 1


def test_overload_is_503_with_retry_after(faulty):
    body = {"prompt": "Tell me a story", "max_tokens": 16, "ignore_eos": True}  # (2 run, 1 waits, 3 are refused)

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{faulty.url}/v1/completions", json=body)
                                          for _ in range(6)))

    responses = asyncio.run(burst())
    overloaded = [r for r in responses if r.status_code == 503]
    assert overloaded and any(r.status_code == 200 for r in responses)
    for r in overloaded:
        assert r.headers["retry-after"] == "1"
        assert "overloaded" in assert_envelope(r, 503, "overloaded_error")["message"]
