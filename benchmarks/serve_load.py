"""Load on the HTTP server beside the raw AsyncEngine: the same requests (64 concurrent
streaming clients by default), throughput and TTFT / inter-token latency percentiles.

    python benchmarks/serve_load.py --clients 64 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gristmill import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from tests.server.conftest import Server  # noqa: E402

PROMPT = "Request {i}: write a short story about a lighthouse keeper."


class Timings:
    def __init__(self):
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0

    def request(self, start: float, arrivals: list[tuple[float, int]]):
        """arrivals: (time, tokens in that chunk) for one request."""
        self.ttft.append(arrivals[0][0] - start)
        for (prev, _), (now, count) in zip(arrivals, arrivals[1:]):
            self.itl.append((now - prev) / max(count, 1))
        self.tokens += sum(count for _, count in arrivals)


async def run_server(url: str, clients: int, output_len: int) -> tuple[Timings, float]:
    timings = Timings()

    async def one(client, i):
        body = {"prompt": PROMPT.format(i=i), "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                "stream": True}
        start, arrivals = time.perf_counter(), []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    payload = json.loads(line[6:])
                    if payload["choices"] and payload["choices"][0]["text"]:
                        arrivals.append((time.perf_counter(), 1))
        # Text chunks are one per token except where a token adds no text; count tokens exactly.
        arrivals[-1] = (arrivals[-1][0], arrivals[-1][1] + output_len - len(arrivals))
        timings.request(start, arrivals)

    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(clients)))
    return timings, time.perf_counter() - start


async def run_engine(engine: AsyncEngine, clients: int, output_len: int) -> tuple[Timings, float]:
    timings = Timings()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)

    async def one(i):
        start, arrivals, seen = time.perf_counter(), [], 0
        async for out in engine.generate(PROMPT.format(i=i), params):
            arrivals.append((time.perf_counter(), len(out.token_ids) - seen))
            seen = len(out.token_ids)
        timings.request(start, arrivals)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(clients)))
    return timings, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else float("nan")


def report(name: str, timings: Timings, elapsed: float) -> float:
    throughput = timings.tokens / elapsed
    print(f"{name:>12} {throughput:>9.1f} {pct(timings.ttft, 50):>8.0f} {pct(timings.ttft, 90):>8.0f} "
          f"{pct(timings.ttft, 99):>8.0f} {pct(timings.itl, 50):>7.0f} {pct(timings.itl, 90):>7.0f} "
          f"{pct(timings.itl, 99):>7.0f}")
    return throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    print(f"{args.clients} concurrent streaming requests, {args.output_len} tokens each, greedy")
    print(f"{'':>12} {'tok/s':>9} {'TTFT p50':>8} {'p90':>8} {'p99':>8} {'ITL p50':>7} {'p90':>7} {'p99':>7}  (ms)")
    engine = AsyncEngine(EngineConfig(device="cpu"))
    try:
        asyncio.run(run_engine(engine, 2, 4))  # warm-up
        raw = report("AsyncEngine", *asyncio.run(run_engine(engine, args.clients, args.output_len)))
    finally:
        engine.shutdown()
    server = Server()
    try:
        asyncio.run(run_server(server.url, 2, 4))
        http = report("HTTP server", *asyncio.run(run_server(server.url, args.clients, args.output_len)))
    finally:
        server.stop()
    print(f"server / engine throughput: {http / raw:.2f}x")


if __name__ == "__main__":
    main()
