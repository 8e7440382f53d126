"""Tokenizer helpers on a real (tiny) tokenizer."""

from __future__ import annotations

import json

import pytest


def test_eos_token_ids_are_the_ends_the_model_has_and_no_unknown_token(tmp_path):
    from gristmill.model.loader import resolve_model
    from gristmill.tokenizer import END_OF_TURN_TOKENS, eos_token_ids, load_tokenizer
    from tests.model.test_loader import write_tiny_gguf

    model_dir = resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", "gemma3", "llama")), str(tmp_path))
    tokenizer = load_tokenizer(model_dir, "gemma3_text")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = tokenizer.get_vocab()
    eos = config["eos_token_id"]  # (a GGUF's config lists every end-of-sequence token its vocabulary holds)
    expected = {*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} | {
        vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    assert vocab["<end_of_turn>"] in expected and "<|im_end|>" not in vocab
    assert eos_token_ids(tokenizer, model_dir, config) == expected
    assert tokenizer.unk_token_id not in expected  # (a token it lacks is not looked up as <unk>)


def test_gemmas_own_turns_carry_a_tool_round_trip(tmp_path):
    """A Gemma checkpoint without a chat template gets Gemma's turn format, where an
    assistant's calls are a pythonic list in its turn (that the pythonic parser reads back
    as the same calls) and tool results a user turn of ```tool_output blocks."""
    from gristmill.chat.tool_calls import get_tool_parser
    from gristmill.errors import RequestError
    from gristmill.model.loader import resolve_model
    from gristmill.tokenizer import load_tokenizer, render_chat
    from tests.model.test_loader import write_tiny_gguf

    tokenizer = load_tokenizer(resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", "gemma3", "llama")),
                                             str(tmp_path)), "gemma3_text")
    calls = [("get_weather", {"city": "Paris", "hot": True, "days": [1, 2], "unit": None}), ("get_time", {})]
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather and time?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                   for i, (name, args) in enumerate(calls)]},
               {"role": "tool", "tool_call_id": "c0", "content": "21 C"},
               {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
               {"role": "assistant", "content": "21 C at noon."}, {"role": "user", "content": "Thanks"}]
    written = '[get_weather(city="Paris", hot=True, days=[1, 2], unit=None), get_time()]'
    assert render_chat(tokenizer, history) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWeather and time?<end_of_turn>\n"
        f"<start_of_turn>model\n{written}<end_of_turn>\n"
        "<start_of_turn>user\n```tool_output\n21 C\n```\n```tool_output\n12:00\n```<end_of_turn>\n"
        "<start_of_turn>model\n21 C at noon.<end_of_turn>\n<start_of_turn>user\nThanks<end_of_turn>\n"
        "<start_of_turn>model\n")
    parsed = get_tool_parser("pythonic").parse(written)
    assert [(call.name, call.arguments) for call in parsed.calls] == calls and not parsed.error
    # A tool result with no call before it breaks the turns' order, as before.
    with pytest.raises(RequestError, match="alternate"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "tool", "content": "21 C"}])
