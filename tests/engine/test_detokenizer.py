"""Incremental detokenization with the bundled model's real tokenizer: the one-call-a-token
stream (the Rust DecodeStream) gives exactly the text of the two-decodes-a-token path,
on real text cut at random places, through multi-byte characters split over tokens, one
token or several at a time, and stop strings cut the text the same way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gristmill.engine.detokenizer import IncrementalDetokenizer

TEXT = (Path(__file__).parent.parent / "data" / "public_domain_english.txt").read_text()[:6000]
TEXT += " Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂🚀🙂 and « quotes » — done.\n\tTabs  and  spaces."


def _text(tokenizer, prompt, output, stop=(), stream=True, chunk=1):
    detok = IncrementalDetokenizer(tokenizer, prompt, list(stop))
    if not stream:
        detok._step = None  # the two-decode path
    for i in range(0, len(output), chunk):
        if detok.add_tokens(output[i:i + chunk]):
            break
    return detok.text, detok.stopped


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    assert IncrementalDetokenizer(default_llm.tokenizer, [2], [])._step is not None, "no stream for this tokenizer"
    return default_llm.tokenizer


def test_stream_text_equals_the_two_decode_text_on_random_cuts(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    rng = random.Random(0)
    for _ in range(300):
        start = rng.randrange(0, len(ids) - 80)
        end = start + rng.randrange(1, 80)
        prompt, output = [2] + ids[:start], ids[start:end]
        chunk = rng.choice([1, 1, 3, 7])
        assert _text(tokenizer, prompt, output, chunk=chunk) == _text(tokenizer, prompt, output, stream=False), \
            (start, end, chunk)
    # The tail holds the multi-byte characters: the whole of it, one token at a time.
    tail = ids[-60:]
    text, _ = _text(tokenizer, [2], tail)
    assert text == _text(tokenizer, [2], tail, stream=False)[0]
    assert "日本語" in text and "🙂🚀🙂" in text


def test_stop_strings_cut_the_stream_text_as_before(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    output = ids[:120]
    full, _ = _text(tokenizer, [2], output)
    stop = full[200:206]
    cut, stopped = _text(tokenizer, [2], output, stop=[stop, "never-there"])
    assert stopped and cut == full[:full.index(stop)]
    assert (cut, stopped) == _text(tokenizer, [2], output, stop=[stop, "never-there"], stream=False)


def test_held_tokens_decoded_once_at_the_end_give_the_same_text(tokenizer):
    """Offline generate reads the text only at the end: without stop strings the tokens
    are held and decoded in one call, to the text the step-by-step path gives."""
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    rng = random.Random(1)
    for _ in range(100):
        start = rng.randrange(0, len(ids) - 80)
        prompt, output = [2] + ids[:start], ids[start:start + rng.randrange(1, 80)]
        held = IncrementalDetokenizer(tokenizer, prompt, [], incremental=False)
        for token in output:
            assert held.add_tokens([token]) is False
        assert held.held == output  # nothing decoded yet
        assert held.text == _text(tokenizer, prompt, output)[0] and held.held == []
    # Cut at every token of the multi-byte tail: a text that ends inside a character
    # still gives every character before it (it used to give no text at all).
    tail = ids[-60:]
    for end in range(1, len(tail) + 1):
        held = IncrementalDetokenizer(tokenizer, [2], [], incremental=False)
        held.add_tokens(tail[:end])
        assert held.text == _text(tokenizer, [2], tail[:end])[0], end
    assert held.text.startswith(_text(tokenizer, [2], tail[:10])[0]) and "🙂" in held.text
    # More tokens inside a character than one can hold (a random model's stray byte
    # tokens): the text before them still comes out (it used to give no text at all).
    stray = ids[:40] + tokenizer.convert_tokens_to_ids(["<0x80>"] * 6)
    held = IncrementalDetokenizer(tokenizer, [2], [], incremental=False)
    held.add_tokens(stray)
    assert held.text == _text(tokenizer, [2], stray)[0] == _text(tokenizer, [2], ids[:40])[0]
    # With stop strings the text is still checked token by token.
    assert IncrementalDetokenizer(tokenizer, [2], ["x"], incremental=False).held is None


def test_a_sequence_the_stream_refuses_falls_back_to_the_two_decode_text(tokenizer):
    """Byte-fallback tokens after a prompt that ends inside a character: the Rust stream
    raises "Invalid prefix encountered while decoding stream" (the server once answered
    500 to such a fuzzed request); the detokenizer goes on with the two-decode path from
    the last text the stream gave, and gives the two-decode text. (Fed several tokens a
    call without stop strings, the stream takes these sequences and decodes them its own
    way: nothing raises there.)"""
    prompt = tokenizer("\x85\U000de6eeÃ±").input_ids
    for output in ([396, 237072, 432, 371, 371, 237072, 14144, 237072],
                   [237072, 54132, 432, 396, 393, 3727, 239293, 481]):
        for chunk, stop in ((1, ()), (1, ("never-there",)), (3, ("never-there",)), (8, ("never-there",))):
            detok = IncrementalDetokenizer(tokenizer, prompt, list(stop))
            for i in range(0, len(output), chunk):
                assert detok.add_tokens(output[i:i + chunk]) is False
            assert detok._step is None, "the stream took this sequence: the case no longer tests the fallback"
            assert detok.text == _text(tokenizer, prompt, output, stop=stop, stream=False)[0], (output, chunk)
            assert len(detok.text) >= 8  # nothing dropped on the way
            assert detok.num_tokens == len(output)


@pytest.mark.parametrize("vocab", ["bundled", "gpt2", "llama"])
def test_token_bytes_rebuild_the_text_where_tokens_split_a_character(vocab, tmp_path, request):
    """OpenAI's logprobs `bytes`: each token's own bytes, also for a token that is part of
    a character (and decodes alone to U+FFFD): byte-fallback pieces (Gemma's, SentencePiece
    vocabularies), byte-level BPE pieces (GPT-2's). Their concatenation is the text's UTF-8
    (after the leading space a SentencePiece vocabulary puts before the first word)."""
    from gristmill import LLM
    from gristmill.tokenizer import token_bytes
    from tests.model.test_loader import write_tiny_gguf

    if vocab == "bundled":
        tokenizer = request.getfixturevalue("default_llm").tokenizer
    else:
        tokenizer = LLM(model=str(write_tiny_gguf(tmp_path / "t.gguf", "llama", vocab)), device="cpu").tokenizer
    text = "naïve 日本 🙂 \U00013000\U0001F9FF ok"  # (an Egyptian hieroglyph: bytes even in Gemma's vocabulary)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces = [token_bytes(tokenizer, i) for i in ids]
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # some token is one byte of a character
    assert b"".join(pieces).decode() == (" " + text if vocab == "llama" else text)
