"""The same batch job on the local runner and on Ray Data, side by side in one run.

Each figure is a whole job as a user runs it, wall clock from the call to the last row,
engine start included (on Ray: actor start and engine start; Ray itself is started
before, and its start is printed apart):

- local: build_processor(EngineProcessorConfig) over a list of rows;
- ray: the same processor over ray.data.from_items(rows), default options (the engine
  actor reserves 1 CPU, so Ray sets its threads to 1);
- ray, N threads: the same with OMP_NUM_THREADS=<cores> in the actor's runtime_env.

    python benchmarks/ray_runner.py --rows 256 --output-len 32
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import ray

from gristmill import EngineConfig
from gristmill.batch import EngineProcessorConfig, build_processor

try:
    from throughput import make_prompts
except ImportError:  # run as a module from the repo root
    from benchmarks.throughput import make_prompts


def run(label: str, processor, rows, on_ray: bool) -> dict:
    start = time.perf_counter()
    out = processor(ray.data.from_items(rows)).take_all() if on_ray else processor(rows)
    seconds = time.perf_counter() - start
    assert len(out) == len(rows) and not any(r["__inference_error__"] for r in out)
    tokens = sum(r["num_generated_tokens"] for r in out)
    texts = {r["key"]: r["generated_text"] for r in out}
    print(f"{label:<16} {seconds:8.1f} s {len(rows) / seconds:9.2f} rows/s {tokens / seconds:9.1f} tok/s",
          flush=True)
    return {"seconds": seconds, "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    prompts = make_prompts(args.rows, "short")
    params = {"max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    rows = [{"key": i, "prompt": p, "sampling_params": params} for i, p in enumerate(prompts)]
    engine = EngineConfig(device="cpu")
    flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in open("/proc/cpuinfo").read()]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, flags: {', '.join(flags)}")
    print(f"{args.rows} rows x {args.output_len} greedy tokens, batch_size 64, Gemma 3 270M (float32)\n")

    started = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    print(f"ray.init: {time.perf_counter() - started:.1f} s (not counted below)\n")

    config = EngineProcessorConfig(engine=engine, id_column="key")
    threads = EngineProcessorConfig(engine=engine, id_column="key", ray_actor_options={
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(os.cpu_count())}}})
    # Interleaved, so a drift of the machine's speed shows as a gap between the two local runs.
    local = run("local", build_processor(config), rows, on_ray=False)
    on_ray = run("ray", build_processor(config), rows, on_ray=True)
    local2 = run("local (again)", build_processor(config), rows, on_ray=False)
    on_ray2 = run(f"ray, {os.cpu_count()} threads", build_processor(threads), rows, on_ray=True)
    base = (local["seconds"] + local2["seconds"]) / 2
    print(f"\nwall time / local (mean of both): ray {on_ray['seconds'] / base:.2f}x, "
          f"ray with {os.cpu_count()} threads {on_ray2['seconds'] / base:.2f}x")
    same = local["texts"] == on_ray["texts"] == local2["texts"] == on_ray2["texts"]
    print(f"greedy output identical in all four runs: {same}")
    ray.shutdown()


if __name__ == "__main__":
    main()
