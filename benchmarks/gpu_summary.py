"""The summary of `gpu_checks.sh all`: every figure its parts left in WORK gathered into
OUT/results.json, and the tables into OUT/summary.txt.

    python benchmarks/gpu_summary.py WORK OUT
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SHAPE_ORDER = ("gemma3-270m", "qwen3-0.6b", "llama3.2-1b", "llama3.1-8b")


def _tail(path: Path, lines: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def _num(value, fmt="{:,.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def shape_tables(shapes: dict) -> list[str]:
    lines = ["generated tok/s, 32 prompt tokens, 128 output tokens, greedy, EOS ignored; hf_graph: transformers "
             "over a StaticCache, each decode step one CUDA graph",
             "| shape | batch | gristmill | hf_graph | gm / hf_graph |", "|---|---|---|---|---|"]
    for name, data in shapes.items():
        for batch, row in data.get("decode", {}).items():
            lines.append(f"| {name} | {batch} | {_num(row.get('gristmill'))} | {_num(row.get('hf_graph'))} | "
                         f"{_num(row.get('ratio'), '{:.2f}x')} |")
    lines += ["", "what bounds them: batch 1 against the weights read once a step at the measured copy "
              "bandwidth; the largest batch against torch.matmul of the step's own shapes",
              "| shape | params | start s | prefill tok/s | b1 bound tok/s | b1 / bound | b256 matmul bound tok/s "
              "(TFLOP/s) | b256 / bound | b256 ms/step (host waited) | b256 graph ms |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, data in shapes.items():
        decode = data.get("decode", {})
        bw, mm = data.get("bandwidth_bound", {}), data.get("matmul_bound", {})
        b1 = decode.get("1", {}).get("gristmill")
        top = str(mm.get("tokens", 256))
        btop = decode.get(top, {}).get("gristmill")
        waits = data.get("host_waits", {}).get(top, {})
        graph_ms = data.get("decode_graph_ms", {}).get(top)
        b1_ratio = b1 / bw["batch1_bound_tok_s"] if b1 and bw else None
        top_ratio = btop / mm["matmul_bound_tok_s"] if btop and mm else None
        lines.append(
            f"| {name} | {_num(data.get('parameters', 0) / 1e9, '{:.2f}B')} | {_num(data.get('gristmill_start_s'), '{:.1f}')} | "
            f"{_num(data.get('prefill_tok_s'))} | {_num(bw.get('batch1_bound_tok_s'))} | {_num(b1_ratio, '{:.0%}')} | "
            f"{_num(mm.get('matmul_bound_tok_s'))} ({_num(mm.get('matmul_tflops'), '{:.0f}')}) | "
            f"{_num(top_ratio, '{:.0%}')} | {_num(waits.get('ms_per_step'), '{:.2f}')} "
            f"({_num(waits.get('waited_ms_per_step'), '{:.2f}')}) | {_num(graph_ms, '{:.2f}')} |")
    for name, data in shapes.items():
        if "nano_vllm_workload" in data:
            nano = data["nano_vllm_workload"]
            lines += ["", f"nano-vllm's workload on {name} (256 sequences, input and output uniform in [100, 1024]): "
                          f"{nano['output_tok_s']:,.0f} output tok/s ({nano['seconds']:.1f} s; published on an A100: "
                          f"vLLM 7,484, nano-vllm 8,961)"]
    return lines


def main(work: str, out: str) -> None:
    work_dir, out_dir = Path(work), Path(out)
    shapes = {}
    for name in SHAPE_ORDER:
        path = work_dir / f"shape-{name}.json"
        if path.exists():
            shapes[name] = json.loads(path.read_text())
    first = next(iter(shapes.values()), {})
    results = {"gpu": first.get("gpu"), "torch": first.get("torch"), "cuda": first.get("cuda"), "shapes": shapes,
               "tests": _tail(work_dir / "tests-exit.txt", 5)}
    for name in ("tests-cuda", "tests-rest"):
        results[f"{name}_last_line"] = _tail(work_dir / f"{name}.txt", 1)
    results["structured"] = _tail(work_dir / "structured.txt", 14)
    defaults = {}
    for path in sorted(work_dir.glob("defaults-*.txt")):
        defaults[path.stem] = [line for line in _tail(path, 40) if re.search(r"tok/s|rows|error|Error", line)][-4:]
    results["defaults"] = defaults
    results["skipped"] = _tail(work_dir / "skipped.txt", 20)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"GPU: {results['gpu']}, torch {results['torch']}, CUDA {results['cuda']}", "",
             "tests:", *results["tests"], *results["tests-cuda_last_line"], *results["tests-rest_last_line"], "",
             *shape_tables(shapes), "", "structured output and penalties (benchmarks/structured_output.py):",
             *results["structured"], "", "gristmill batch, 1,024 rows (1: CUDA defaults 256 / 8192; "
             "2: 512 / 16384):"]
    for name, tail in defaults.items():
        lines += [f"  {name}: {line}" for line in tail]
    if results["skipped"]:
        lines += ["", "skipped:", *results["skipped"]]
    (out_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:3])
