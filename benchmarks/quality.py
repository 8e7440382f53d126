"""What quantization costs in quality: perplexity on the fixed public-domain English text
the tests ship (tests/data/public_domain_english.txt), float vs int8 vs q4, and greedy
agreement of each with float on a set of prompts (tokens before the first difference).

    python benchmarks/quality.py [--model PATH] [--max-tokens 32] [--schemes int8,q4]
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
    parser.add_argument("--schemes", default="int8,q4", help="quantizations to compare with float")
    args = parser.parse_args()

    schemes = [s for s in args.schemes.split(",") if s]
    results = {q: perplexity(TEXT.read_text(), q, args.model) for q in [None, *schemes]}
    float_ppl, num_tokens = results[None]
    print(f"perplexity over {num_tokens} tokens: float {float_ppl:.3f}  " + "  ".join(
        f"{q} {results[q][0]:.3f} ({results[q][0] / float_ppl - 1:+.2%})" for q in schemes))

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outs = {q: LLM(args.model, device="cpu", quantization=q).generate(PROMPTS, params, use_tqdm=False)
            for q in [None, *schemes]}
    for q in schemes:
        prefixes = tokens_before_first_difference(outs[q], outs[None])
        identical = sum(p == args.max_tokens for p in prefixes)
        print(f"{q}: greedy agreement over {len(PROMPTS)} prompts x {args.max_tokens} tokens: "
              f"{sum(prefixes) / (len(PROMPTS) * args.max_tokens):.1%} of tokens before the first difference; "
              f"{identical}/{len(PROMPTS)} prompts identical; first differences at {prefixes}")

if __name__ == "__main__":
    main()
