"""What structured output and penalties cost: the same batch (64 rows, 64 greedy tokens,
EOS ignored for the free rows) with every row under a JSON schema, with every row asking
for all three penalties (repetition, presence, frequency), and with neither, side by side
in one run on the bundled model; plus the grammar compile time of that schema, cold (a
new engine) and cached.

    python benchmarks/structured_output.py [--device cpu|cuda] [--batch 64] [--tokens 64] [--temperature 0]
"""

from __future__ import annotations

import argparse
import time

from gristmill import LLM, SamplingParams
from gristmill.structured.spec import parse_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "status": {"enum": ["active", "inactive", "banned"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "status", "age", "tags", "address"],
    "additionalProperties": False,
}


def run(llm: LLM, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--backend", default="llguidance", help="llguidance (the default) or xgrammar")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=max(64, args.batch),
              structured_output_backend=args.backend)
    print(f"grammar engine: {args.backend}; device: {args.device}; temperature {args.temperature}")
    prompts = [f"Record {i}: describe customer number {i} as JSON:" for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0,
                                 structured_output={"json": SCHEMA})
    penalized = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0, ignore_eos=True,
                               repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)

    start = time.perf_counter()
    grammars = llm.core._make_grammars(llm.inputs.eos_token_ids)
    setup = time.perf_counter() - start
    constraint = parse_constraint({"json": SCHEMA})
    start = time.perf_counter()
    grammars.matcher(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    grammars.matcher(constraint)
    cached = time.perf_counter() - start
    llm.core._grammars = grammars

    run(llm, prompts[:4], free)  # warm
    figures = {}
    runner = llm.core.executor
    for name, params in (("free", free), ("json schema", constrained), ("penalties", penalized),
                         ("free again", free)):
        stats = list(runner.masks.stats)
        elapsed, tokens = run(llm, prompts, params)
        figures[name] = tokens / elapsed
        steps, rows, filled = (after - before for after, before in zip(runner.masks.stats, stats))
        masks = f"; {rows} of {tokens} rows needed a mask, {filled} filled" if steps else ""
        print(f"{name:>12}: {tokens:5d} tokens in {elapsed:6.2f} s = {tokens / elapsed:8.1f} tok/s{masks}", flush=True)
    free_speed = (figures["free"] + figures["free again"]) / 2
    print(f"json schema / free: {figures['json schema'] / free_speed:.3f}x "
          f"(masking costs {100 * (1 - figures['json schema'] / free_speed):.1f}% of throughput)")
    print(f"penalties / free: {figures['penalties'] / free_speed:.3f}x "
          f"(penalties cost {100 * (1 - figures['penalties'] / free_speed):.1f}% of throughput)")
    print(f"grammar engine set-up for the tokenizer: {setup:.2f} s; schema compile: cold {cold * 1e3:.1f} ms, "
          f"cached {cached * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
