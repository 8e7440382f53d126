"""Tool calls through `LLM.chat` on tiny random-weight models carrying the real chat
templates of Qwen3 (Hermes calls in `<tool_call>` blocks), Llama 3.1 (JSON calls with
`"parameters"`) and Gemma 3 (no call syntax of its own: its template does not render
tools, and gristmill reads its calls as pythonic ones, `[f(a=1)]`, the format Google's
Gemma 3 function-calling guide asks for in the prompt), read from PyPI packages that
carry copies of them (tests/real_templates.py).

`tool_choice="required"` and a named function give calls whose arguments validate in
every one of 200 outputs; under "auto" every call the model writes validates; a history
with the calls and their results renders and is answered; on Qwen3, an answer held to a
JSON schema after the reasoning validates, thinking on or off."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gristmill.sampling import SamplingParams
from tests.chat.tools import SCHEMAS, TOOLS
from tests.real_templates import template

MESSAGES = [{"role": "user", "content": "Weather in Rome?"}]


# name: (architecture, vocabulary, tokens of its own, the parser to name (None: read from
# the template), the token that starts a call under "auto" (biased so that the random
# model writes calls)).
MODELS = {
    "qwen3": ("qwen3", "gpt2", {"user_defined": ("<think>", "</think>", "<tool_call>", "</tool_call>")},
              None, "<tool_call>"),
    "llama3.1": ("llama", "gpt2", {"control": ("<|python_tag|>", "<|start_header_id|>", "<|end_header_id|>",
                                               "<|eot_id|>")}, None, "<|python_tag|>"),
    "gemma3": ("gemma3", "llama", {"user_defined": ("<|python_start|>",)}, "pythonic", "<|python_start|>"),
}
PARSERS = {"qwen3": "hermes", "llama3.1": "llama3_json", "gemma3": "pythonic"}


def tiny_llm(family: str, root):
    from gristmill.llm import LLM
    from tests.model.test_loader import write_tiny_gguf

    arch, vocab, tokens, parser, trigger = MODELS[family]
    path = write_tiny_gguf(root / "tiny.gguf", arch, vocab,
                           {**tokens, "chat_template": template(family), "context_length": 2048})
    engine = LLM(str(path), cache_dir=str(root / "cache"), quantization="none", tool_call_parser=parser)
    assert engine.tokenizer.chat_template == template(family)
    engine.family, engine.trigger = family, trigger
    return engine  # (an in-process engine: nothing to stop)


@pytest.fixture(scope="module", params=sorted(MODELS))
def llm(request, tmp_path_factory):
    return tiny_llm(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_llm("qwen3", tmp_path_factory.mktemp("qwen3-reasoning"))


def completions(llm, choice, n: int, seed: int, parallel=None, logit_bias=None, messages=MESSAGES,
                thinking: bool = True):
    """`n` completions of one chat. On Qwen3 (a reasoning model, whose template leaves the
    model free to open its reasoning), a reasoning budget of 8 tokens, so that a call
    always follows; `thinking` False turns the reasoning off in its template."""
    reasoning = {"max_reasoning_tokens": 8} if llm.family == "qwen3" else {}
    params = SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=160, logit_bias=logit_bias, **reasoning)
    [out] = llm.chat([messages], params, use_tqdm=False, tools=TOOLS, tool_choice=choice,
                     parallel_tool_calls=parallel, chat_template_kwargs={"enable_thinking": thinking})
    return out.outputs


def validate(calls, names=tuple(SCHEMAS)) -> None:
    for call in calls:
        assert call.name in names
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_the_parser_is_the_familys(llm):
    from gristmill.chat.tool_calls import choose_tool_parser
    assert choose_tool_parser(llm.client.config.tool_call_parser, llm.tokenizer.chat_template).name \
        == PARSERS[llm.family]


def test_forced_calls_validate_in_every_one_of_200_outputs(llm):
    # (one call each: with parallel calls a random model may add calls until max_tokens cuts the list)
    required = completions(llm, "required", 100, seed=1, parallel=False)
    named = completions(llm, {"type": "function", "function": {"name": "get_time"}}, 100, seed=2, parallel=False,
                        thinking=False)
    for completion in required:
        assert completion.finish_reason == "tool_calls" and len(completion.tool_calls) == 1, completion.text
        assert not completion.text.strip()
        validate(completion.tool_calls)
    for completion in named:
        assert completion.finish_reason == "tool_calls" and len(completion.tool_calls) == 1, completion.text
        validate(completion.tool_calls, ("get_time",))


def test_auto_calls_validate_whenever_one_is_written(llm):
    [trigger] = llm.tokenizer.encode(llm.trigger, add_special_tokens=False)
    outputs = completions(llm, "auto", 50, seed=3, logit_bias={trigger: 100.0})
    calls = [call for completion in outputs for call in completion.tool_calls or ()]
    assert len(calls) >= 50  # (the bias starts a call again after each one)
    validate(calls)


def test_a_history_with_calls_and_their_results_is_rendered_and_answered(llm):
    call = {"id": "call0", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "hot": True})}}
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call0", "content": "21 C"}]
    if llm.family == "gemma3":
        # Gemma 3's template has no tool role (its roles must alternate user/model): the
        # request fails saying so and what to send instead; the result as a user turn, as
        # Google's guide has it, is answered.
        [completion] = completions(llm, "auto", 1, seed=4, messages=history)
        assert completion.finish_reason == "error"
        assert completion.error.startswith("RequestError: the chat template rejected these messages")
        assert "alternate" in completion.error and "send the tool's result in a user message" in completion.error
        history = [*history[:2], {"role": "user", "content": "```tool_output\n21 C\n```"}]
    [completion] = completions(llm, "auto", 1, seed=4, messages=history)
    assert completion.finish_reason in ("stop", "length", "tool_calls"), completion.error
    prompt = llm.tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "21 C" in prompt
    if llm.family != "gemma3":  # (Gemma 3's template writes an assistant turn's content only)
        assert "Paris" in prompt


@pytest.mark.parametrize("thinking", [True, False])
def test_an_answer_held_to_a_schema_after_qwen3s_reasoning_validates(thinking, qwen3):
    llm = qwen3
    assert llm.reasoning_parser.name == "qwen3"
    # (a random model seldom opens its reasoning: biased to, where thinking is on)
    think = llm.tokenizer.convert_tokens_to_ids("<think>")
    params = SamplingParams(n=20, seed=5, temperature=1.0, max_tokens=120, max_reasoning_tokens=8,
                            structured_output={"json": SCHEMAS["get_weather"]}, logit_bias={think: 100.0})
    [out] = llm.chat([MESSAGES], params, use_tqdm=False, chat_template_kwargs={"enable_thinking": thinking})
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS["get_weather"])
        assert "<think>" not in completion.text and "</think>" not in completion.text
        # (the template closes the reasoning, empty, in the prompt when thinking is off)
        assert bool(completion.reasoning) == thinking
