"""logit_bias (OpenAI semantics) through LLM.generate and the server."""

from __future__ import annotations

import httpx
import pytest

from gristmill import RequestError, SamplingParams
from tests.server.conftest import API_KEY


def test_a_bias_of_100_forces_its_token_and_other_rows_are_untouched(default_llm):
    free = SamplingParams(max_tokens=6, temperature=0)
    alone = default_llm.generate(["Once upon a time"], free, use_tqdm=False)[0]
    token = default_llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced, other = default_llm.generate(["The capital of France is", "Once upon a time"],
                                         [SamplingParams(max_tokens=4, temperature=0, logit_bias={token: 100}), free],
                                         use_tqdm=False)
    assert forced.token_ids == [token] * 4
    assert other.token_ids == alone.token_ids
    # -100 bans the token greedy would pick first.
    first = alone.token_ids[0]
    [banned] = default_llm.generate(["Once upon a time"], SamplingParams(max_tokens=1, temperature=0,
                                                                         logit_bias={first: -100}), use_tqdm=False)
    assert banned.token_ids[0] != first


@pytest.mark.parametrize("bias,says", [({1: 101}, "biases in [-100, 100]"), ({-1: 5}, "token ids >= 0"),
                                       ({"x": 1}, "keys must be token ids"), ([1], "must be a dict"),
                                       ({1.7: 5}, "keys must be token ids"), ({True: 5}, "keys must be token ids")])
def test_bad_logit_bias_is_a_request_error(bias, says):
    with pytest.raises(RequestError, match=__import__("re").escape(says)) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_the_server_applies_logit_bias_and_refuses_a_bad_one(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    probe = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                       json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                             "logprobs": 0}).json()
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logit_bias": {"1000": 100}}
    forced = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60).json()
    assert forced["choices"][0]["text"] != probe["choices"][0]["text"]
    assert forced["usage"]["completion_tokens"] == 3
    bad = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                     json={**body, "logit_bias": {"1000": 500}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
