"""The batch pipeline beside the raw engine, on the same prompts, in one run:

- LLM.generate (the core in this process),
- AsyncEngine with every request submitted at once (the core in a child process),
- a processor (build_processor, DeploymentProcessorConfig) over a deployment of the
  same engine: rows in batches, stages, error handling, rows out in order,
- `gristmill serve` over loopback, every row one non-streamed /v1/completions request.

    python benchmarks/batch_pipeline.py --rows 256 --output-len 32
    python benchmarks/batch_pipeline.py --rows 64 --output-len 512 --only pipeline,http --before HEAD~3

`--before REV` measures the package as it was at git revision REV too, side by side:
each side runs in its own process (this file, with REV's `gristmill` first on the path).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

from gristmill import LLM, AsyncEngine, EngineConfig, SamplingParams
from gristmill.batch import DeploymentProcessorConfig, build_processor, deploy
from revisions import add_revision_args, measure_or_compare

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


def bench_http(config: EngineConfig, prompts, params, concurrency: int) -> float:
    """Every prompt one non-streamed /v1/completions request to `gristmill serve` on
    loopback, `concurrency` at a time; generated tokens per second as `usage` counts them."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "gristmill.cli", "serve", "--port", str(port), "--device", config.device,
               "--dtype", config.dtype, "--max-num-seqs", str(config.max_num_seqs)]
    if config.model:
        command += ["--model", config.model]
    if config.max_model_len:
        command += ["--max-model-len", str(config.max_model_len)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gristmill serve did not start")
            time.sleep(0.5)

        async def run(batch, max_tokens):
            limit = asyncio.Semaphore(concurrency)
            async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
                async def one(prompt):
                    async with limit:
                        response = await client.post("/v1/completions", json={
                            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
                        response.raise_for_status()
                        return response.json()["usage"]["completion_tokens"]
                return await asyncio.gather(*(one(p) for p in batch))

        asyncio.run(run(prompts[:2], 2))
        start = time.perf_counter()
        counts = asyncio.run(run(prompts, params.max_tokens))
        return sum(counts) / (time.perf_counter() - start)
    finally:
        server.terminate()
        server.wait(60)


BENCHES = ("LLM.generate", "AsyncEngine", "pipeline", "http")


def measure(args) -> dict[str, float]:
    config = EngineConfig(model=args.model, device="cpu", dtype="float32", max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs)
    prompts = make_prompts(args.rows)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    runs = {"LLM.generate": lambda: bench_llm(config, prompts, params),
            "AsyncEngine": lambda: bench_async(config, prompts, params),
            "pipeline": lambda: bench_pipeline(config, prompts, params, args.batch_size,
                                               args.max_concurrent_batches),
            "http": lambda: bench_http(config, prompts, params, args.max_num_seqs)}
    return {name: runs[name]() for name in args.only.split(",")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-concurrent-batches", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated, of: {', '.join(BENCHES)}")
    add_revision_args(parser)
    args = parser.parse_args()
    results = measure_or_compare(__file__, args, measure, label="tok/s", header=(
        f"{args.rows} rows, {args.output_len} tokens each, greedy; pipeline batch_size={args.batch_size}, "
        f"max_concurrent_batches={args.max_concurrent_batches}; max_num_seqs={args.max_num_seqs}"))
    if results is None:
        return
    raw = results.get("AsyncEngine") or next(iter(results.values()))
    print(f"{'':>14} {'tok/s':>8} {'/ first':>14}" if "AsyncEngine" not in results else
          f"{'':>14} {'tok/s':>8} {'/ AsyncEngine':>14}")
    for name, value in results.items():
        print(f"{name:>14} {value:>8.1f} {value / raw:>13.2f}x")


if __name__ == "__main__":
    main()
