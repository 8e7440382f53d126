"""LLM.chat with tools, on a tiny random-weight Qwen3 whose chat template writes tools and
calls as Qwen's do (`<tool_call>` blocks): the tools reach the template, a forced call
("required", a named function) always parses and matches its function's schema, each
completion carries its calls apart from its text, and malformed tool fields are each
conversation's error. On a vocabulary whose call markers are special tokens, a call is
written with them and read whole, and its text keeps no marker; under "auto" without
parallel calls, the first call ends the answer."""

from __future__ import annotations

import jsonschema
import pytest

from gristmill import LLM, SamplingParams
from tests.chat.reasoning_models import cache_dir, tiny_reasoning_model, token_id
from tests.chat.tools import MESSAGES, SCHEMAS, TOOLS


@pytest.fixture(scope="module")
def llm():
    return LLM(model=tiny_reasoning_model("hermes_tools"), device="cpu", cache_dir=cache_dir(), quantization=None)


@pytest.fixture(scope="module")
def special_markers_llm():
    """The same model with `<tool_call>` and `</tool_call>` special tokens of its vocabulary."""
    model = tiny_reasoning_model("hermes_tools", control=("<tool_call>", "</tool_call>"))
    return LLM(model=model, device="cpu", cache_dir=cache_dir(), quantization=None)


def sampled(seed: int = 0, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=1.0, seed=seed, n=4, **fields)


def test_the_tools_reach_the_template(llm):
    prompt = llm.apply_chat_template(MESSAGES, tools=TOOLS)
    assert "<tools>" in prompt and '"get_weather"' in prompt
    assert "<tools>" not in llm.apply_chat_template(MESSAGES)


def test_required_and_named_calls_parse_and_match_their_schemas(llm):
    named = {"type": "function", "function": {"name": "get_time"}}
    required = llm.chat([MESSAGES, MESSAGES], [sampled(1), sampled(2)], use_tqdm=False, tools=TOOLS,
                        tool_choice="required")
    [one] = llm.chat(MESSAGES, sampled(3), use_tqdm=False, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    for out, names in [(required[0], SCHEMAS), (required[1], SCHEMAS), (one, ("get_time",))]:
        for completion in out.outputs:
            assert completion.error is None and completion.finish_reason == "tool_calls"
            assert completion.text == "" and completion.tool_calls
            for call in completion.tool_calls:
                assert call.name in names
                jsonschema.validate(call.arguments, SCHEMAS[call.name])
    assert all(len(c.tool_calls) == 1 for c in one.outputs)


def test_tool_choice_none_and_no_tools(llm):
    [none] = llm.chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False, tools=TOOLS,
                      tool_choice="none")
    [plain] = llm.chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert none.outputs[0].tool_calls == [] and none.outputs[0].text
    assert plain.outputs[0].tool_calls is None


@pytest.mark.parametrize("fields, message", [
    ({"tools": {"name": "f"}}, "tools must be a list of"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names function 'nope'"),
    ({"tool_choice": "required"}, "the request lists no tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls must be true or false"),
])
def test_malformed_tool_fields_are_each_conversations_error(llm, fields, message):
    outs = llm.chat([MESSAGES, MESSAGES], SamplingParams(max_tokens=4), use_tqdm=False, **fields)
    for out in outs:
        [completion] = out.outputs
        assert completion.finish_reason == "error" and completion.error.startswith("RequestError: ")
        assert message in completion.error


def test_a_forced_call_and_a_constraint_of_the_answer_are_refused_together(llm):
    constrained = SamplingParams(max_tokens=4, structured_output={"choice": ["a"]})
    [out] = llm.chat(MESSAGES, constrained, use_tqdm=False, tools=TOOLS, tool_choice="required")
    assert out.outputs[0].error.startswith("RequestError: tool_choice forces a tool call")


def test_auto_with_a_constraint_of_the_answer_follows_the_constraint(llm):
    # Under "auto" the answer's own constraint wins (its calls would be read, not forced);
    # only a forced call and a constraint are refused together.
    constrained = SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=4, structured_output={"choice": ["yes", "no"]})
    [out] = llm.chat(MESSAGES, constrained, use_tqdm=False, tools=TOOLS, tool_choice="auto")
    for completion in out.outputs:
        assert completion.error is None and completion.text in ("yes", "no") and completion.tool_calls == []


def test_calls_between_special_token_markers_are_written_with_them_and_parsed(special_markers_llm):
    tokenizer = special_markers_llm.get_tokenizer()
    opening, closing = token_id(tokenizer, "<tool_call>"), token_id(tokenizer, "</tool_call>")
    # (special to the decoder, which skips them by default, though not in all_special_tokens)
    assert tokenizer.decode([opening, closing], skip_special_tokens=True) == ""
    # (one call each: this random model, once it may, writes calls until max_tokens)
    outs = special_markers_llm.chat([MESSAGES, MESSAGES], [sampled(11), sampled(12)], use_tqdm=False, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False)
    for completion in (c for out in outs for c in out.outputs):
        assert completion.error is None and completion.finish_reason == "tool_calls"
        for call in completion.tool_calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
        # Each call opens and closes with the one special token (not its text spelled out
        # in pieces), and the parser saw them although special tokens are skipped by default.
        ids = list(completion.token_ids)
        assert ids.count(opening) == ids.count(closing) == len(completion.tool_calls) == 1
        assert completion.text == ""  # (the markers and calls are all it wrote)


def test_without_parallel_calls_the_first_auto_call_ends_the_answer(special_markers_llm):
    """The model is biased to open a call wherever it may: left free after a call, it opens another."""
    opening = token_id(special_markers_llm.get_tokenizer(), "<tool_call>")
    params = SamplingParams(max_tokens=120, temperature=0, logit_bias={opening: 100})
    [parallel] = special_markers_llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS)
    [one] = special_markers_llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS, parallel_tool_calls=False)
    assert len(parallel.outputs[0].tool_calls) >= 2
    completion = one.outputs[0]
    assert completion.finish_reason == "tool_calls" and completion.text == ""
    assert completion.tool_calls == parallel.outputs[0].tool_calls[:1]
    jsonschema.validate(completion.tool_calls[0].arguments, SCHEMAS[completion.tool_calls[0].name])
