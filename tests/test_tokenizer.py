"""Tokenizer helpers on a real (tiny) tokenizer."""

from __future__ import annotations

import json


def test_eos_token_ids_are_the_ends_the_model_has_and_no_unknown_token(tmp_path):
    from gristmill.model.loader import resolve_model
    from gristmill.tokenizer import END_OF_TURN_TOKENS, eos_token_ids, load_tokenizer
    from tests.model.test_loader import write_tiny_gguf

    model_dir = resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", "gemma3", "llama")), str(tmp_path))
    tokenizer = load_tokenizer(model_dir, "gemma3_text")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = tokenizer.get_vocab()
    expected = {config["eos_token_id"], tokenizer.eos_token_id} | {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    assert vocab["<end_of_turn>"] in expected and "<|im_end|>" not in vocab
    assert eos_token_ids(tokenizer, model_dir, config) == expected
    assert tokenizer.unk_token_id not in expected  # (a token it lacks is not looked up as <unk>)
