"""What the engine-core process costs: AsyncEngine (core in a child process, streaming
every token back) vs LLM (core in this process), side by side on the same prompts.

    python benchmarks/process_split.py                  # batch 64, 64 tokens each
"""

from __future__ import annotations

import argparse
import asyncio
import time

from gristmill import LLM, AsyncEngine, EngineConfig, SamplingParams

try:
    from throughput import make_prompts
except ImportError:  # run as a module from the repo root
    from benchmarks.throughput import make_prompts


def bench_llm(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


async def bench_async(engine: AsyncEngine, prompts: list[str], params: SamplingParams) -> float:
    async def one(prompt):
        async for out in engine.generate(prompt, params):
            pass
        return len(out.token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    prompts = make_prompts(args.batch_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    options = dict(model=args.model, device="cpu", dtype="float32")
    llm = LLM(**options)
    engine = AsyncEngine(EngineConfig(**options))
    try:
        bench_llm(llm, prompts[:2], params.clone(max_tokens=4))  # warm-up
        asyncio.run(bench_async(engine, prompts[:2], params.clone(max_tokens=4)))
        print(f"batch {args.batch_size}, {args.output_len} tokens each, greedy")
        print(f"{'round':>5} {'LLM (in-process) tok/s':>23} {'AsyncEngine tok/s':>18} {'ratio':>7}")
        for round_ in range(1, args.rounds + 1):
            ours_inproc = bench_llm(llm, prompts, params)
            ours_split = asyncio.run(bench_async(engine, prompts, params))
            print(f"{round_:>5} {ours_inproc:>23.1f} {ours_split:>18.1f} {ours_split / ours_inproc:>6.2f}x",
                  flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
