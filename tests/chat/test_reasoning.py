"""Reasoning parsers: fixed outputs of each family split as users expect; every cut of a
stream into two or three deltas gives `split`'s fields, a `</think>` cut anywhere never
leaking; random texts and cuts agree with a plain reference split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gristmill.chat.reasoning import (REASONING_PARSERS, Delta, get_reasoning_parser,
                                      reasoning_parser_for)

QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
OPENED = QWEN3_PROMPT + "<think>\n"
THINKING_OFF = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
R1_OLD_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"

# (parser, prompt, output, reasoning, content)
CASES = [
    ("qwen3", QWEN3_PROMPT, "<think>\nTwo and two.\n</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    ("qwen3", None, "<think>\nTwo and two.\n</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    ("qwen3", OPENED, "Two and two.\n</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    ("qwen3", THINKING_OFF, "It is 4. <think> is a tag.", None, "It is 4. <think> is a tag."),
    ("qwen3", QWEN3_PROMPT, "It is 4.", None, "It is 4."),
    ("qwen3", QWEN3_PROMPT, "\n\nIt is < 5.\n", None, "\n\nIt is < 5.\n"),
    ("qwen3", QWEN3_PROMPT, "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),
    ("qwen3", QWEN3_PROMPT, "<think>\nstill thinking when max_tokens hit </thi", "still thinking when max_tokens hit </thi",
     ""),
    ("qwen3", QWEN3_PROMPT, "<think>a < b, </thinking> is not </think>x</think><think>", "a < b, </thinking> is not",
     "x</think><think>"),
    ("qwen3", OPENED, "思考する 🤔 ≠ 5\n</think>\n\n答えは 4 です。", "思考する 🤔 ≠ 5", "答えは 4 です。"),
    ("qwen3", QWEN3_PROMPT, "<thin>k", None, "<thin>k"),
    ("deepseek_r1", R1_PROMPT, "2+2 is 4.\n</think>\n\nThe answer is 4.", "2+2 is 4.", "The answer is 4."),
    ("deepseek_r1", R1_PROMPT, "<think>\n2+2 is 4.\n</think>\n\nThe answer is 4.", "2+2 is 4.", "The answer is 4."),
    ("deepseek_r1", R1_OLD_PROMPT, "<think>\n2+2 is 4.\n</think>\n\nThe answer is 4.", "2+2 is 4.", "The answer is 4."),
    ("deepseek_r1", None, "2+2 is 4.</think>The answer is 4.", "2+2 is 4.", "The answer is 4."),
    ("deepseek_r1", R1_PROMPT, "cut off in the reasoning", "cut off in the reasoning", ""),
    ("deepseek_r1", R1_PROMPT, "</think>", "", ""),
    ("deepseek_r1", R1_PROMPT + "\n</think>\n\n", "Only an answer.", None, "Only an answer."),
]


def _ids(case):
    return f"{case[0]}:{case[2][:24]!r}"


def streamed(parser, prompt, pieces) -> tuple[str, str, list[Delta]]:
    stream = parser.stream(prompt)
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    return ("".join(d.text for d in deltas if d.field == "reasoning"),
            "".join(d.text for d in deltas if d.field == "content"), deltas)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_split_gives_the_reasoning_and_the_answer(case):
    name, prompt, output, reasoning, content = case
    assert get_reasoning_parser(name).split(output, prompt_text=prompt) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_cut_into_two_and_three_deltas_gives_the_same_fields(case):
    name, prompt, output, reasoning, content = case
    parser = get_reasoning_parser(name)
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1):
            got_reasoning, got_content, deltas = streamed(parser, prompt, [output[:i], output[i:j], output[j:]])
            assert (got_reasoning, got_content) == (reasoning or "", content), (i, j)
            assert all(d.text and d.field in ("reasoning", "content") for d in deltas)
            # reasoning always comes before the answer, never after
            fields = [d.field for d in deltas]
            assert fields == sorted(fields, key=("reasoning", "content").index), (i, j)


def test_one_character_at_a_time_holds_back_only_what_may_be_a_marker():
    stream = get_reasoning_parser("qwen3").stream(OPENED)
    assert stream.feed("Two") == [Delta("reasoning", "Two")]
    assert stream.feed(" and <") == [Delta("reasoning", " and")]  # " <" may start </think>
    assert stream.feed("b") == [Delta("reasoning", " <b")]
    assert stream.feed("\n</th") == []
    assert not stream.reasoning_ended
    assert stream.feed("ink>\n\n") == []
    assert stream.reasoning_ended
    assert stream.feed("4") == [Delta("content", "4")]
    assert stream.finish() == []


def test_a_held_back_start_is_decided_by_the_end_of_the_output():
    qwen3 = get_reasoning_parser("qwen3")
    stream = qwen3.stream(QWEN3_PROMPT)
    assert stream.feed("  <thi") == []
    assert stream.finish() == [Delta("content", "  <thi")]
    stream = qwen3.stream(OPENED)
    assert stream.feed("ab  \n</thi") == [Delta("reasoning", "ab")]
    assert stream.finish() == [Delta("reasoning", "  \n</thi")]


def test_reasoning_ended_tells_when_the_answer_begins():
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen3.end_marker == r1.end_marker == "</think>"
    assert not qwen3.reasoning_ended("", QWEN3_PROMPT)  # the first token may open a reasoning
    assert not qwen3.reasoning_ended("<thi", QWEN3_PROMPT)
    assert qwen3.reasoning_ended("It", QWEN3_PROMPT)
    assert not qwen3.reasoning_ended("<think>hmm", QWEN3_PROMPT)
    assert qwen3.reasoning_ended("<think>hmm</think>", QWEN3_PROMPT)
    assert qwen3.reasoning_ended("", THINKING_OFF)
    assert not r1.reasoning_ended("", R1_PROMPT) and not r1.reasoning_ended("hmm</thi", R1_PROMPT)
    assert r1.reasoning_ended("hmm</think>", R1_PROMPT)
    assert qwen3.initial_field(QWEN3_PROMPT) is None and qwen3.initial_field(OPENED) == "reasoning"
    assert qwen3.initial_field(THINKING_OFF) == r1.initial_field(THINKING_OFF) == "content"
    assert r1.initial_field(None) == r1.initial_field(R1_OLD_PROMPT) == "reasoning"


def test_parsers_are_chosen_by_name_or_from_the_chat_template():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwq'.*deepseek_r1, qwen3"):
        get_reasoning_parser("qwq")
    qwen3 = ("{%- if enable_thinking is defined and enable_thinking is false %}"
             "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    r1 = ("{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
          "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    llama = "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    assert reasoning_parser_for(qwen3) == "qwen3"
    assert reasoning_parser_for(r1) == "deepseek_r1"
    assert reasoning_parser_for(llama) is None and reasoning_parser_for(None) is None


def reference_split(text: str, initial: str | None, always_reasons: bool) -> tuple[str | None, str]:
    """The contract of the module docstring, written plainly for a whole text."""
    if initial == "content":
        return None, text
    head = text.lstrip()
    opens = head.startswith("<think>")
    if initial is None and not always_reasons and not opens:
        return None, text
    body = head[len("<think>"):] if opens else text
    reasoning, _, content = body.partition("</think>")
    return reasoning.strip(), content.lstrip()


_FRAGMENTS = ["<think>", "</think>", "<", "</", "think", ">", "</thin", " ", "\n", "a", "é", "🤔"]
_PROMPTS = [None, QWEN3_PROMPT, OPENED, THINKING_OFF, R1_PROMPT]


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(REASONING_PARSERS)), prompt=st.sampled_from(_PROMPTS),
       text=st.lists(st.sampled_from(_FRAGMENTS), max_size=12).map("".join),
       cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=5))
def test_random_texts_cut_at_random_split_as_the_reference_does(name, prompt, text, cuts):
    parser = get_reasoning_parser(name)
    expected = reference_split(text, parser.initial_field(prompt), parser.always_reasons)
    assert parser.split(text, prompt) == expected
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    got_reasoning, got_content, _ = streamed(parser, prompt, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert (got_reasoning, got_content) == (expected[0] or "", expected[1])
