"""The server driven by the real `openai` client and raw httpx, against the output of the
AsyncEngine it serves, asked directly."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from gristmill import SamplingParams
from tests.server.conftest import API_KEY

MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def reference(engine, server_loop):
    """Greedy outputs of the same requests straight from the AsyncEngine (`serve`'s
    defaults) the server runs on, on the server's loop (an engine serves one loop)."""

    async def run(prompt, max_tokens, add_special_tokens=True):
        async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                                         add_special_tokens=add_special_tokens):
            pass
        return out

    def generate(prompt, max_tokens, add_special_tokens=True):
        return server_loop.run(run(prompt, max_tokens, add_special_tokens), 300)

    generate.chat = lambda messages, n: generate(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), n, False)
    return generate


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_completion_matches_engine(client, reference):
    expected = reference("The capital of France is", 12)
    result = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                       temperature=0)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.token_ids) == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12
    assert result.model == MODEL and result.object == "text_completion"


def test_streamed_completion_matches_engine(client, reference):
    expected = reference("def fibonacci(n):", 16)
    chunks = list(client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []


def test_chat_matches_engine_streamed_and_not(client, reference):
    messages = [{"role": "user", "content": "Name three colors."}]
    expected = reference.chat(messages, 10)
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].message.role == "assistant"
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_options_n_seed_stop_and_logprobs(client):
    seeded = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=0.9, seed=11)
    first = client.completions.create(**seeded)
    again = client.completions.create(**seeded)
    assert first.choices[0].text == again.choices[0].text
    many = client.completions.create(**seeded, n=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    full = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=16, temperature=0)
    stop = full.choices[0].text[6:10]
    cut = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    with_lp = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=4, temperature=0,
                                        logprobs=2)
    lp = with_lp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_streamed_n_sends_one_finish_per_choice(client):
    """Streams carry only what is new each step ("delta" outputs): put together, each
    choice's text and logprobs, and the usage, equal the non-streamed response's."""
    request = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=3, n=3, logprobs=1)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]

    def joined(i, part):
        return [x for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].logprobs
                for x in getattr(c.choices[0].logprobs, part)]
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}
    plain = client.completions.create(**request)
    assert {c.index: c.text for c in plain.choices} == texts
    for c in plain.choices:
        assert joined(c.index, "tokens") == c.logprobs.tokens
        assert joined(c.index, "token_logprobs") == c.logprobs.token_logprobs
        assert joined(c.index, "text_offset") == c.logprobs.text_offset
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_max_tokens_null_means_the_default(server, auth):
    response = httpx.post(f"{server.url}/v1/completions", headers=auth,
                          json={"prompt": "Hello", "max_tokens": None, "ignore_eos": True}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 16


def test_raw_sse_bytes(server, auth):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        payload = json.loads(event[len("data: "):])
        assert payload["object"] == "text_completion" and re.match(r"cmpl-", payload["id"])


def test_models_health_and_metrics(server, auth):
    models = httpx.get(f"{server.url}/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("gristmill_requests_total", "gristmill_kv_free_blocks", "gristmill_prompt_tokens_total",
                 "gristmill_generation_tokens_total", "gristmill_time_to_first_token_seconds_bucket",
                 "gristmill_inter_token_latency_seconds_bucket", "gristmill_e2e_request_latency_seconds_count",
                 "gristmill_num_requests_running", "gristmill_num_requests_waiting",
                 "gristmill_prefix_cache_hit_tokens_total", "gristmill_prefix_cache_queries_total",
                 "gristmill_prefix_cache_cached_blocks", "gristmill_prefix_cache_hit_rate"):
        assert name in text, name


def test_api_key_is_required(server):
    no_key = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    for response in (no_key, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_all_blocks_free(server, timeout=5.0) -> bool:
    total = metric(server, "gristmill_kv_total_blocks")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "gristmill_kv_free_blocks") == total:
            return True
        time.sleep(0.05)
    return False


def test_prefix_cache_metrics_move_when_requests_share_a_prefix(server, client):
    shared = ("You are a careful assistant. Answer in one short sentence, in plain English, "
              "without lists, and say so when you do not know. The question follows. ")
    names = ("gristmill_prefix_cache_queries_total", "gristmill_prefix_cache_hit_tokens_total")
    queries, hits = (metric(server, name) for name in names)
    prompt_tokens = 0
    for question in ("What is the capital of France?", "How many legs has a spider?"):
        result = client.completions.create(model=MODEL, prompt=shared + question, max_tokens=1, temperature=0)
        prompt_tokens += result.usage.prompt_tokens
    new_queries, new_hits = (metric(server, name) for name in names)
    assert new_queries - queries == prompt_tokens
    # The shared text is over 32 tokens: the second request reuses at least 2 blocks of 16.
    assert new_hits - hits >= 32 and (new_hits - hits) % 16 == 0
    assert metric(server, "gristmill_prefix_cache_cached_blocks") >= 2
    assert 0 < metric(server, "gristmill_prefix_cache_hit_rate") < 1


def test_a_whole_response_still_times_each_token(server, client):
    """A non-streamed response's tokens come from the engine core once, at its end, with
    the time each became known: the latency histograms still get a first token and a gap
    between each two steps that brought tokens (both completions sample in each step)."""
    names = ("gristmill_time_to_first_token_seconds_count", "gristmill_time_to_first_token_seconds_sum",
             "gristmill_inter_token_latency_seconds_count", "gristmill_e2e_request_latency_seconds_sum")
    before = [metric(server, name) for name in names]
    start = time.monotonic()
    result = client.completions.create(model=MODEL, prompt="Count slowly:", max_tokens=12, n=2, temperature=0.9,
                                       seed=5, extra_body={"ignore_eos": True})
    wall = time.monotonic() - start
    assert [c.finish_reason for c in result.choices] == ["length", "length"]
    ttft_count, ttft_sum, itl_count, e2e_sum = (metric(server, name) - b for name, b in zip(names, before))
    assert ttft_count == 1 and itl_count == 12 - 1
    assert 0 < ttft_sum < e2e_sum <= wall


def test_disconnect_frees_blocks(server, auth):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(server, "gristmill_kv_free_blocks") < metric(server, "gristmill_kv_total_blocks")
    assert wait_all_blocks_free(server)

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=auth, timeout=1.5)
    assert wait_all_blocks_free(server)
    assert metric(server, "gristmill_num_requests_running") == 0


def test_clients_that_go_away_are_counted_as_disconnects(server, client):
    """A client that closes its stream mid-way, and one that gives up waiting for a whole
    response, each count once in /metrics as a client disconnect (the 499s of the log)
    and as a request with finish_reason "abort", and stay out of the latency histograms."""
    def disconnects() -> tuple[float, float, float]:
        text = httpx.get(f"{server.url}/metrics").text
        found = [re.search(rf"^{re.escape(name)} (\S+)$", text, re.M) for name in (
            "gristmill_client_disconnects_total", 'gristmill_requests_total{finish_reason="abort"}',
            "gristmill_e2e_request_latency_seconds_count")]
        return tuple(float(m.group(1)) if m else 0.0 for m in found)

    def counted(expected) -> tuple[float, float, float]:
        deadline = time.monotonic() + 10
        while (now := disconnects())[:2] != expected[:2] and time.monotonic() < deadline:
            time.sleep(0.05)
        return now

    before = disconnects()
    long = dict(model=MODEL, prompt="Tell me a long story.", max_tokens=2000, temperature=0,
                extra_body={"ignore_eos": True})
    stream = client.completions.create(stream=True, **long)
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None and next(chunks).choices
    stream.close()
    after_stream = counted((before[0] + 1, before[1] + 1))
    assert after_stream == (before[0] + 1, before[1] + 1, before[2])
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=1.5).completions.create(**long)
    assert counted((before[0] + 2, before[1] + 2)) == (before[0] + 2, before[1] + 2, before[2])
    assert wait_all_blocks_free(server)
