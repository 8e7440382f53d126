"""Bounded inputs on the wire: each bound is a 400 in OpenAI's envelope naming the field
and the limit, and the server goes on serving; a client that does not read its stream
does not hold up other clients."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

MiB = 1 << 20


def _post(server, auth, body=None, path="/v1/completions", **kwargs):
    return httpx.post(f"{server.url}{path}", headers={**auth, "content-type": "application/json"},
                      json=body, timeout=60, **kwargs)


def _refused(response, param: str, *says: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for text in says:
        assert text in error["message"], error["message"]
    return error["message"]


def test_request_bodies_over_the_size_limit(server, auth):
    big = {"prompt": "x" * (8 * MiB + 10)}
    _refused(_post(server, auth, big), "body", "larger than 8388608 bytes", "--max-request-bytes")

    def chunks():  # no Content-Length: the server counts as it reads
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"y" * MiB
        yield b'"}'

    chunked = httpx.post(f"{server.url}/v1/completions", headers={**auth, "content-type": "application/json"},
                         content=chunks(), timeout=60)
    _refused(chunked, "body", "larger than 8388608 bytes")


def test_malformed_utf8_and_deep_json(server, auth):
    bad_utf8 = httpx.post(f"{server.url}/v1/completions", headers={**auth, "content-type": "application/json"},
                          content=b'{"prompt": "caf\xe9 \xff"}', timeout=60)
    _refused(bad_utf8, "body", "not valid UTF-8 (byte 15)")
    for depth in (10_000, 100):
        nested = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
        response = httpx.post(f"{server.url}/v1/chat/completions",
                              headers={**auth, "content-type": "application/json"}, content=nested, timeout=60)
        _refused(response, "body", "nests deeper than 64 levels")
    deep_content = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                "x": json.loads("[" * 70 + "]" * 70)}]}]}
    _refused(_post(server, auth, deep_content, "/v1/chat/completions"), "body", "64 levels")


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "z" * 1_000_001}, "prompt", ["1000001 characters", "at most 1000000", "--max-prompt-chars"]),
    ({"prompt": ["hi"] * 257}, "prompt", ["257 prompts", "at most 256"]),
    ({"prompt": "hi", "n": 129}, "n", ["n is 129", "at most 128", "max_num_seqs"]),
    ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens", ["1000000000", "at most 32768", "max_model_len"]),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop", ["17 strings", "at most 16"]),
    ({"prompt": "hi", "stop": "s" * 513}, "stop", ["513 characters", "at most 512"]),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", ["20"]),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ["301 entries", "at most 300"]),
    ({"prompt": "hi", "stop_token_ids": list(range(257))}, "stop_token_ids", ["257 entries", "at most 256"]),
])
def test_completions_bounds(server, auth, body, param, says):
    _refused(_post(server, auth, body), param, *says)


@pytest.mark.parametrize("body, param, says", [
    ({"messages": [{"role": "user", "content": "hi"}] * 1025}, "messages", ["1025 messages", "at most 1024"]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 1_000_001}]}]}, "messages",
     ["1000001 characters of text", "at most 1000000"]),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs",
     ["20"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40_000}, "max_completion_tokens",
     ["at most 32768"]),
])
def test_chat_bounds(server, auth, body, param, says):
    _refused(_post(server, auth, body, "/v1/chat/completions"), param, *says)


def test_the_server_serves_on_after_refusing(server, auth):
    ok = _post(server, auth, {"prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def _running(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("gristmill_num_requests_running "))


def test_a_client_that_does_not_read_its_stream_does_not_hold_up_others(server, auth):
    body = {"prompt": "Hello there", "max_tokens": 24, "ignore_eos": True, "temperature": 0}

    def fast() -> dict:
        response = _post(server, auth, body)
        assert response.status_code == 200
        return response.json()

    expected = fast()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", server.port))
    long = json.dumps({"prompt": "Tell me a very long story.", "max_tokens": 3000, "ignore_eos": True,
                       "stream": True, "logprobs": 5}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Authorization: " + auth["Authorization"].encode() + b"\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(long) + long)
    try:
        deadline = time.monotonic() + 30
        while _running(server) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(3):  # each is answered while the slow one still runs, unread
            got = fast()
            assert got["choices"][0]["text"] == expected["choices"][0]["text"]
            assert _running(server) >= 1
    finally:
        slow.close()  # the client leaves: its request is aborted within a step
    deadline = time.monotonic() + 10
    while _running(server) > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_huge_prompt_is_tokenized_while_the_server_answers_others(server, auth):
    # ~1M characters (the default --max-prompt-chars): about half a second of tokenizing,
    # on a worker thread, so /health and other requests are answered meanwhile.
    huge = json.dumps({"prompt": "word " * 199_000, "max_tokens": 4}).encode()
    uploaded = threading.Event()
    done = {}

    def body():  # (sent with its Content-Length, as json= would send it)
        yield huge
        uploaded.set()  # httpx asks for more only once the body is written

    def send_huge():
        done["huge_response"] = httpx.post(f"{server.url}/v1/completions", content=body(), timeout=60, headers={
            **auth, "content-type": "application/json", "content-length": str(len(huge))})
        done["huge"] = time.monotonic()

    thread = threading.Thread(target=send_huge)
    thread.start()
    assert uploaded.wait(60)  # it is uploaded, and parsed and tokenized from now on
    health = httpx.get(f"{server.url}/health", timeout=60)
    done["health"] = time.monotonic()
    thread.join(60)
    assert health.status_code == 200
    refused = done["huge_response"]
    assert refused.status_code == 400 and "exceeds max_model_len" in refused.json()["error"]["message"]
    assert done["health"] < done["huge"]  # answered while the huge prompt was still tokenizing
