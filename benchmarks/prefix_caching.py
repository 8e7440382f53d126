"""Prefix caching, side by side in one run: a batch of prompts that share one long system
prompt, through gristmill `LLM.generate` with `enable_prefix_caching` on (the default)
and off, and through llama.cpp on the same GGUF (when llama-cpp-python is installed)
both recomputing every prompt and sharing the prefix's KV cells across its sequences.

End-to-end wall time of the whole batch (tokenizing, prefill, decode), greedy, a fixed
number of output tokens (EOS ignored), all threads of this machine.

    python benchmarks/prefix_caching.py                    # 24 prompts, ~400-token prefix, 16 tokens
    python benchmarks/prefix_caching.py --prompts 64 --prefix-sentences 60
"""

from __future__ import annotations

import argparse
import time

import torch

from gristmill import LLM, SamplingParams

RULES = ["Answer in plain English, in at most three short sentences.",
         "Never invent facts: when you do not know, say that you do not know.",
         "Do not use lists, tables, headings or code unless the user asks for them.",
         "Keep a friendly and calm tone, and do not apologise more than once.",
         "When a question has several readings, answer the most likely one and name the others.",
         "Give numbers with their units, and round them to two significant figures.",
         "Refer to earlier turns of the conversation only when the user does.",
         "If the user writes in another language, answer in that language."]
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "How many legs has a spider?",
             "What does a baker do at dawn?", "Name a river in Africa.", "What is rain made of?",
             "How far away is the Moon?", "Why do cats purr?", "What is a prime number?",
             "Who wrote Hamlet?", "What melts ice?", "How do bees make honey?"]


def make_prompts(count: int, prefix_sentences: int, desk: int = 0) -> list[str]:
    """`desk` changes the first words, so each run's prefix is new to the cache."""
    rules = " ".join(f"Rule {i + 1}: {RULES[i % len(RULES)]}" for i in range(prefix_sentences))
    system = f"You are help desk {desk} of a public library. Follow these rules in every answer. {rules}\n\n"
    return [f"{system}Question {i}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:" for i in range(count)]


def bench_gristmill(llm: LLM, prompts: list[str], output_len: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outs)
    return elapsed, [list(o.token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: bundled Gemma 3 270M)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prefix-sentences", type=int, default=20, help="rules in the shared system prompt "
                        "(20: about 400 tokens with the Gemma 3 tokenizer)")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per peer; the best is shown")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()

    from throughput import cpu_flags

    from gristmill.paths import default_model_path

    prompts = make_prompts(args.prompts, args.prefix_sentences)
    llms = {caching: LLM(args.model, device="cpu", quantization=args.quantization,
                         enable_prefix_caching=caching) for caching in (True, False)}
    tokenizer = llms[True].tokenizer
    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    shared = _shared_prefix_len([tokenizer(p).input_ids for p in prompts])
    gguf = args.model or str(default_model_path())
    llama = None
    if not args.no_llama_cpp and gguf.endswith(".gguf"):
        try:
            from llama_cpp_peer import LlamaCppPeer
            llama = LlamaCppPeer(gguf, max_tokens_in_context=len(prompts) * (max(lengths) + args.output_len + 8),
                                 max_seqs=len(prompts))
        except ImportError:
            print("llama.cpp: skipped (pip install -e '.[bench]' installs llama-cpp-python)")

    for llm in llms.values():  # warm up, on other text so nothing of the prompts is cached
        llm.generate(["Warm up: a short line."] * 2, SamplingParams(max_tokens=2), use_tqdm=False)
    times: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for desk in range(args.repeats):  # a new prefix each time: every run starts cold
        run_prompts = make_prompts(args.prompts, args.prefix_sentences, desk)
        for caching, llm in llms.items():
            name = "gristmill, caching on" if caching else "gristmill, caching off"
            elapsed, tokens[name] = bench_gristmill(llm, run_prompts, args.output_len)
            times[name] = min(times.get(name, elapsed), elapsed)
        if llama is not None:
            llama_shared = _shared_prefix_len([llama.tokenize(p) for p in run_prompts])
            for share in (False, True):
                name = "llama.cpp, shared prefix" if share else "llama.cpp, recomputed"
                start = time.perf_counter()
                llama.generate(run_prompts, args.output_len, shared_prefix=llama_shared if share else 0)
                elapsed = time.perf_counter() - start
                times[name] = min(times.get(name, elapsed), elapsed)
    agree = sum(a == b for a, b in zip(tokens["gristmill, caching on"], tokens["gristmill, caching off"]))

    print(f"model: {gguf}  threads: {torch.get_num_threads()}  cpu flags: {cpu_flags()}")
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens sharing the first {shared}; "
          f"{args.output_len} output tokens each; best of {args.repeats}")
    base = times["gristmill, caching off"]
    print(f"{'peer':>26} {'seconds':>8} {'prompt tok/s':>12} {'vs caching off':>15}")
    for name, elapsed in times.items():
        print(f"{name:>26} {elapsed:>8.2f} {sum(lengths) / elapsed:>12.0f} {base / elapsed:>14.2f}x")
    print(f"greedy outputs equal with caching on and off: {agree} of {len(prompts)} prompts "
          f"(quantization={args.quantization!r}; with int8 activations a last-bit difference in "
          f"attention can move a value one level, so a near tie may flip)")
    if llama is not None:
        llama.close()


def _shared_prefix_len(token_lists: list[list[int]]) -> int:
    first = token_lists[0]
    n = min(len(t) for t in token_lists)
    for i in range(n):
        if any(t[i] != first[i] for t in token_lists):
            return i
    return n


if __name__ == "__main__":
    main()
