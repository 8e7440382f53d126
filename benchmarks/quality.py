"""What int8 costs in quality: perplexity on the fixed public-domain English text the tests
ship (tests/data/public_domain_english.txt), float vs int8, and greedy agreement of int8
with float on a set of prompts (tokens before the first difference).

    python benchmarks/quality.py [--model PATH] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gristmill import LLM, SamplingParams
from gristmill.model.quality import perplexity, tokens_before_first_difference

TEXT = Path(__file__).parent.parent / "tests" / "data" / "public_domain_english.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are",
           "Here is a short poem about the sea:\n", "In 1492, Columbus", "To make a cup of tea, first",
           "The largest planet in the solar system is", "Once upon a time", "The meaning of life is",
           "SELECT name FROM users WHERE", "The French word for cat is", "Photosynthesis is the process",
           "import numpy as np\n", "Dear Sir or Madam,", "The speed of light is"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    results = {q: perplexity(TEXT.read_text(), q, args.model) for q in (None, "int8")}
    (float_ppl, num_tokens), (int8_ppl, _) = results[None], results["int8"]
    print(f"perplexity over {num_tokens} tokens: float {float_ppl:.3f}  int8 {int8_ppl:.3f} "
          f"({int8_ppl / float_ppl - 1:+.2%})")

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outs = {q: LLM(args.model, device="cpu", quantization=q).generate(PROMPTS, params, use_tqdm=False)
            for q in (None, "int8")}
    prefixes = tokens_before_first_difference(outs["int8"], outs[None])
    identical = sum(p == args.max_tokens for p in prefixes)
    print(f"greedy agreement over {len(PROMPTS)} prompts x {args.max_tokens} tokens: "
          f"{sum(prefixes) / (len(PROMPTS) * args.max_tokens):.1%} of tokens before the first difference; "
          f"{identical}/{len(PROMPTS)} prompts identical; first differences at {prefixes}")


if __name__ == "__main__":
    main()
