"""The host's work per decode step, apart from the model: scheduling, step inputs, stop
checks, outputs and detokenizing, for 256 running requests. On a GPU this is what bounds
large batches (the graph replay of a step takes about a millisecond; see
docs/performance.md), and it runs the same on any machine, so it is measured here on CPU
over a model so small its compute hardly counts: Gemma 3's real tokenizer (from the
bundled model) over one tiny random layer with a 1,024-token vocabulary (the first
1,024 of the tokenizer's). The model's own time (forward, LM head, sampling) is timed
and taken out; it is kept small, so its run-to-run noise hardly moves the host figure.

Peers side by side: the synchronous loop and async scheduling (on CPU it overlaps
nothing, so the two should cost the same), greedy, and async scheduling with sampled
rows (temperature, top_p), each the best of a few runs. `--before REV` measures git
revision REV too, each side in its own process (benchmarks/revisions.py).

    python benchmarks/host_overhead.py [--batch 256] [--steps 64] [--before HEAD~1]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from gristmill import LLM, SamplingParams
from gristmill.model.loader import resolve_model
from revisions import add_revision_args, measure_or_compare

VOCAB = 1024


def tiny_model_with_real_tokenizer(directory: Path) -> Path:
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_model(None)  # the bundled Gemma 3 270M, converted once
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory)
    config = json.loads((source / "config.json").read_text())
    config.update(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=16, layer_types=["sliding_attention"])
    (directory / "config.json").write_text(json.dumps(config))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)).save_pretrained(directory)
    return directory


def measure(args) -> dict[str, float]:
    """Host ms per decode step of each loop, the best of `args.runs` runs."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model_with_real_tokenizer(Path(tmp))
        llm = LLM(str(path), device="cpu", quantization=None, max_num_seqs=args.batch,
                  max_num_batched_tokens=max(2048, 32 * args.batch))
        model_time = [0.0]
        runner = llm.core.executor
        timed_parts = [(runner.model, "forward"), (runner.model, "compute_logits"), (runner.sampler, "sample"),
                       (runner.sampler, "sample_greedy")]  # (the last: from 5dd7635 on)
        for owner, name in timed_parts:
            original = getattr(owner, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def timed(*a, _original=original, **k):
                start = time.perf_counter()
                try:
                    return _original(*a, **k)
                finally:
                    model_time[0] += time.perf_counter() - start
            setattr(owner, name, timed)
        rng = random.Random(0)
        greedy = SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=args.steps, temperature=0.8, top_p=0.95, ignore_eos=True)
        figures = {}
        for name, mode, params in (("synchronous", False, greedy), ("async scheduling", True, greedy),
                                   ("async, sampled", True, sampled)):
            llm.core.async_scheduling = mode
            best = float("inf")
            for _ in range(args.runs):
                prompts = [[rng.randrange(100, VOCAB) for _ in range(32)] for _ in range(args.batch)]
                model_time[0] = 0.0
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best = min(best, (time.perf_counter() - start - model_time[0]) / args.steps * 1e3)
            figures[name] = best
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    add_revision_args(parser)
    args = parser.parse_args()
    figures = measure_or_compare(__file__, args, measure, label="host ms", digits=2, header=(
        f"host ms per decode step, {args.batch} requests, {args.steps} steps, best of {args.runs}:"))
    if figures is None:
        return
    for name, value in figures.items():
        print(f"{name:>18}: {value:.2f}")
    print(f"  ratio async / sync: {figures['async scheduling'] / figures['synchronous']:.2f}")


if __name__ == "__main__":
    main()
