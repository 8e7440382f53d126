"""Structured output on a reasoning model, through LLM.chat (tiny random-weight Qwen3s whose
chat templates open `<think>` in the prompt, or leave the model to write it): the constraint
applies after `</think>`, the reasoning before it runs free, and `max_reasoning_tokens`
forces `</think>` when spent, so a valid answer always follows. Requests without a
constraint or a budget, and chats whose prompt closed the reasoning, are unchanged; a
budget with nothing to bound is refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gristmill import LLM, RequestError, SamplingParams
from tests.chat.reasoning_models import cache_dir, tiny_reasoning_model, token_id

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}}, "required": ["answer"]}
JSON = {"json": SCHEMA}
CHOICE = {"choice": ["yes", "no"]}
#: Makes greedy decoding write </think> eleven tokens in (tests/test_llm_reasoning.py).
CLOSE_BIAS = 14


def engine(template: str, **options) -> LLM:
    return LLM(model=tiny_reasoning_model(template), device="cpu", cache_dir=cache_dir(), quantization=None,
               **options)


@pytest.fixture(scope="module")
def llm():
    """The prompt opens the reasoning (as DeepSeek-R1's and Qwen3 2507's templates do)."""
    return engine("qwen3_opened")


@pytest.fixture
def ids(llm):
    tokenizer = llm.get_tokenizer()
    return {marker: token_id(tokenizer, marker) for marker in ("<think>", "</think>")}


def chat(llm, params, **template_kwargs):
    [out] = llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs=template_kwargs or None)
    return out


def raw(llm, completion) -> str:
    """What the model wrote, unsplit."""
    return llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=False)


@pytest.mark.parametrize("constraint", [JSON, CHOICE], ids=["json", "choice"])
def test_a_spent_budget_closes_the_reasoning_and_a_valid_answer_follows(llm, ids, constraint):
    params = SamplingParams(max_tokens=48, temperature=0, structured_output=constraint, max_reasoning_tokens=4, n=2)
    for completion in chat(llm, params).outputs:
        assert completion.finish_reason == "stop", completion.error
        assert completion.token_ids[4] == ids["</think>"]  # four reasoning tokens, then the forced marker
        before, marker, after = raw(llm, completion).partition("</think>")
        assert marker and before.strip() and completion.reasoning == before.strip()
        assert completion.text == after.lstrip()
        if constraint is JSON:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        else:
            assert completion.text in CHOICE["choice"]


def test_the_reasoning_runs_free_until_the_model_closes_it(llm, ids):
    """No budget: the constraint leaves the reasoning alone (the model closes it on its own,
    eleven tokens in) and the answer after it validates."""
    params = SamplingParams(max_tokens=48, temperature=0, structured_output=JSON,
                            logit_bias={ids["</think>"]: CLOSE_BIAS})
    completion = chat(llm, params).outputs[0]
    assert completion.finish_reason == "stop", completion.error
    assert completion.token_ids.index(ids["</think>"]) == 11
    jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert completion.reasoning


def test_a_budget_of_zero_answers_at_once(llm, ids):
    completion = chat(llm, SamplingParams(max_tokens=24, temperature=0, structured_output=CHOICE,
                                          max_reasoning_tokens=0)).outputs[0]
    assert completion.token_ids[0] == ids["</think>"] and completion.reasoning == ""
    assert completion.text in CHOICE["choice"]


def test_a_budget_alone_closes_the_reasoning_and_leaves_the_answer_free(llm, ids):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, max_reasoning_tokens=3)
    completion = chat(llm, params).outputs[0]
    assert completion.token_ids[3] == ids["</think>"] and len(completion.token_ids) == 12
    assert completion.text  # (free text: whatever the model writes)


def test_unconstrained_chats_are_unchanged(llm):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = llm.apply_chat_template(MESSAGES)
    [plain] = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(prompt, add_special_tokens=False)},
                           params, use_tqdm=False)
    assert chat(llm, params).outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token(llm):
    """enable_thinking=False: the whole output is the answer, as a completion of the
    rendered chat under the same constraint."""
    params = SamplingParams(max_tokens=24, temperature=0, structured_output=JSON, max_reasoning_tokens=2)
    completion = chat(llm, params, enable_thinking=False).outputs[0]
    assert completion.reasoning is None
    jsonschema.validate(json.loads(completion.text), SCHEMA)
    prompt = llm.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    [plain] = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(prompt, add_special_tokens=False)},
                           params.clone(max_reasoning_tokens=None), use_tqdm=False)
    assert completion.token_ids == plain.outputs[0].token_ids


def test_a_budget_on_a_prompt_that_is_not_a_chat_is_refused(llm):
    [out] = llm.generate("What is 2+2?", SamplingParams(max_tokens=4, max_reasoning_tokens=8), use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert out.error.startswith("RequestError: max_reasoning_tokens limits the reasoning of a chat, and this "
                                "prompt is not one")


@pytest.mark.parametrize("value", [-1, True, 2.0, "8"])
def test_a_bad_budget_is_refused_naming_the_field(value):
    with pytest.raises(RequestError, match=r"max_reasoning_tokens must be an integer >= 0") as caught:
        SamplingParams(max_reasoning_tokens=value)
    assert caught.value.param == "max_reasoning_tokens"


@pytest.fixture(scope="module")
def hybrid():
    """Qwen3's hybrid template: the model writes `<think>` itself when it reasons (same
    vocabulary as `llm`)."""
    return engine("qwen3")


def test_an_answer_without_reasoning_is_constrained_from_its_first_token(hybrid):
    completion = chat(hybrid, SamplingParams(max_tokens=24, temperature=0, structured_output=JSON)).outputs[0]
    assert completion.reasoning is None  # (greedy, this model answers at once)
    jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_a_first_think_opens_a_reasoning_the_constraint_waits_for(hybrid, ids):
    params = SamplingParams(max_tokens=24, temperature=0, structured_output=JSON, max_reasoning_tokens=3,
                            logit_bias={ids["<think>"]: 100})
    completion = chat(hybrid, params).outputs[0]
    assert completion.finish_reason == "stop", completion.error
    assert raw(hybrid, completion).startswith("<think>")
    assert completion.token_ids[4] == ids["</think>"] and completion.reasoning is not None
    jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_without_a_reasoning_parser_a_budget_is_refused_and_constraints_apply_from_the_start():
    llm = engine("qwen3_opened", reasoning_parser="none")
    [refused] = llm.chat(MESSAGES, SamplingParams(max_tokens=4, max_reasoning_tokens=8), use_tqdm=False)
    assert refused.error.startswith("RequestError: max_reasoning_tokens limits a reasoning model's reasoning, "
                                    "and this engine has no reasoning parser")
    assert "--reasoning-parser" in refused.error
    completion = chat(llm, SamplingParams(max_tokens=24, temperature=0, structured_output=JSON)).outputs[0]
    assert completion.reasoning is None
    jsonschema.validate(json.loads(completion.text), SCHEMA)
