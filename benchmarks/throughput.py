"""Offline throughput, peers side by side in one run: gristmill `LLM.generate` (default:
int8 weights on CPU; `quantization="q4"`: 4-bit weights, int8 LM head; and
`quantization=None`: float32) vs transformers `generate`
(float32, same weights) vs llama.cpp on the same GGUF (when llama-cpp-python is
installed: `pip install -e '.[bench]'`).

Same prompts, greedy, a fixed number of output tokens (EOS ignored), all threads of
this machine. Prints generated tokens per second per peer and the ratios.

    python benchmarks/throughput.py                      # default model, batch 1, 16, 64
    python benchmarks/throughput.py --batch-sizes 64 --workloads short
    python benchmarks/throughput.py --device cuda --model DIR   # on a GPU: benchmarks/throughput_cuda.py
    python benchmarks/throughput.py --before HEAD~3 --workloads short   # gristmill int8, then vs now
    python benchmarks/throughput.py --before HEAD~3 --workloads short --rounds 8 --runs 1  # taking turns

`--before REV` measures gristmill (int8) as it was at git revision REV and as it is, each
side in its own process (benchmarks/revisions.py), and prints both with their ratios.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from gristmill import LLM, SamplingParams
from revisions import add_revision_args, measure_or_compare

TOPICS = ["the sea", "a city at night", "an old clock", "mountains", "a lost key", "rain",
          "a library", "the first snow", "a train journey", "a garden"]


def make_prompts(count: int, workload: str = "short") -> list[str]:
    """short: one-line prompts of 10-25 tokens. mixed: documents of ~30 to ~500 tokens,
    as in a batch job over real records (lengths vary, so static batches pad)."""
    prompts = []
    for i in range(count):
        ask = (f"Write {'a very short' if i % 3 else 'a long and detailed'} story about "
               f"{TOPICS[i % len(TOPICS)]}{', with ' + 'many ' * (i % 5) + 'twists' if i % 2 else ''}.")
        if workload == "mixed":
            notes = " ".join(f"Note {j}: the {TOPICS[(i + j) % len(TOPICS)]} mattered." for j in range((i * 7) % 50))
            ask = f"{notes}\n{ask}"
        prompts.append(ask)
    return prompts


def bench_gristmill(llm: LLM, prompts: list[str], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def bench_transformers(model, tokenizer, prompts: list[str], output_len: int) -> float:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    start = time.perf_counter()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        # eos_token_id=None: a fixed output length without a min-length logits processor,
        # the fastest way transformers offers to do this.
        out = model.generate(**batch, max_new_tokens=output_len, do_sample=False,
                             eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - batch["input_ids"].shape[1] == output_len
    return len(prompts) * output_len / elapsed


def cpu_flags() -> str:
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in wanted if f in flags)


@functools.cache
def _int8_engine(model: str | None, max_num_seqs: int) -> LLM:
    """gristmill's default engine, loaded and warmed up once per process (a side of
    `--rounds` measures many times)."""
    llm = LLM(model, device="cpu", max_num_seqs=max_num_seqs)
    bench_gristmill(llm, make_prompts(2), 4)  # warm up
    return llm


def measure_int8(args) -> dict:
    """gristmill's default engine (int8 on CPU): {"<workload> batch <n>": generated tok/s},
    each the best of `args.runs` runs."""
    llm = _int8_engine(args.model, args.max_num_seqs)
    figures = {}
    for workload in args.workloads.split(","):
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = make_prompts(batch_size, workload)
            figures[f"{workload} batch {batch_size}"] = max(
                bench_gristmill(llm, prompts, args.output_len) for _ in range(args.runs))
    return figures


def main() -> None:
    import sys
    if "--device" in sys.argv:  # --device cuda: the GPU benchmark (benchmarks/throughput_cuda.py)
        i = sys.argv.index("--device")
        if sys.argv[i + 1].startswith("cuda"):
            import throughput_cuda
            sys.argv[i:i + 2] = []
            return throughput_cuda.main()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: bundled Gemma 3 270M)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--workloads", default="short,mixed", help="short, mixed or both (comma-separated)")
    parser.add_argument("--peers", default="int8,q4,float,transformers,llama.cpp",
                        help="which to run: int8 (gristmill default), q4 (gristmill quantization='q4'), "
                             "float (gristmill quantization=None), transformers, llama.cpp")
    parser.add_argument("--runs", type=int, default=2, help="with --before: the best of this many runs per figure")
    add_revision_args(parser)
    args = parser.parse_args()
    if args.before or args.json:
        measure_or_compare(__file__, args, measure_int8, f"gristmill int8 tok/s, cpu flags: {cpu_flags()}",
                           label="tok/s")
        return
    peers = args.peers.split(",")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gristmill.paths import default_model_path
    from gristmill.model.cpu.quant import resolve_quantization

    llms = {}
    if "int8" in peers:
        llms["int8"] = LLM(args.model, device="cpu", max_num_seqs=args.max_num_seqs)
    if "q4" in peers:
        llms["q4"] = LLM(args.model, device="cpu", quantization="q4", max_num_seqs=args.max_num_seqs)
    if "float" in peers:
        llms["float"] = LLM(args.model, device="cpu", quantization=None, max_num_seqs=args.max_num_seqs)
    model_dir = str(next(iter(llms.values())).model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = None
    if "transformers" in peers:
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llama = None
    gguf = args.model or str(default_model_path())
    if "llama.cpp" in peers:
        try:
            from llama_cpp_peer import LlamaCppPeer
            llama = LlamaCppPeer(gguf, max_tokens_in_context=32768, max_seqs=args.max_num_seqs) \
                if gguf.endswith(".gguf") else None
        except ImportError:
            print("llama.cpp: skipped (pip install -e '.[bench]' installs llama-cpp-python)")

    def run(name, prompts, output_len):
        if name in llms:
            return bench_gristmill(llms[name], prompts, output_len)
        if name == "transformers":
            return bench_transformers(hf_model, hf_tokenizer, prompts, output_len)
        return llama.generate(prompts, output_len)[0]

    names = [n for n in ("int8", "q4", "float") if n in llms] + (["transformers"] if hf_model is not None else []) \
        + (["llama.cpp"] if llama is not None else [])
    for name in names:  # warm up once so first-call costs stay out of the figures
        run(name, make_prompts(2), 4)

    print(f"model: {gguf if llama else model_dir}  output_len: {args.output_len}  threads: {torch.get_num_threads()}")
    print(f"cpu flags: {cpu_flags()}  gristmill default quantization: "
          f"{resolve_quantization('auto', torch.device('cpu'))}")
    labels = {"int8": "gristmill", "q4": "gm q4", "float": "gm float32", "transformers": "transformers", "llama.cpp": "llama.cpp"}
    header = f"{'workload':>8} {'batch':>5} {'prompt toks':>11} " + " ".join(f"{labels[n]:>12}" for n in names)
    ratios = [(a, b) for a in ("int8", "q4", "float") for b in ("transformers", "llama.cpp") if a in names and b in names]
    header += "".join(f" {labels[a].split()[-1] + '/' + labels[b][:5]:>16}" for a, b in ratios)
    print("tok/s of generated tokens; ratios are ours / theirs")
    print(header)
    for workload in args.workloads.split(","):
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = make_prompts(batch_size, workload)
            lengths = [len(hf_tokenizer(p).input_ids) for p in prompts]
            speed = {name: run(name, prompts, args.output_len) for name in names}
            row = f"{workload:>8} {batch_size:>5} {min(lengths):>5}-{max(lengths):<5} "
            row += " ".join(f"{speed[n]:>12.1f}" for n in names)
            row += "".join(f" {speed[a] / speed[b]:>15.2f}x" for a, b in ratios)
            print(row, flush=True)
    if llama is not None:
        llama.close()


if __name__ == "__main__":
    main()
