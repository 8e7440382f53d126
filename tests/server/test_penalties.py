"""Penalties, min_tokens and bad_words on the real bundled model, through LLM.generate and
the server with the real openai client; fields that would change the output and are not
supported are a 400 naming them. (Their arithmetic against transformers' processors is
in tests/model/test_logits_controls.py.)"""

from __future__ import annotations

import openai
import pytest

from gristmill import SamplingParams
from tests.server.conftest import API_KEY

MODEL = "gemma-3-270m"
LOOPING = "The capital of France is"  # greedy, the bundled model says the same sentence over and over


def _distinct(token_ids: list[int]) -> float:
    return len(set(token_ids)) / len(token_ids)


def test_penalties_break_a_loop_and_leave_other_rows_alone(default_llm):
    greedy = SamplingParams(max_tokens=30, temperature=0)
    free, other = default_llm.generate([LOOPING, "Once upon a time"], greedy, use_tqdm=False)
    penalized = default_llm.generate(
        [LOOPING, LOOPING, LOOPING, "Once upon a time"],
        [greedy.clone(repetition_penalty=1.3), greedy.clone(frequency_penalty=1.0),
         greedy.clone(presence_penalty=1.5), greedy], use_tqdm=False)
    for output in penalized[:3]:
        assert output.outputs[0].token_ids != free.outputs[0].token_ids
        assert _distinct(output.outputs[0].token_ids) > _distinct(free.outputs[0].token_ids)
    assert penalized[3].outputs[0].token_ids == other.outputs[0].token_ids


def test_bad_words_never_appear(default_llm):
    greedy = SamplingParams(max_tokens=30, temperature=0)
    free, banned = default_llm.generate([LOOPING, LOOPING], [greedy, greedy.clone(bad_words=["capital", "France"])],
                                        use_tqdm=False)
    assert "capital" in free.outputs[0].text and "France" in free.outputs[0].text
    assert "capital" not in banned.outputs[0].text and "France" not in banned.outputs[0].text


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(default_llm):
    """A short answer that ends on a stop token (banned by the sampler, as EOS is), and
    one that ends on a stop string (not looked for): with min_tokens, neither ends
    before that many tokens."""
    greedy = SamplingParams(max_tokens=40, temperature=0)
    prompt = "Q: Is the sky blue? Answer yes or no.\nA:"
    newline = default_llm.tokenizer.convert_tokens_to_ids("\n")
    [short] = default_llm.generate([prompt], greedy.clone(stop_token_ids=[newline]), use_tqdm=False)
    [held] = default_llm.generate([prompt], greedy.clone(stop_token_ids=[newline], min_tokens=12), use_tqdm=False)
    assert short.outputs[0].finish_reason == "stop" and len(short.outputs[0].token_ids) < 12
    assert short.outputs[0].token_ids[-1] == newline
    assert len(held.outputs[0].token_ids) > 12 and newline not in held.outputs[0].token_ids[:12]

    [cut] = default_llm.generate([prompt], greedy.clone(stop=["\n"]), use_tqdm=False)
    [later] = default_llm.generate([prompt], greedy.clone(stop=["\n"], min_tokens=12), use_tqdm=False)
    assert cut.outputs[0].finish_reason == "stop" and len(cut.outputs[0].token_ids) < 12
    assert later.outputs[0].finish_reason == "stop" and len(later.outputs[0].token_ids) >= 12
    assert later.outputs[0].text.startswith(cut.outputs[0].text + "\n")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_the_server_applies_every_penalty(client, default_llm):
    free = client.completions.create(model=MODEL, prompt=LOOPING, max_tokens=30, temperature=0)
    for fields, extra in [({"presence_penalty": 1.5}, {}), ({"frequency_penalty": 1.0}, {}),
                          ({}, {"repetition_penalty": 1.3}), ({}, {"bad_words": ["capital"]})]:
        response = client.completions.create(model=MODEL, prompt=LOOPING, max_tokens=30, temperature=0,
                                             extra_body=extra, **fields)
        assert response.choices[0].text != free.choices[0].text, (fields, extra)
    # The same request offline gives the same text: the fields mean the same on both faces.
    [offline] = default_llm.generate([LOOPING], SamplingParams(max_tokens=30, temperature=0, bad_words=["capital"]),
                                     use_tqdm=False)
    assert response.choices[0].text == offline.outputs[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=40, temperature=0,
        stop=["\n"], extra_body={"min_tokens": 15})
    assert chat.usage.completion_tokens >= 15


@pytest.mark.parametrize("extra,param", [
    ({"best_of": 3}, "best_of"), ({"use_beam_search": True}, "use_beam_search"),
    ({"suffix": "end"}, "suffix"), ({"guided_regex": "[0-9]+"}, "guided_regex"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 50}, "min_tokens"),
    ({"bad_words": [""]}, "bad_words"), ({"presence_penalty": 3}, "presence_penalty")])
def test_a_field_that_would_change_the_output_is_supported_or_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, extra_body=extra)
    assert info.value.status_code == 400
    body = info.value.body
    assert body.get("param") == param or param in str(body), body


def test_fields_that_change_nothing_still_pass(client):
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, user="someone",
                                         extra_body={"best_of": 1, "use_beam_search": False})
    assert response.usage.completion_tokens == 2
