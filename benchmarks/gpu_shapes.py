"""Throughput at the model shapes GPU users run, random weights built on the GPU from each
model's config (written here; nothing is fetched), peers side by side in one process:

- gristmill `LLM.generate` with `load_format="dummy"` (CUDA backend, CUDA graphs, async
  scheduling);
- transformers' forward over a `StaticCache` with every decode step replayed from one
  CUDA graph captured by hand (the strongest plain-PyTorch reference), same shape,
  random weights of its own (throughput does not depend on the values; EOS ignored).

Per shape: generated tok/s at batch 1, 64 and 256 (32 prompt tokens, 128 output tokens),
prefill tok/s (64 prompts of 1,000 tokens), what bounds the figures (the weight-bandwidth
bound of batch 1 from a measured device copy, the dense bf16 peak `torch.matmul` reaches
on the step's own shapes at batch 256, and how long the host waited for the GPU a step),
and on the Qwen3-0.6B shape the workload nano-vllm and vLLM publish figures for (256
sequences, input and output lengths uniform in [100, 1024], EOS ignored).

    python benchmarks/gpu_shapes.py --shape qwen3-0.6b --tokenizer DIR --json out.json

A tokenizer directory is needed only because `LLM` decodes what it generates (any
tokenizer with at least the shape's vocabulary will do: the GPU machine's staged Gemma
3 one). Each measurement is written to --json as soon as it is taken, so a run cut short
by its time box keeps what it measured. benchmarks/gpu_checks.sh runs every shape.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Llama 3.1 8B's public config.json, less the fields that do not change the shape; Llama
# 3.2 1B is the same family, smaller, with a tied head and a longer rope scaling.
_LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}}

# The public config.json of each model, less the fields that do not change the shape.
SHAPES = {
    "gemma3-270m": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1},
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "attention_bias": False, "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": 151645},
    "llama3.2-1b": {**_LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "head_dim": 64, "tie_word_embeddings": True,
                    "rope_scaling": {**_LLAMA3_8B["rope_scaling"], "factor": 32.0}},
    "llama3.1-8b": _LLAMA3_8B,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def model_dir(shape: str, tokenizer: Path, root: Path) -> Path:
    """A model directory of `shape`: its config.json and the tokenizer's files, no weights."""
    path = root / shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**SHAPES[shape], "torch_dtype": "bfloat16"}, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, path / name)
    return path


def parameter_count(config: dict) -> dict:
    """Parameters of a decoder of this config: per layer's matrices, and the LM head."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    matrices = {"qkv": (hidden, (heads + 2 * kv) * dim), "o": (heads * dim, hidden),
                "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
    per_layer = sum(k * n for k, n in matrices.values())
    head = hidden * config["vocab_size"]
    return {"matrices": matrices, "layers": layers, "per_layer": per_layer, "lm_head": head,
            "embedding": 0 if config["tie_word_embeddings"] else head, "total": layers * per_layer + head
            + (0 if config["tie_word_embeddings"] else head)}


def prompts_of(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def bench_gristmill(llm, prompts, output_len) -> float:
    from gristmill import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (output_len if isinstance(output_len, list) else [output_len] * len(prompts))]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    errors = [o.error for o in outs if o.finish_reason != "length"]
    if errors:
        raise RuntimeError(f"{len(errors)} requests did not finish on length: {errors[:3]}")
    return sum(len(o.token_ids) for o in outs) / elapsed


def bench_prefill(llm, prompts) -> float:
    from gristmill import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return sum(len(p) for p in prompts) / (time.perf_counter() - start)


def bench_hf_graph(model, prompts, output_len) -> float:
    """Prefill eagerly into a StaticCache, then every decode step as a replay of one CUDA
    graph of the model's forward (argmax included). The capture is not timed."""
    from transformers import StaticCache

    batch, length = len(prompts), len(prompts[0])
    cache = StaticCache(config=model.config, max_cache_len=length + output_len + 1)
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(length, device="cuda"),
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        static_ids = logits.argmax(-1, keepdim=True)
        static_pos = torch.tensor([length], device="cuda")
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - start
        stream = torch.cuda.Stream()  # capture warms up on a side stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(input_ids=static_ids, past_key_values=cache, cache_position=static_pos, use_cache=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(input_ids=static_ids, past_key_values=cache, cache_position=static_pos,
                        use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for step in range(output_len - 1):
            static_pos.fill_(length + step)
            graph.replay()
            static_ids.copy_(out)
        torch.cuda.synchronize()
        elapsed = prefill_s + time.perf_counter() - start
    del graph, cache
    return batch * output_len / elapsed


def _time_cuda(fn, repeat: int = 20) -> float:
    """Seconds per call of fn on the GPU (events around `repeat` calls after a warm-up)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src), repeat=10)
    return 2 * src.numel() * src.element_size() / seconds


def matmul_bound(counts: dict, tokens: int) -> dict:
    """The time `torch.matmul` takes for one step's matrices at `tokens` rows, bf16: the
    step's dense-matmul floor, and the FLOP/s it reaches."""
    seconds = 0.0
    for k, n in list(counts["matrices"].values()):
        a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds += counts["layers"] * _time_cuda(lambda: torch.matmul(a, b))
    hidden = counts["matrices"]["o"][1]
    a = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(hidden, counts["lm_head"] // hidden, device="cuda", dtype=torch.bfloat16)
    seconds += _time_cuda(lambda: torch.matmul(a, b))
    flops = 2 * tokens * (counts["layers"] * counts["per_layer"] + counts["lm_head"])
    return {"step_matmul_s": seconds, "matmul_tflops": flops / seconds / 1e12,
            "matmul_bound_tok_s": tokens / seconds}


def host_waits(llm, prompts, output_len) -> dict:
    """A decode-heavy generate again, timing how long the host waited for the GPU's
    tokens a step: near the step's time, the GPU bounds it; near zero, the host does."""
    from profile_cuda import _time_waits_for_the_gpu
    from gristmill.model.sampler import PendingSample

    original = PendingSample.result
    waited = _time_waits_for_the_gpu()
    try:
        start = time.perf_counter()
        bench_gristmill(llm, prompts, output_len)
        elapsed = time.perf_counter() - start
    finally:
        PendingSample.result = original
    return {"ms_per_step": elapsed / output_len * 1e3, "waited_ms_per_step": waited[0] / output_len * 1e3}


def decode_graph_ms(llm, rows: int) -> float | None:
    """GPU time of one replay of the decode graph of `rows` rows (the forward, LM head and
    argmax of a decode step, without the host)."""
    graphs = llm.core.executor.graphs
    if graphs is None or (rows, 1) not in graphs.graphs:
        return None
    graph = graphs.graphs[rows, 1][0]
    graphs.inputs.slot_mapping.fill_(-1)  # replays write no KV (the last step's slots may be cached blocks)
    return _time_cuda(graph.replay, repeat=10) * 1e3


class Results:
    """The figures of one shape, written to `path` after each measurement."""

    def __init__(self, path: str | None, **facts):
        self.path, self.data = path, dict(facts)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        print(f"{key}: {json.dumps(value)}", flush=True)
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=1))


def run_shape(shape: str, tokenizer: Path, root: Path, out: Results, batch_sizes: list[int], output_len: int,
              prompt_len: int, nano: bool) -> None:
    from gristmill import LLM

    config = SHAPES[shape]
    counts = parameter_count(config)
    out.put("parameters", counts["total"])
    path = model_dir(shape, tokenizer, root)
    start = time.perf_counter()
    llm = LLM(str(path), device="cuda", load_format="dummy", max_num_seqs=256, max_num_batched_tokens=16384,
              max_model_len=4096 if not nano else 2048 + 64, gpu_memory_utilization=0.5)
    out.put("gristmill_start_s", time.perf_counter() - start)
    capacity = llm.core.capacity
    out.put("kv_cache_tokens", capacity.num_total_blocks * capacity.block_size)

    from transformers import AutoConfig, AutoModelForCausalLM
    start = time.perf_counter()
    hf_config = AutoConfig.from_pretrained(str(path))
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    out.put("hf_build_s", time.perf_counter() - start)

    vocab = config["vocab_size"]
    bench_gristmill(llm, prompts_of(2, prompt_len, vocab), 4)  # warm: compiles, cuBLAS picks algorithms
    bench_hf_graph(hf, prompts_of(2, prompt_len, vocab), 4)
    decode = {}
    for batch in batch_sizes:
        prompts = prompts_of(batch, prompt_len, vocab, seed=batch)
        row = {"gristmill": bench_gristmill(llm, prompts, output_len)}
        try:
            row["hf_graph"] = bench_hf_graph(hf, prompts, output_len)
        except torch.cuda.OutOfMemoryError as exc:
            row["hf_graph"] = None
            row["hf_graph_error"] = str(exc)[:200]
        if row["hf_graph"]:
            row["ratio"] = row["gristmill"] / row["hf_graph"]
        decode[batch] = row
        out.put("decode", decode)
    del hf
    torch.cuda.empty_cache()

    bandwidth = copy_bandwidth()
    weight_bytes = 2 * counts["total"]
    out.put("bandwidth_bound", {"copy_GBps": bandwidth / 1e9, "weight_GB": weight_bytes / 1e9,
                                "batch1_bound_tok_s": bandwidth / weight_bytes})
    top = max(batch_sizes)
    out.put("matmul_bound", {"tokens": top, **matmul_bound(counts, top)})
    out.put("decode_graph_ms", {b: decode_graph_ms(llm, b) for b in (1, top)})
    out.put("host_waits", {b: host_waits(llm, prompts_of(b, prompt_len, vocab, seed=b), 64) for b in (1, top)})

    bench_prefill(llm, prompts_of(4, 1000, vocab, seed=2))  # warm, with prompts the prefix cache will not hold
    prompts = prompts_of(64, 1000, vocab, seed=1)
    out.put("prefill_tok_s", bench_prefill(llm, prompts))

    if nano:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
        outputs = [rng.randint(100, 1024) for _ in range(256)]
        start = time.perf_counter()
        speed = bench_gristmill(llm, prompts, outputs)
        out.put("nano_vllm_workload", {"output_tok_s": speed, "seconds": time.perf_counter() - start,
                                       "output_tokens": sum(outputs)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", required=True, type=Path,
                        help="a directory with tokenizer files covering the shape's vocabulary")
    parser.add_argument("--root", type=Path, default=Path("/tmp/gristmill-shapes"),
                        help="where the shape's model directory (config + tokenizer) is written")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--nano", action="store_true", help="also nano-vllm's workload")
    parser.add_argument("--json", default=None, help="write the figures here, as they are taken")
    args = parser.parse_args()
    out = Results(args.json, shape=args.shape, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  cuda=torch.version.cuda)
    print(f"{args.shape} on {out.data['gpu']}, torch {out.data['torch']}", flush=True)
    run_shape(args.shape, args.tokenizer, args.root, out, [int(b) for b in args.batch_sizes.split(",")],
              args.output_len, args.prompt_len, args.nano)


if __name__ == "__main__":
    main()
