"""What a quantization costs in quality: perplexity of a text, and greedy agreement of
two sets of outputs. Used by tests/model/test_quality.py and benchmarks/quality.py."""

from __future__ import annotations

import math

from gristmill.config import EngineConfig
from gristmill.model.runner import ModelRunner
from gristmill.tokenizer import load_tokenizer


def perplexity(text: str, quantization: str | None, model: str | None = None,
               max_tokens: int = 4096) -> tuple[float, int]:
    """(perplexity of `text` under the model, number of tokens scored), on CPU."""
    runner = ModelRunner(EngineConfig(model=model, device="cpu", quantization=quantization,
                                      max_model_len=max_tokens, num_kv_blocks=max_tokens // 16))
    ids = load_tokenizer(runner.model_dir, runner.hf_config.model_type)(text).input_ids
    return math.exp(-runner.score(ids).mean().item()), len(ids)


def tokens_before_first_difference(outputs, reference) -> list[int]:
    """For each pair of generations (objects with `token_ids`), how many tokens agree
    before the first that differs."""
    counts = []
    for ours, theirs in zip(outputs, reference):
        pairs = zip(ours.token_ids, theirs.token_ids)
        counts.append(next((i for i, (a, b) in enumerate(pairs) if a != b), len(theirs.token_ids)))
    return counts
