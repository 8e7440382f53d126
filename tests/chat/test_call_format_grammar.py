"""Tool-call grammars over a real (tiny) vocabulary, walked at random: every token drawn
from the grammar's mask, so each walk is an output some model could write. Forced calls in
all three syntaxes (Hermes, Llama 3 JSON, pythonic) always parse and their arguments match
their schema; a lazy grammar leaves the text free until a trigger (a special token, or the
same text in pieces), then holds the call, then lets go; `<tool_call>` as a special token
of the vocabulary is written as that token."""

from __future__ import annotations

import random
from functools import cache

import jsonschema
import pytest

from gristmill.chat.tool_calls import call_schema, get_tool_parser
from gristmill.model.masking import allowed_tokens
from gristmill.structured.grammars import LLGuidanceGrammars, fill_masks, torch_bitmask
from gristmill.structured.spec import parse_constraint

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "hot": {"type": "boolean"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "hot"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "from": {"type": "null"}},
             "required": ["zone"]}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
#: Random walks per parser and vocabulary (the engine-level "every one of 200 outputs" is
#: tests/chat/test_tool_call_templates.py's).
WALKS = 60


@cache
def vocabulary(special_markers: bool):
    """(HF tokenizer, LLGuidanceGrammars) of a tiny Qwen3 vocabulary, with `<tool_call>` and
    `</tool_call>` as special added tokens or not in it at all."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from gristmill.model.loader import convert_gguf
    from tests.model.test_loader import write_tiny_gguf

    root = Path(tempfile.mkdtemp(prefix="gristmill-tool-vocab-"))
    control = ("<tool_call>", "</tool_call>", "<|python_tag|>") if special_markers else ()
    path = write_tiny_gguf(root / "src" / "tiny.gguf", "qwen3", "gpt2", {"control": control})
    (root / "out").mkdir()
    convert_gguf(path, root / "out")
    tokenizer = AutoTokenizer.from_pretrained(str(root / "out"))
    grammars = LLGuidanceGrammars(lambda: tokenizer, len(tokenizer), {tokenizer.eos_token_id},
                                  root / "out" / "tokenizer.json")
    return tokenizer, grammars


def walk(matcher, rng: random.Random, eos: int, vocab: int, max_tokens: int = 2000) -> list[int]:
    """Tokens drawn one by one from `matcher`'s mask until it finishes (or only EOS is left;
    where EOS may come, it comes half the time)."""
    out = []
    for _ in range(max_tokens):
        bitmask = torch_bitmask(1, vocab)
        fill_masks([matcher], bitmask)
        allowed = allowed_tokens(bitmask, vocab)[0].nonzero().flatten().tolist()
        choices = [t for t in allowed if t != eos] or allowed
        token = eos if eos in allowed and rng.random() < 0.5 else rng.choice(choices)
        assert matcher.accept(token)
        out.append(token)
        if token == eos or matcher.finished or allowed == [eos]:
            break
    return out


def check(parsed, names=tuple(SCHEMAS)) -> None:
    assert parsed.calls and not parsed.error and not parsed.content.strip(), parsed
    for call in parsed.calls:
        assert call.name in names
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic", "json"])
def test_forced_calls_always_parse_and_match_their_schema(parser, special):
    tokenizer, grammars = vocabulary(special)
    rng = random.Random(0)
    tool_parser = get_tool_parser(parser)
    eos = tokenizer.eos_token_id
    for choice, parallel, names in (("required", True, tuple(SCHEMAS)),
                                    ({"type": "function", "function": {"name": "get_time"}}, False, ("get_time",))):
        constraint = parse_constraint(get_tool_parser(parser).forced(call_schema(TOOLS, choice, parser), parallel))
        for _ in range(WALKS // 2):
            tokens = walk(grammars.matcher(constraint), rng, eos, len(tokenizer))
            text = tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=False)
            parsed = tool_parser.parse(text)
            check(parsed, names)
            assert parallel or len(parsed.calls) == 1


def test_a_special_marker_is_written_as_its_token():
    tokenizer, grammars = vocabulary(True)
    begin, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    constraint = parse_constraint(get_tool_parser("hermes").forced(call_schema(TOOLS, "required", "hermes"), False))
    tokens = walk(grammars.matcher(constraint), random.Random(1), tokenizer.eos_token_id, len(tokenizer))
    assert tokens[0] == begin and end in tokens
    # (the plain text "<" cannot start it: the marker is the token)
    assert not grammars.matcher(constraint).allows(tokenizer.convert_tokens_to_ids("<"))


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("parser, opening", [("hermes", "<tool_call>"), ("llama3_json", '{"name"'),
                                             ("llama3_json", "<|python_tag|>"), ("pythonic", "[get_time(")])
def test_a_lazy_grammar_holds_a_call_once_it_starts(parser, opening, special):
    tokenizer, grammars = vocabulary(special)
    rng = random.Random(2)
    eos = tokenizer.eos_token_id
    constraint = parse_constraint(get_tool_parser(parser).lazy(call_schema(TOOLS, "auto", parser)))
    free_text = "Let me check. " if opening != "[get_time(" and opening != '{"name"' else ""
    for _ in range(WALKS // 10):
        matcher = grammars.matcher(constraint)
        prefix = tokenizer.encode(free_text + opening, add_special_tokens=False)
        for token in prefix[:-1]:
            assert matcher.accept(token) and not matcher.holding and not matcher.constrains_next
        assert matcher.accept(prefix[-1]) and matcher.holding
        tokens = prefix + walk(matcher, rng, eos, len(tokenizer))
        assert not matcher.holding  # (released once the call is whole)
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        parsed = get_tool_parser(parser).parse(text)
        assert len(parsed.calls) >= 1 and not parsed.error, text
        for call in parsed.calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_free_text_is_left_alone_and_a_trigger_in_pieces_still_counts():
    tokenizer, grammars = vocabulary(False)
    constraint = parse_constraint(get_tool_parser("hermes").lazy(call_schema(TOOLS, "auto", "hermes")))
    matcher = grammars.matcher(constraint)
    for token in tokenizer.encode("Sure, [1] {x} <tool_ no call here", add_special_tokens=False):
        assert matcher.allows(token) and matcher.accept(token) and not matcher.holding
    bitmask = torch_bitmask(1, len(tokenizer))
    bitmask.zero_()
    fill_masks([matcher], bitmask)
    assert allowed_tokens(bitmask, len(tokenizer)).all()
    for piece in ("<", "tool", "_", "call", ">"):  # spelled in pieces, not as the tokenizer would
        for token in tokenizer.encode(piece, add_special_tokens=False):
            matcher.accept(token)
    assert matcher.holding and matcher.constrains_next
    assert not matcher.allows(tokenizer.encode("x", add_special_tokens=False)[0])


def test_a_start_trigger_counts_only_at_the_start():
    tokenizer, grammars = vocabulary(False)
    constraint = parse_constraint(get_tool_parser("pythonic").lazy(call_schema(TOOLS, "auto", "pythonic")))
    matcher = grammars.matcher(constraint)
    for token in tokenizer.encode("See [get_time(zone=", add_special_tokens=False):
        matcher.accept(token)
    assert not matcher.holding
    matcher = grammars.matcher(constraint)
    for token in tokenizer.encode("  [get_time(", add_special_tokens=False):
        matcher.accept(token)
    assert matcher.holding


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("parser, opening", [("hermes", "<tool_call>"), ("llama3_json", '{"name"'),
                                             ("llama3_json", "<|python_tag|>"), ("pythonic", "[get_time("),
                                             ("pythonic", "<|python_start|>")])
def test_without_parallel_calls_the_first_call_ends_the_answer(parser, opening, special):
    tokenizer, grammars = vocabulary(special)
    rng = random.Random(3)
    eos = tokenizer.eos_token_id
    free_text = "Let me check. " if opening in ("<tool_call>", "<|python_tag|>") else ""
    parallel = parse_constraint(get_tool_parser(parser).lazy(call_schema(TOOLS, "auto", parser)))
    one = parse_constraint(get_tool_parser(parser).lazy(call_schema(TOOLS, "auto", parser), parallel=False))
    prefix = tokenizer.encode(free_text + opening, add_special_tokens=False)
    for _ in range(WALKS // 10):
        matcher = grammars.matcher(one)
        for token in prefix:
            assert matcher.accept(token)
        tokens = prefix + walk(matcher, rng, eos, len(tokenizer))
        assert matcher.finished  # (the call ended the answer; no end-of-sequence token was needed)
        text = tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=False)
        parsed = get_tool_parser(parser).parse(text)
        assert len(parsed.calls) == 1 and not parsed.error and parsed.content == free_text.rstrip(), text
        jsonschema.validate(parsed.calls[0].arguments, SCHEMAS[parsed.calls[0].name])
    # With parallel calls the same call lets go: anything may follow it, a second call too.
    matcher = grammars.matcher(parallel)
    for token in tokens:
        if token != eos:
            assert matcher.accept(token)
    assert not matcher.holding and not matcher.finished and not matcher.constrains_next
