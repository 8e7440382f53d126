"""LoRA adapters in the batch: generated tok/s at each batch size with 0, 1, 4 and 16
distinct adapters among its rows (rank 16, every one of q/k/v/o and gate/up/down
targeted), side by side in one run, each as a ratio to the run with none.

    python benchmarks/lora.py                              # bundled Gemma 3 270M and Llama 3.2 1B shapes
    python benchmarks/lora.py --models 270m --batch-sizes 16 --adapters 0,4 --rounds 3

Models: `270m` is the bundled Gemma 3 270M as `LLM()` loads it (its GGUF file used as
stored); `1b` is benchmarks/sizes_files.py's random-weight Llama 3.2 1B at its real
shapes (Q4_K_M; made by `python benchmarks/sizes.py --sizes 1b --types q4_k_m`). One
engine per model (`enable_lora=True, max_loras=16, max_lora_rank=16`) runs every row:
row i of a batch with n adapters runs adapter i mod n (none for n = 0). The adapters are
random A and B made by `peft` (`init_lora_weights=False`) over the model's config cut to
one layer, that layer's tensors drawn again for every layer of the model (peft's names and
shapes, without building the whole float model), kept under --adapter-dir. Every adapter
is loaded into its slot in the warm-up, so the figures hold no loading. Each figure is the
best of --rounds, the adapter counts taking turns within a round (the machine's drift
falls on all of them alike). Prompts are benchmarks/throughput.py's short ones, greedy,
EOS ignored, the prefill counted in the time.

What bounds it: the base matmuls run once for all rows of a step, adapters or not; each
projection then adds every row's low-rank update from its own slot, h = x A^T and
y += h B^T, in one C++ call for all the step's adapter rows (gristmill/model/lora.py,
csrc/lora_update.cpp; `--updates torch` runs the torch update instead, a few calls per
slot and projection, as on CUDA). Its arithmetic, 2 * rank * (in + out) multiply-adds a
row and projection, is ~1% of the base's on these models; a decode step with adapter
rows runs in the C++ decode stack like one without (the stack makes each projection's
update right after its matmul). What an adapter row costs beyond the arithmetic: each
slot the step uses is read whole, in float32, once per step: 4 * rank * (in + out) bytes per projection, 0.84 MB a
layer on the 270M and 2.8 MB on the 1B, so 16 adapters read 243 MB (270M) and 720 MB
(1B) a step, more than the base's quantized layer weights (~0.06 GB and ~0.55 GB). At
batch 16 with 16 adapters each row has its own slot: the update is memory-bound there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import torch

from gristmill import LLM, LoRARequest, SamplingParams
from throughput import cpu_flags, make_prompts

BENCH_DIR = Path.home() / ".cache" / "gristmill-bench"
MODELS = {"270m": None, "1b": BENCH_DIR / "Llama-3.2-1B-random-Q4_K_M.gguf"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16


def make_adapters(model_dir: Path, count: int, root: Path) -> list[Path]:
    """`count` PEFT adapter directories of rank RANK over the model in `model_dir` (its
    config.json), made once and kept under `root`."""
    config_text = (model_dir / "config.json").read_text()
    shape_key = f"{hashlib.sha256(config_text.encode()).hexdigest()[:12]}-r{RANK}"
    paths = [root / shape_key / f"adapter-{i}" for i in range(count)]
    for seed, path in enumerate(paths):
        if not (path / "adapter_model.safetensors").exists():
            _make_adapter(model_dir, path, seed)
    return paths


def _make_adapter(model_dir: Path, path: Path, seed: int) -> None:
    import peft
    import transformers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = transformers.AutoConfig.from_pretrained(model_dir)
    num_layers = config.num_hidden_layers
    config.num_hidden_layers, config.vocab_size = 1, 256  # (the shapes of one layer; no embedding wanted)
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                      init_lora_weights=False))
    layer = get_peft_model_state_dict(lora, save_embedding_layers=False)  # names as save_pretrained writes them
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in layer.items():
        bound = tensor.abs().max().item()  # (peft's uniform init range, drawn again per layer)
        for i in range(num_layers):
            tensors[name.replace("layers.0.", f"layers.{i}.")] = \
                (torch.rand(tensor.shape, generator=generator) * 2 - 1) * bound
    partial = path.with_name(path.name + ".partial")
    lora.peft_config["default"].save_pretrained(str(partial))
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    partial.rename(path)


def tok_s(llm: LLM, prompts: list[str], loras: list, output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(o.outputs[0].error is None and len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def bench_model(name: str, args) -> None:
    path = MODELS[name]
    if path is not None and not path.exists():
        print(f"\n== {name}: {path} is missing; make it with: python benchmarks/sizes.py --sizes 1b "
              f"--types q4_k_m", flush=True)
        return
    counts = [int(c) for c in args.adapters.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(str(path) if path else None, device="cpu", enable_lora=True, max_loras=max(counts + [1]),
              max_lora_rank=RANK, max_num_seqs=max(batches), max_model_len=128 + args.output_len)
    adapters = [LoRARequest(f"a{i}", i + 1, str(p))
                for i, p in enumerate(make_adapters(llm.model_dir, max(counts + [1]), args.adapter_dir))]
    warm = make_prompts(len(adapters))
    for update in args.updates.split(","):
        use_update(llm, update)
        tok_s(llm, warm, adapters, 4)  # (warm-up: every adapter into its slot)
    updates = args.updates.split(",")
    print(f"\n== {name}: {path or llm.model_dir}; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'batch':>5} {'update':>6} " + " ".join(f"{f'{n} adapters':>12}" for n in counts)
          + "".join(f" {f'{n}/0':>7}" for n in counts if n), flush=True)
    for batch in batches:
        prompts = make_prompts(batch)
        best = {}  # (update, adapters) -> tok/s; with none, no update runs: one figure for all
        for _ in range(args.rounds):
            for n in counts:
                for update in updates[:1] if n == 0 else updates:
                    use_update(llm, update)
                    loras = [adapters[i % n] if n else None for i in range(batch)]
                    speed = tok_s(llm, prompts, loras, args.output_len)
                    key = ("", 0) if n == 0 else (update, n)
                    best[key] = max(best.get(key, 0.0), speed)
        for update in updates:
            speed = {n: best[("", 0) if n == 0 else (update, n)] for n in counts}
            print(f"{batch:>5} {update:>6} " + " ".join(f"{speed[n]:>12.1f}" for n in counts)
                  + "".join(f" {speed[n] / speed[0]:>6.2f}x" for n in counts if n and 0 in speed), flush=True)


def use_update(llm: LLM, update: str) -> None:
    """Every projection's adapter update done by `update`: `kernel` (the C++ kernel, one
    call a projection) or `torch` (a few torch calls per slot the step uses, as on CUDA)."""
    from gristmill.model import lora

    sites = llm.core.executor.lora.sites
    if update == "torch":
        chosen = lora.torch_update
    else:
        ops = lora._cpu_kernels()
        if ops is None:
            raise SystemExit("--updates kernel: the C++ kernels are not built here (GRISTMILL_KERNELS=0?)")
        chosen = lora.kernel_update(ops)
    for site in sites:
        site.update = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="270m,1b", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--adapters", default="0,1,4,16", help="distinct adapters in the batch (0: none)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--updates", default="kernel",
                        help="how the adapter rows' update runs, comma-separated: kernel (the C++ kernel, "
                             "gristmill's default on CPU), torch (torch calls per slot, as on CUDA)")
    parser.add_argument("--rounds", type=int, default=2, help="each figure is the best of this many")
    parser.add_argument("--adapter-dir", type=Path, default=BENCH_DIR / "lora-adapters")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    print(f"{cpu}; cpu flags: {cpu_flags()}; {torch.get_num_threads()} threads; rank {RANK} on "
          f"{'/'.join(t.split('_')[0] for t in TARGETS)}; {args.output_len} generated tokens a prompt; "
          f"tok/s of generated tokens, the best of {args.rounds}")
    for name in args.models.split(","):
        bench_model(name, args)


if __name__ == "__main__":
    main()
