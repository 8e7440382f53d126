"""Scoring a text by its likelihood over HTTP, as evaluation harnesses do: completions
with echo, logprobs and max_tokens 0 return the prompt's own token logprobs; vLLM's
prompt_logprobs field on completions and chat; on the real bundled model."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

openai = pytest.importorskip("openai")


def _score(client, prompt: str, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0, **extra)


def test_echo_logprobs_with_no_tokens_scores_the_prompt(server, auth):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=auth["Authorization"].split()[1])
    prompt = "The capital of France is Paris"
    scored = _score(client, prompt)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert len(logprobs.tokens) == scored.usage.prompt_tokens
    for token, lp, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == lp and len(top) <= 3  # (the token's own, and the top 2)
    # Offsets point into the returned text: the BOS token has none of it.
    assert logprobs.text_offset[:2] == [0, 0]
    assert all(prompt[at:].startswith(token) for token, at in zip(logprobs.tokens[1:], logprobs.text_offset[1:]))
    # What a harness concludes from it: the likely continuation scores higher.
    unlikely = _score(client, "The capital of France is banana").choices[0].logprobs
    assert logprobs.token_logprobs[-1] > unlikely.token_logprobs[-1]


def test_echo_logprobs_with_generated_tokens_continue_the_prompts(server, auth):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=auth["Authorization"].split()[1])
    prompt = "One, two, three,"
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                                    temperature=0)
    scored = _score(client, prompt).choices[0].logprobs
    logprobs = out.choices[0].logprobs
    prompt_tokens = out.usage.prompt_tokens
    assert logprobs.tokens[:prompt_tokens] == scored.tokens
    assert logprobs.token_logprobs[:prompt_tokens] == pytest.approx(scored.token_logprobs, abs=1e-5)
    assert len(logprobs.tokens) == prompt_tokens + out.usage.completion_tokens == prompt_tokens + 3
    assert logprobs.text_offset[prompt_tokens] == len(prompt)
    assert out.choices[0].text.startswith(prompt)


def test_prompt_logprobs_field_on_completions_and_chat(server, auth):
    url = f"{server.url}/v1"
    completion = httpx.post(f"{url}/completions", headers=auth, timeout=60, json={
        "prompt": "Hello there", "max_tokens": 1, "prompt_logprobs": 1, "return_token_ids": True}).json()
    choice = completion["choices"][0]
    entries, ids = choice["prompt_logprobs"], choice["prompt_token_ids"]
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0
        assert any(v["rank"] == 1 for v in entry.values())
    chat = httpx.post(f"{url}/chat/completions", headers=auth, timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_scoring_requests_that_cannot_be_served_are_400s(server, auth, body, param):
    r = httpx.post(f"{server.url}/v1/completions", headers=auth, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
