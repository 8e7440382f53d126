"""Offline throughput: gristmill `LLM.generate` vs transformers `generate`, side by side.

Same weights (the model directory gristmill loads, e.g. the converted default GGUF),
same prompts, greedy, a fixed number of output tokens (EOS ignored), float32 on CPU.
Prints generated tokens per second for each peer and the ratio ours / transformers.

    python benchmarks/throughput.py                      # default model, batch 1, 16, 64
    python benchmarks/throughput.py --batch-sizes 64 --output-len 64
"""

from __future__ import annotations

import argparse
import time

import torch

from gristmill import LLM, SamplingParams

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: bundled Gemma 3 270M)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--workloads", default="short,mixed", help="short, mixed or both (comma-separated)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(args.model, dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs)
    model_dir = str(llm.model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)

    # Warm up both once so first-call costs stay out of the figures.
    bench_gristmill(llm, make_prompts(2), 4)
    bench_transformers(hf_model, hf_tokenizer, make_prompts(2), 4)

    print(f"model: {model_dir}  output_len: {args.output_len}  threads: {torch.get_num_threads()}")
    print(f"{'workload':>8} {'batch':>5} {'prompt toks':>11} {'gristmill tok/s':>16} "
          f"{'transformers tok/s':>19} {'ratio':>7}")
    for workload in args.workloads.split(","):
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = make_prompts(batch_size, workload)
            lengths = [len(hf_tokenizer(p).input_ids) for p in prompts]
            ours = bench_gristmill(llm, prompts, args.output_len)
            theirs = bench_transformers(hf_model, hf_tokenizer, prompts, args.output_len)
            print(f"{workload:>8} {batch_size:>5} {min(lengths):>5}-{max(lengths):<5} {ours:>16.1f} "
                  f"{theirs:>19.1f} {ours / theirs:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
