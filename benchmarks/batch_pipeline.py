"""The batch pipeline beside the raw engine, on the same prompts, in one run:

- LLM.generate (the core in this process),
- AsyncEngine with every request submitted at once (the core in a child process),
- a processor (build_processor, DeploymentProcessorConfig) over a deployment of the
  same engine: rows in batches, stages, error handling, rows out in order.

    python benchmarks/batch_pipeline.py --rows 256 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import time

from gristmill import LLM, AsyncEngine, EngineConfig, SamplingParams
from gristmill.batch import DeploymentProcessorConfig, build_processor, deploy

try:
    from throughput import make_prompts
except ImportError:  # run as a module from the repo root
    from benchmarks.throughput import make_prompts


def bench_llm(config: EngineConfig, prompts, params) -> float:
    llm = LLM(**{f: getattr(config, f) for f in ("model", "device", "dtype")})
    llm.generate(prompts[:2], params.clone(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def bench_async(config: EngineConfig, prompts, params) -> float:
    engine = AsyncEngine(config)

    async def run(batch, p):
        async def one(prompt):
            async for out in engine.generate(prompt, p):
                pass
            return len(out.token_ids)
        return await asyncio.gather(*(one(x) for x in batch))

    try:
        asyncio.run(run(prompts[:2], params.clone(max_tokens=2)))
        start = time.perf_counter()
        counts = asyncio.run(run(prompts, params))
        return sum(counts) / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def bench_pipeline(config: EngineConfig, prompts, params, batch_size: int, max_concurrent_batches: int) -> float:
    sampling = {"max_tokens": params.max_tokens, "temperature": 0, "ignore_eos": True}
    with deploy(config, name="bench") as deployment:
        processor = build_processor(DeploymentProcessorConfig(
            deployment_name=deployment.name, batch_size=batch_size, max_concurrent_batches=max_concurrent_batches,
            sampling_params=sampling))
        processor([{"prompt": p, "sampling_params": {"max_tokens": 2}} for p in prompts[:2]])
        start = time.perf_counter()
        rows = processor([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
        elapsed = time.perf_counter() - start
    assert all(not r["__inference_error__"] for r in rows)
    return sum(r["num_generated_tokens"] for r in rows) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-concurrent-batches", type=int, default=4)
    args = parser.parse_args()

    config = EngineConfig(model=args.model, device="cpu", dtype="float32")
    prompts = make_prompts(args.rows)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    print(f"{args.rows} rows, {args.output_len} tokens each, greedy; pipeline batch_size={args.batch_size}, "
          f"max_concurrent_batches={args.max_concurrent_batches}", flush=True)
    results = {"LLM.generate": bench_llm(config, prompts, params)}
    results["AsyncEngine"] = bench_async(config, prompts, params)
    results["pipeline"] = bench_pipeline(config, prompts, params, args.batch_size, args.max_concurrent_batches)
    raw = results["AsyncEngine"]
    print(f"{'':>14} {'tok/s':>8} {'/ AsyncEngine':>14}")
    for name, value in results.items():
        print(f"{name:>14} {value:>8.1f} {value / raw:>13.2f}x")


if __name__ == "__main__":
    main()
