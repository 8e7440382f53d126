"""gristmill and llama.cpp side by side, on the same GGUF files, at the model sizes people run
on CPU: random weights at the real shapes of Llama 3.2 1B, Qwen3-4B and Llama 3.1 8B (Q8_0,
Q4_0, Q4_K_M; benchmarks/sizes_files.py says how they are made) and the bundled Gemma 3 270M.

For each file, each side in processes of its own (every one bounded by --timeout and a
cap on its resident memory, --max-rss-gb; a side that fails prints the first line of why
in its cells, and the run goes on):

- first start: gristmill from process launch to `LLM(...)` ready on an empty `cache_dir`
  (imports, conversion, quantization; the kernels' compile excluded: they are compiled
  before any measurement, `python -m gristmill.model.cpu.kernels`, and are kept outside
  `cache_dir`); llama.cpp's own load time (its model load to the end of its first decode).
  Both read the file from the OS's page cache, as it was just written or read.
- warm start: the same, a second time (gristmill's cache now filled).
- peak resident memory (the kernel's count for the process, file pages it mapped
  included), while starting for the first time and while generating; and the bytes
  gristmill's cache gained for the file.
- generated tok/s at each of --batches: gristmill `LLM.generate` on short prompts (greedy,
  EOS ignored, --tokens each, after a warm-up; prefill included in the time); llama.cpp's
  `llama-bench -p 0 -n TOKENS` at batch 1 and `llama-batched-bench` (16-token prompts,
  the same count of generated tokens over its whole time) above it.
- the bandwidth bound: the bytes of weights a batch-1 step reads (the file's tensor bytes,
  less the embedding table where it is not also the LM head) against this machine's
  memory rates (benchmarks/sizes_memory.py: one slice per thread, the best over three
  fresh 2 GiB buffers), measured before and after each file's block, the higher taken:
  its read rate (a loop that writes nothing, as a batch-1 step reads its weights) and
  its copy rate (bytes read + written a second, as STREAM's Copy counts them). Each
  side's batch-1 tok/s is printed as a fraction of both bounds: the read rate's is the
  tok/s a perfect batch-1 kernel could reach; the copy rate's counts a copy's writes as
  well as its reads, which a reader of weights does not have.
- prompt tok/s (--prompt tokens, 512 as llama-bench's pp512; 0: not measured): gristmill
  `LLM.generate` of one prompt of that many token ids and 1 output token, the prefix
  cache reset before each, the best of 3; llama.cpp's `llama-bench -p PROMPT -n 0` (its
  mean of 3).
- batch 1 in turns (--turns pairs): each side's batch-1 tok/s again, a fresh process of
  one side then of the other, each side's median (a row of the block) and each pair's
  ratio with their median. Where the memory's rate moves from one minute to the next (a
  VM), these ratios are the ones to compare: the block's own batch-1 runs are minutes
  apart.

gristmill runs with its defaults (quantization="auto": on CPU, a GGUF's matrices multiplied
as the file stores them). Both sides use os.cpu_count() threads.

    python benchmarks/sizes.py                           # every size and type (hours on 2 cores)
    python benchmarks/sizes.py --sizes 270m,1b --types q4_k_m
    python benchmarks/sizes.py --llama-cpp ~/llama.cpp/build/bin --skip-gristmill
    python benchmarks/sizes.py --avx2 --sizes 270m,1b   # both sides as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sizes_llama_cpp as llama_cpp
from sizes_files import BUNDLED, SHAPES, TYPES, model_file, weight_bytes_per_token
from sizes_memory import MemoryRates
from sizes_process import run_measured

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni")
SIZES = (BUNDLED, *SHAPES)
_MARK = "sizes.py figure "  # (the prefix of the gristmill side's lines of figures)
_GB = 1e9
_WIDTH = 30  # (a side's column)
_TURNS = "tok/s batch 1, in turns"
_PROMPT = "prompt tok/s"


def main() -> None:
    if sys.argv[1:2] == ["_gristmill_side"]:  # (the child process of gristmill_side)
        return _gristmill_child(*sys.argv[2:])
    args = _parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    threads = os.cpu_count()
    if args.avx2:  # (the gristmill processes inherit it)
        os.environ["GRISTMILL_MAX_ISA"] = "avx2"
    bin_dir = Path(args.llama_cpp) if args.llama_cpp else \
        llama_cpp.built(args.dir, args.avx2) if args.skip_llama_cpp else llama_cpp.build(args.dir, args.avx2)
    vocab_dir = llama_cpp.source_dir(args.dir) / "models"
    kernel_path = "-"
    if not args.skip_gristmill:
        subprocess.run([sys.executable, "-m", "gristmill.model.cpu.kernels"], check=True, timeout=1800)
        kernel_path = subprocess.run(  # (GRISTMILL_MAX_ISA, where set, caps it)
            [sys.executable, "-c", "from gristmill.model.cpu import kernels as k; "
             "print(k.ISA_NAMES[k.int8_extension().best_isa()])"],
            check=True, timeout=300, capture_output=True, text=True).stdout.strip()
    memory = MemoryRates(threads)  # (measured around each file's block: the VM's rate moves)
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}; flags: {' '.join(f for f in CPU_FLAGS if f in flags) or 'none of ' + ', '.join(CPU_FLAGS)}; "
          f"{threads} threads; memory read by {memory.reader}, copy read + written; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"gristmill's kernels on their {kernel_path} path; llama.cpp's tools from {bin_dir}")
    print(f"{args.tokens} generated tokens a prompt, greedy; gristmill with its defaults (quantization='auto'); "
          f"ratios are gristmill / llama.cpp", flush=True)
    for size in args.sizes:
        for file_type in args.types:
            try:
                path = model_file(size, file_type, args.dir, vocab_dir, bin_dir / "llama-quantize" if bin_dir else None)
            except Exception as error:  # noqa: BLE001 - one file that cannot be made ends no run
                print(f"\n== {size} {file_type}: the file could not be made: {_first_line(error)}", flush=True)
                continue
            total, per_token = weight_bytes_per_token(path)
            rates = memory.measure()
            print(f"\n== {size} {file_type}: {path.name}, {total / _GB:.2f} GB of tensors, {per_token / _GB:.2f} GB "
                  f"read a token at batch 1; memory: read {rates[1] / _GB:.1f} GB/s, copy {rates[0] / _GB:.1f} GB/s; "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
            sides = {"gristmill": {} if args.skip_gristmill else gristmill_side(path, args),
                     "llama.cpp": {} if args.skip_llama_cpp else llama_cpp_side(path, args, bin_dir, threads)}
            if args.turns and 1 in args.batches and not (args.skip_gristmill or args.skip_llama_cpp):
                turns = taking_turns(path, args, bin_dir, threads)
                ratios = [g / l for g, l in zip(turns["gristmill"], turns["llama.cpp"]) if g and l]
                print(f"batch 1 taking turns ({args.turns} pairs of processes, one side then the other): "
                      + "; ".join(f"{name} {', '.join(f'{s:.1f}' if s else 'failed' for s in speeds)}"
                                  for name, speeds in turns.items())
                      + (f"; each pair's ratio {', '.join(f'{r:.2f}x' for r in ratios)}, median "
                         f"{statistics.median(ratios):.2f}x" if ratios else ""), flush=True)
                for name, speeds in turns.items():
                    done = [s for s in speeds if s]
                    sides[name][_TURNS] = statistics.median(done) if done else "failed: see the line above"
            rates = [max(pair) for pair in zip(rates, memory.measure())]  # (the VM's rate moves)
            bounds = {"read": rates[1] / per_token, "copy": rates[0] / per_token}
            print(f"bound at batch 1: {bounds['read']:.1f} tok/s at the read rate ({rates[1] / _GB:.1f} GB/s, "
                  f"the higher of before and after), {bounds['copy']:.1f} at the copy rate ({rates[0] / _GB:.1f})",
                  flush=True)
            for figures in sides.values():
                if 1 in args.batches and figures:
                    speed = figures[_speed(1)]
                    for rate, bound in bounds.items():
                        figures[_bound_row(rate)] = 100 * speed / bound if isinstance(speed, float) else speed
            print_block(sides, args.batches)


def gristmill_side(path: Path, args) -> dict:
    """gristmill's figures for `path` (a failure's first line where a figure is missing):
    a first start on an empty cache_dir, then a warm start that also generates."""
    figures = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gristmill-cache-") as cache_dir:
        first = _gristmill_run(path, cache_dir, [], args)
        figures["first start, s"] = first.get("start", first.get("failure"))
        figures["peak RSS starting, GB"] = first["peak_rss"] / _GB
        figures["cache added, GB"] = cache_bytes(Path(cache_dir)) / _GB
        # (a first start that failed would fail the same way again)
        warm = first if "failure" in first else _gristmill_run(path, cache_dir, args.batches, args, args.prompt)
        figures["warm start, s"] = warm.get("start", warm.get("failure"))
        figures["peak RSS generating, GB"] = warm["peak_rss"] / _GB
        for batch in args.batches:
            figures[_speed(batch)] = warm.get(str(batch), warm.get("failure"))
        if args.prompt:
            figures[_PROMPT] = warm.get("prompt", warm.get("failure"))
    return figures


def taking_turns(path: Path, args, bin_dir: Path, threads: int) -> dict[str, list[float | None]]:
    """Batch-1 tok/s again, each side in a fresh process in turn, `args.turns` times (None
    where a run failed): where the memory's rate moves from one minute to the next (a VM:
    2x), one run of each, minutes apart, can differ by that alone; runs taken in turns
    compare the sides, a pair at a time."""
    speeds = {"gristmill": [], "llama.cpp": []}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gristmill-cache-") as cache_dir:
        for _ in range(args.turns):
            speed = _gristmill_run(path, cache_dir, [1], args).get("1")
            speeds["gristmill"].append(speed if isinstance(speed, float) else None)
            speed, _ = llama_cpp.batch1_tok_s(bin_dir, path, threads, args.tokens, args.timeout,
                                              int(args.max_rss_gb * 2**30))
            speeds["llama.cpp"].append(speed)
    return speeds


def cache_bytes(cache_dir: Path) -> int:
    """The bytes of the files under `cache_dir`; a link (the cache's link to the GGUF file) counts none."""
    return sum(f.lstat().st_size for f in cache_dir.rglob("*") if f.is_file() and not f.is_symlink())


def _gristmill_run(path: Path, cache_dir: str, batches: list[int], args, prompt: int = 0) -> dict:
    """One gristmill process: its figures (tok/s at `batches`; `prompt` > 0: prompt tok/s
    for that many tokens), `peak_rss`, and `failure` where it failed."""
    run = run_measured([sys.executable, __file__, "_gristmill_side", str(path), cache_dir,
                        ",".join(map(str, batches)), str(args.tokens), str(prompt),
                        str(time.time())],
                       args.timeout, int(args.max_rss_gb * 2**30))
    figures = {"peak_rss": run.peak_rss_bytes}
    for line in run.output.splitlines():
        if line.startswith(_MARK):
            figures.update(json.loads(line[len(_MARK):]))
    if run.failure is not None:
        figures.setdefault("failure", run.failure)
    return figures


def _gristmill_child(model: str, cache_dir: str, batches: str, tokens: str, prompt: str, launched_at: str) -> None:
    """In a child process: gristmill started on `model`, its seconds from launch to ready,
    then its tok/s at each batch size and (`prompt` > 0) its prompt tok/s, each a line as
    soon as it is measured; an exception is a `failure` line and exit status 1."""
    try:
        from gristmill import LLM
        from throughput import bench_gristmill, make_prompts

        batch_sizes, prompt_tokens = [int(b) for b in batches.split(",") if b], int(prompt)
        llm = LLM(model=model, cache_dir=cache_dir, max_model_len=max(128 + int(tokens), prompt_tokens + 1),
                  max_num_seqs=max([128, *batch_sizes]))
        print(_MARK + json.dumps({"start": time.time() - float(launched_at)}), flush=True)
        if batch_sizes:
            bench_gristmill(llm, make_prompts(2), 4)  # (warm-up)
        for batch in batch_sizes:
            speed = bench_gristmill(llm, make_prompts(batch), int(tokens))
            print(_MARK + json.dumps({str(batch): speed}), flush=True)
        if prompt_tokens:
            print(_MARK + json.dumps({"prompt": _prompt_tok_s(llm, prompt_tokens)}), flush=True)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which prints it in the cells
        print(_MARK + json.dumps({"failure": _first_line(error)}), flush=True)
        sys.exit(1)


def _prompt_tok_s(llm, tokens: int) -> float:
    """The best of 3: one prompt of `tokens` token ids (new each time, the prefix cache
    reset) through the model, and 1 token out."""
    from gristmill import SamplingParams

    params, best = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), 0.0
    for round_ in range(3):
        llm.reset_prefix_cache()
        ids = [1000 + (7 * i + round_) % 20000 for i in range(tokens)]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def llama_cpp_side(path: Path, args, bin_dir: Path, threads: int) -> dict:
    """llama.cpp's figures for `path` (a failure's first line where a figure is missing)."""
    limits = (args.timeout, int(args.max_rss_gb * 2**30))
    first_s, first = llama_cpp.start_seconds(bin_dir, path, threads, *limits)
    warm_s, warm = llama_cpp.start_seconds(bin_dir, path, threads, *limits)
    figures = {"first start, s": first.failure or first_s, "warm start, s": warm.failure or warm_s,
               "peak RSS starting, GB": first.peak_rss_bytes / _GB}
    runs = []
    if 1 in args.batches:
        speed, run = llama_cpp.batch1_tok_s(bin_dir, path, threads, args.tokens, *limits)
        figures[_speed(1)] = run.failure or speed
        runs.append(run)
    if [b for b in args.batches if b > 1]:
        speeds, run = llama_cpp.batched_tok_s(bin_dir, path, threads, args.tokens,
                                              [b for b in args.batches if b > 1], *limits)
        figures.update({_speed(b): speeds.get(b, run.failure) for b in args.batches if b > 1})
        runs.append(run)
    if args.prompt:
        speed, run = llama_cpp.prompt_tok_s(bin_dir, path, threads, args.prompt, *limits)
        figures[_PROMPT] = run.failure or speed
    figures["peak RSS generating, GB"] = max((run.peak_rss_bytes for run in runs), default=0) / _GB
    return figures


def print_block(sides: dict[str, dict], batches: list[int]) -> None:
    """One row per figure: each side's value (or its failure's first line, cut to fit; in
    full under the block) and gristmill / llama.cpp."""
    rows = ["first start, s", "warm start, s", "peak RSS starting, GB", "peak RSS generating, GB",
            "cache added, GB", *(_speed(b) for b in batches), _TURNS, _PROMPT, _bound_row("read"), _bound_row("copy")]
    print(f"{'':<24}" + "".join(f"{name:>{_WIDTH}}" for name in sides) + f"{'ratio':>10}")
    failures = {}
    for row in rows:
        values = [sides[name].get(row) for name in sides]
        if all(value is None for value in values):
            continue
        failures.update({name: value for name, value in zip(sides, values) if isinstance(value, str)})
        ratio = values[0] / values[1] if all(isinstance(v, float) and v for v in values) else None
        print(f"{row:<24}" + "".join(_cell(value) for value in values)
              + (f"{ratio:>9.2f}x" if ratio is not None else f"{'-':>10}"), flush=True)
    for name, failure in failures.items():
        print(f"  {name} failed: {failure}")


def _cell(value: float | str | None) -> str:
    if isinstance(value, float):
        return f"{value:>{_WIDTH}.{1 if value >= 10 else 2}f}"
    if isinstance(value, str) and len(value) > _WIDTH - 2:
        value = value[:_WIDTH - 5] + "..."
    return f"{'-' if value is None else value:>{_WIDTH}}"


def _speed(batch: int) -> str:
    return f"tok/s batch {batch}"


def _bound_row(rate: str) -> str:
    return f"batch 1 / {rate} bound, %"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    parser.add_argument("--batches", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens a prompt")
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "gristmill-bench",
                        help="where the files, llama.cpp's build and gristmill's cache while measured go")
    parser.add_argument("--llama-cpp", metavar="DIR", help="a built llama.cpp bin directory (llama-bench, "
                        "llama-batched-bench, llama-quantize) to use instead of building one")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="measure gristmill only")
    parser.add_argument("--avx2", action="store_true", help="both sides as on a CPU with AVX2 and no AVX-512: "
                        "gristmill's kernels on their avx2 path (GRISTMILL_MAX_ISA=avx2), llama.cpp built for it "
                        "(without --llama-cpp: into build-avx2 beside the native build)")
    parser.add_argument("--skip-gristmill", action="store_true", help="measure llama.cpp only")
    parser.add_argument("--turns", type=int, default=3, help="pairs of batch-1 runs taken in turns by the "
                        "sides, after each file's block (their medians: a row of their own); 0: none")
    parser.add_argument("--prompt", type=int, default=512, help="tokens of the prompt whose tok/s is measured "
                        "(llama-bench's pp512); 0: none")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a side's process may take")
    parser.add_argument("--max-rss-gb", type=float, default=12, help="a side's process is stopped past this "
                        "much resident memory (GiB) and reported out of memory")
    args = parser.parse_args()
    args.sizes, args.types = args.sizes.split(","), args.types.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    for name, given, known in (("--sizes", args.sizes, SIZES), ("--types", args.types, TYPES)):
        if set(given) - set(known):
            parser.error(f"{name}: unknown {', '.join(sorted(set(given) - set(known)))}; known: {', '.join(known)}")
    return args


if __name__ == "__main__":
    main()
