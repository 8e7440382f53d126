"""Quality guard for quantized weights on the real Gemma 3 270M: perplexity on a fixed
English text shipped with the tests (the default: the GGUF's matrices as stored), and
greedy agreement with the float path (int8 and as stored).

The text (tests/data/public_domain_english.txt) is public domain: the US Declaration of
Independence (1776), the Gettysburg Address (1863) and the opening chapter of Pride and
Prejudice (1813). `benchmarks/quality.py` prints the same figures.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gristmill import LLM, SamplingParams
from gristmill.model.quality import tokens_before_first_difference

TEXT = Path(__file__).parent.parent / "data" / "public_domain_english.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are",
           "Here is a short poem about the sea:\n", "In 1492, Columbus", "To make a cup of tea, first",
           "The largest planet in the solar system is"]
TIE = 0.1  # logprob: closer than this in the float model, two tokens are a tie


# The text's first ~1,000 tokens (2,706 in all): scoring is most of this test's time. Over
# them, int8 is within 0.2% of float and q4 (4-bit weights: the figure a broken quantization
# gives) +105%; over the whole text, +0.7% and +87%. Prefixes of 256 to 2,048 tokens put
# int8 between -0.2% and +1.7%: the 2% bound stays as strict, on a sample that still
# tells a broken quantization from a good one.
PERPLEXITY_CHARS = 5300


def _perplexity(llm, text: str) -> tuple[float, int]:
    """(perplexity of `text` under the engine's model, its number of tokens), from the
    prompt logprobs a user asks for (`SamplingParams.prompt_logprobs`)."""
    [out] = llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ids = out.prompt_token_ids
    scored = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(scored) / len(scored)), len(ids)


def test_int8_perplexity_within_two_percent_of_float(default_llm, float_llm):
    text = TEXT.read_text()[:PERPLEXITY_CHARS]
    float_ppl, num_tokens = _perplexity(float_llm, text)
    int8_ppl, _ = _perplexity(default_llm, text)
    assert num_tokens > 1000
    assert 1 < float_ppl < 100, f"float perplexity {float_ppl:.2f}: the model or the text is off"
    change = int8_ppl / float_ppl - 1
    print(f"perplexity over {num_tokens} tokens: float {float_ppl:.3f}, int8 {int8_ppl:.3f} ({change:+.2%})")
    assert abs(change) <= 0.02, f"int8 perplexity {int8_ppl:.3f} vs float {float_ppl:.3f}: {change:+.2%}"


@pytest.fixture(scope="module")
def int8_llm():
    """The bundled model re-quantized to int8 (its Q4_K_M matrices rounded a second time):
    the default before GGUF matrices ran as stored, and still what an HF checkpoint gets."""
    return LLM(device="cpu", quantization="int8")


@pytest.mark.parametrize("path", ["int8", "as stored"])
def test_quantized_greedy_agrees_with_float(path, int8_llm, default_llm, float_llm):
    llm = int8_llm if path == "int8" else default_llm
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    reference = float_llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                           logprobs=5), use_tqdm=False)
    prefix = tokens_before_first_difference(ours, reference)
    print(f"greedy agreement ({path}): {sum(prefix)}/{32 * len(PROMPTS)} tokens before the first difference, "
          f"{prefix}")
    # Greedy decoding amplifies any numeric change once two tokens are close, so agreement
    # is measured up to the first difference.
    assert sum(prefix) >= 0.5 * 32 * len(PROMPTS), prefix
    if path != "int8":
        return
    # int8 must keep the first token, unless the float model itself all but ties it with
    # int8's choice: then any change in the last bits (a different summation order in a
    # norm) picks either, on either path. (Not asked of the weights as stored: their only
    # difference from float is the activations' rounding, which moves these logprobs by up
    # to ~0.17, as int8's does; "In 1492, Columbus" has float's top three within 0.135,
    # and the two paths fall on different ones of them.)
    for prompt, mine, theirs in zip(PROMPTS, ours, reference):
        first, float_logprobs = mine.outputs[0].token_ids[0], theirs.outputs[0].logprobs[0]
        margin = max(v.logprob for v in float_logprobs.values()) - (
            float_logprobs[first].logprob if first in float_logprobs else float("-inf"))
        assert margin <= TIE, (f"{prompt!r}: int8's first token {first} is {margin:.3f} below float's "
                               f"best in float's own logprobs {float_logprobs}")
