"""LLM.chat on a reasoning model (a tiny Qwen3 whose chat template opens `<think>` in the
prompt): each completion's `reasoning` apart from its answer in `text`; Qwen3's
`enable_thinking` through `chat_template_kwargs`; `generate` leaves text as it is."""

from __future__ import annotations

import pytest

from gristmill import LLM, SamplingParams
from tests.chat.reasoning_models import cache_dir, tiny_reasoning_model, token_id

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
#: Makes greedy decoding write </think> eleven tokens in (then again and again).
CLOSE_BIAS = 14


@pytest.fixture(scope="module")
def llm():
    return LLM(model=tiny_reasoning_model("qwen3_opened"), device="cpu", cache_dir=cache_dir(), quantization=None)


@pytest.fixture(scope="module")
def params(llm):
    close = token_id(llm.get_tokenizer(), "</think>")
    return SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logit_bias={close: CLOSE_BIAS}, n=2)


def raw_output(llm, params, **template_kwargs) -> str:
    """What the model wrote, unsplit: `generate` on the rendered chat."""
    prompt = llm.apply_chat_template(MESSAGES, chat_template_kwargs=template_kwargs or None)
    [out] = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(prompt, add_special_tokens=False)},
                         params, use_tqdm=False)
    assert all(c.reasoning is None for c in out.outputs)  # (generate splits nothing)
    return out.outputs[0].text


def test_the_parser_comes_from_the_chat_template(llm):
    assert llm.reasoning_parser.name == "qwen3"


def test_chat_outputs_carry_the_reasoning_apart(llm, params):
    raw = raw_output(llm, params)
    before, marker, after = raw.partition("</think>")
    assert marker and before.strip() and after
    [out] = llm.chat(MESSAGES, params, use_tqdm=False)
    for completion in out.outputs:  # (greedy: both completions the same)
        assert completion.reasoning == before.strip()
        assert completion.text == after.lstrip()
        assert len(completion.token_ids) == 16


def test_enable_thinking_false_gives_the_answer_alone(llm, params):
    raw = raw_output(llm, params, enable_thinking=False)
    [out] = llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert out.prompt.endswith("<think>\n\n</think>\n\n")
    assert out.outputs[0].reasoning is None and out.outputs[0].text == raw and "</think>" in raw


def test_a_conversation_that_fails_has_no_reasoning(llm, params):
    good, bad = llm.chat([MESSAGES, [{"content": "no role"}]], params, use_tqdm=False)
    assert good.outputs[0].reasoning and bad.outputs[0].reasoning is None
    assert bad.outputs[0].finish_reason == "error" and "messages" in bad.error
