"""What int8 costs in quality: perplexity on the fixed public-domain English text the tests
ship (tests/data/public_domain_english.txt), float vs int8, and greedy agreement of int8
with float on a set of prompts (tokens before the first difference).

    python benchmarks/quality.py [--model PATH] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from gristmill import LLM, EngineConfig, SamplingParams
from gristmill.model.runner import ModelRunner
from gristmill.tokenizer import load_tokenizer

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

    results = {}
    for quantization in (None, "int8"):
        runner = ModelRunner(EngineConfig(model=args.model, device="cpu", quantization=quantization,
                                          max_model_len=4096, num_kv_blocks=4096 // 16))
        ids = load_tokenizer(runner.model_dir, runner.hf_config.model_type)(TEXT.read_text()).input_ids
        results[quantization] = math.exp(-runner.score(ids).mean().item())
        del runner
    print(f"perplexity over {len(ids)} tokens: float {results[None]:.3f}  int8 {results['int8']:.3f} "
          f"({results['int8'] / results[None] - 1:+.2%})")

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outs = {q: LLM(args.model, device="cpu", quantization=q).generate(PROMPTS, params, use_tqdm=False)
            for q in (None, "int8")}
    prefixes = []
    for a, b in zip(outs["int8"], outs[None]):
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                             len(b.token_ids)))
    identical = sum(p == args.max_tokens for p in prefixes)
    print(f"greedy agreement over {len(PROMPTS)} prompts x {args.max_tokens} tokens: "
          f"{sum(prefixes) / (len(PROMPTS) * args.max_tokens):.1%} of tokens before the first difference; "
          f"{identical}/{len(PROMPTS)} prompts identical; first differences at {prefixes}")


if __name__ == "__main__":
    main()
