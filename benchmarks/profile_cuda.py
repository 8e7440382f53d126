"""Where a CUDA step's time goes: per-step wall time of decode at a batch size, and the
top kernels (torch profiler) of a decode-heavy and a prefill-heavy generate.

    python benchmarks/profile_cuda.py --model DIR [--batch 1] [--prefill-prompts 16]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gristmill import LLM, SamplingParams


def _time_waits_for_the_gpu() -> list[float]:
    """Time the host spends waiting for sampled tokens (a step bound by the GPU waits; one
    bound by the host does not), summed into the returned list's one item."""
    from gristmill.model.sampler import PendingSample

    waited = [0.0]
    result = PendingSample.result

    def timed(self):
        start = time.perf_counter()
        if self.event is not None:
            self.event.synchronize()
        waited[0] += time.perf_counter() - start
        return result(self)

    PendingSample.result = timed
    return waited


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill-prompts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, device="cuda", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    rng = random.Random(0)
    vocab = llm.core.capacity.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(32)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    waited = _time_waits_for_the_gpu()
    for i in range(args.runs):
        waited[0] = 0.0
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        print(f"batch {args.batch}, run {i}: {args.batch * 128 / elapsed:,.0f} tok/s, {elapsed / 128 * 1e3:.2f} ms/step, "
              f"of which the host waited for the GPU {waited[0] / 128 * 1e3:.2f} ms/step")
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    if args.prefill_prompts == 0:
        return
    long = [[rng.randrange(100, vocab) for _ in range(1000)] for _ in range(args.prefill_prompts)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(long[:2], one, use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(long, one, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(f"prefill {args.prefill_prompts} x 1000: {args.prefill_prompts * 1000 / elapsed:,.0f} tok/s")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(long, one, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
