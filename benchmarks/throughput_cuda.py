"""Throughput on a CUDA GPU, peers side by side in one run, same weights, bf16, greedy,
EOS ignored:

- gristmill `LLM.generate` (CUDA backend: Triton kernels, decode steps from CUDA graphs,
  async scheduling), and the same engine with async scheduling off (`gristmill_sync`);
- transformers `generate`;
- transformers' forward over a `StaticCache` with each decode step captured as one CUDA
  graph by hand (the strongest plain-PyTorch reference).

Also: prefill throughput (64 prompts of ~1,000 tokens), kernels per decode step, and the
workload small engines publish (256 sequences, input and output lengths uniform in
[100, 1024]).

    python benchmarks/throughput_cuda.py --model /path/to/hf_dir
    python benchmarks/throughput.py --device cuda --model /path/to/hf_dir   # the same
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from gpu_shapes import bench_gristmill, bench_hf_graph, bench_prefill, prompts_of  # (this folder)
from gristmill import LLM, SamplingParams


def bench_gristmill_sync(llm: LLM, prompts, output_len) -> float:
    """The same engine, each step's tokens on the host before the next step is scheduled."""
    llm.core.async_scheduling = False
    try:
        return bench_gristmill(llm, prompts, output_len)
    finally:
        llm.core.async_scheduling = True


def bench_hf_generate(model, prompts, output_len) -> float:
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    assert out.shape[1] - ids.shape[1] == output_len
    return len(prompts) * output_len / (time.perf_counter() - start)


def kernels_per_decode_step(llm: LLM, batch: int) -> dict:
    """CUDA kernels in one eager decode step, and launches per step with graphs."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.core.executor
    prompts = prompts_of(batch, 16, llm.core.capacity.vocab_size, seed=9)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    graphs, counts = runner.graphs, {}
    for name, use_graphs in (("eager", False), ("graphs", True)):
        runner.graphs = graphs if use_graphs else None
        llm.generate(prompts, params, use_tqdm=False)  # warm
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
        events = prof.events()
        counts[name] = {
            "cudaLaunchKernel": sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                      "cudaLaunchKernelExC", "cuLaunchKernelEx")),
            "cudaGraphLaunch": sum(1 for e in events if e.name == "cudaGraphLaunch")}
    runner.graphs = graphs
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory (bf16 weights)")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--peers", default="gristmill,gristmill_sync,hf_generate,hf_graph")
    parser.add_argument("--skip", default="", help="comma-separated: prefill, nano, kernels")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    peers, skip = args.peers.split(","), args.skip.split(",")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    print(f"GPU: {results['gpu']}  torch {results['torch']}  CUDA {results['cuda']}", flush=True)

    start = time.perf_counter()
    # Half the GPU: the transformers peers run in the same process, beside it.
    llm = LLM(args.model, device="cuda", max_num_seqs=max(256, max(sizes)), max_num_batched_tokens=16384,
              max_model_len=4096, gpu_memory_utilization=0.5)
    results["gristmill_start_s"] = time.perf_counter() - start
    print(f"gristmill start: {results['gristmill_start_s']:.1f} s (load, KV sizing, CUDA graph capture)", flush=True)
    vocab = llm.core.capacity.vocab_size
    hf = None
    if "hf_generate" in peers or "hf_graph" in peers:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()

    runs = {"gristmill": lambda p, n: bench_gristmill(llm, p, n),
            "gristmill_sync": lambda p, n: bench_gristmill_sync(llm, p, n),
            "hf_generate": lambda p, n: bench_hf_generate(hf, p, n),
            "hf_graph": lambda p, n: bench_hf_graph(hf, p, n)}
    names = [p for p in ("gristmill", "gristmill_sync", "hf_generate", "hf_graph") if p in peers]
    for name in names:  # warm up: kernels compile, cuBLAS picks algorithms
        runs[name](prompts_of(2, args.prompt_len, vocab), 4)
    header = f"{'batch':>5} " + " ".join(f"{n:>12}" for n in names)
    header += "".join(f" {'gm/' + n:>16}" for n in names[1:])
    print(f"generated tok/s, prompt {args.prompt_len} tokens, {args.output_len} output tokens; ratios ours / theirs")
    print(header, flush=True)
    results["decode"] = {}
    for batch in sizes:
        prompts = prompts_of(batch, args.prompt_len, vocab, seed=batch)
        speed = {}
        for name in names:
            try:
                speed[name] = runs[name](prompts, args.output_len)
            except torch.cuda.OutOfMemoryError as exc:
                speed[name] = float("nan")
                print(f"{name} batch {batch}: out of memory ({exc})")
        results["decode"][batch] = speed
        row = f"{batch:>5} " + " ".join(f"{speed[n]:>12.1f}" for n in names)
        row += "".join(f" {speed['gristmill'] / speed[n]:>15.2f}x" for n in names[1:] if "gristmill" in speed)
        print(row, flush=True)

    if "kernels" not in skip:
        results["kernels"] = {b: kernels_per_decode_step(llm, b) for b in (1, 64)}
        print(f"per 2-token generate (prefill + 1 decode step): {json.dumps(results['kernels'])}", flush=True)
    if "prefill" not in skip:
        prompts = prompts_of(64, 1000, vocab, seed=1)
        bench_prefill(llm, prompts[:4])
        results["prefill_tok_s"] = bench_prefill(llm, prompts)
        print(f"prefill, 64 prompts of 1,000 tokens: {results['prefill_tok_s']:,.0f} prompt tok/s", flush=True)
    if "nano" not in skip:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
        outputs = [rng.randint(100, 1024) for _ in range(256)]
        start = time.perf_counter()
        speed = bench_gristmill(llm, prompts, outputs)
        results["nano_vllm_workload"] = {"output_tok_s": speed, "seconds": time.perf_counter() - start}
        print(f"256 sequences, input/output uniform in [100, 1024]: {speed:,.0f} output tok/s "
              f"({results['nano_vllm_workload']['seconds']:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
