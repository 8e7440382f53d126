"""llama.cpp's side of benchmarks/sizes.py: its source from llama-cpp-python's source
archive, the one tests/real_templates.py pins (version and sha256) and fetches; its CLI
tools built from it once (cached); and their figures, parsed from their output.

- start: `llama-batched-bench` on one token; llama.cpp's own "load time" (from the
  model's load to the end of its first decode, printed by llama_perf_context_print).
- batch 1: `llama-bench -p 0 -n TOKENS` (its mean over its repetitions); a prompt's
  tok/s: `llama-bench -p TOKENS -n 0`.
- batch N > 1: `llama-batched-bench -npp 16 -ntg TOKENS -npl N,...`, random 16-token prompts,
  generated tokens over the whole time (prefill included, as gristmill's figure is)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from sizes_process import Finished, run_measured

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.real_templates import LLAMA_CPP_PYTHON, download  # noqa: E402

TOOLS = ("llama-bench", "llama-quantize", "llama-batched-bench")
PROMPT_TOKENS = 16  # batched-bench's prompts (gristmill's short prompts are 10-25 tokens)
_VENDORED = f"{LLAMA_CPP_PYTHON.filename.removesuffix('.tar.gz')}/vendor/llama.cpp"


def source_dir(cache: Path) -> Path:
    """llama.cpp's source tree as llama-cpp-python 0.3.36 vendors it, unpacked under `cache`
    once (its `models/` holds the vocab-only GGUFs the random files take their tokenizers from)."""
    root = cache / "llama.cpp"
    source = root / _VENDORED
    if (source / "CMakeLists.txt").exists():
        return source
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        archive = download(LLAMA_CPP_PYTHON, Path(work))  # (its sha256 checked)
        with tarfile.open(archive) as tar:
            members = [m for m in tar if m.name.startswith(_VENDORED + "/")]
            tar.extractall(work, members=members, filter="data")
        top = _VENDORED.split("/")[0]  # (unpacked beside, then moved into place whole)
        shutil.rmtree(root / top, ignore_errors=True)
        Path(work, top).rename(root / top)
    return source


# The CPU flags of a build for AVX2 without AVX-512 (build(avx2=True)).
_AVX2 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
         "-DGGML_AVX512=OFF"]


def build(cache: Path, avx2: bool = False) -> Path:
    """The bin directory of llama.cpp's TOOLS, built once into `cache` (about 12 minutes on
    2 cores): a Release build for this CPU (GGML_NATIVE), or with avx2 for a CPU with AVX2
    and no AVX-512 (runs on this one as it would there); no libcurl."""
    if built(cache, avx2) is not None:
        return built(cache, avx2)
    source, build_dir = source_dir(cache), _build_dir(cache, avx2)
    print(f"building llama.cpp's {', '.join(TOOLS)} in {build_dir} (about 12 minutes on 2 cores)", flush=True)
    # (ninja may be the venv's: pip's ninja package)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cpu = _AVX2 if avx2 else ["-DGGML_NATIVE=ON"]
    for command in (["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                     *cpu, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                    ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count()), "--target", *TOOLS]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=7200, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:2])} failed: {(done.stdout + done.stderr).strip()[-2000:]}")
    return build_dir / "bin"


def built(cache: Path, avx2: bool = False) -> Path | None:
    """The bin directory of an earlier `build` into `cache`, or None."""
    bin_dir = _build_dir(cache, avx2) / "bin"
    return bin_dir if all((bin_dir / tool).exists() for tool in TOOLS) else None


def _build_dir(cache: Path, avx2: bool) -> Path:
    return cache / "llama.cpp" / ("build-avx2" if avx2 else "build")


def start_seconds(bin_dir: Path, model: Path, threads: int, timeout_s: float, max_rss: int) -> tuple[float, Finished]:
    """llama.cpp's load time of `model` in a fresh process (seconds), and that process."""
    run = run_measured([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "256", "-npp", "1",
                        "-ntg", "1", "-npl", "1", "-t", str(threads), "-lv", "4"], timeout_s, max_rss)
    found = re.search(r"load time =\s*([\d.]+) ms", run.output)
    return (float(found.group(1)) / 1000 if found else None), _parsed(run, found, "no load time in its output")


def batch1_tok_s(bin_dir: Path, model: Path, threads: int, tokens: int, timeout_s: float,
                 max_rss: int) -> tuple[float, Finished]:
    """Generated tok/s at batch 1 (llama-bench's tg test, its mean of 3 repetitions)."""
    return _bench_tok_s(bin_dir, model, threads, ["-p", "0", "-n", str(tokens)], timeout_s, max_rss)


def prompt_tok_s(bin_dir: Path, model: Path, threads: int, tokens: int, timeout_s: float,
                 max_rss: int) -> tuple[float, Finished]:
    """Prompt tok/s for a prompt of `tokens` (llama-bench's pp test, its mean of 3 repetitions)."""
    return _bench_tok_s(bin_dir, model, threads, ["-p", str(tokens), "-n", "0"], timeout_s, max_rss)


def _bench_tok_s(bin_dir: Path, model: Path, threads: int, test: list[str], timeout_s: float,
                 max_rss: int) -> tuple[float, Finished]:
    run = run_measured([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), *test,
                        "-r", "3", "-o", "json"], timeout_s, max_rss)
    try:
        speed = json.loads(run.output[run.output.index("["):run.output.rindex("]") + 1])[0]["avg_ts"]
    except (ValueError, LookupError):
        speed = None
    return speed, _parsed(run, speed is not None, "no avg_ts in its JSON")


def batched_tok_s(bin_dir: Path, model: Path, threads: int, tokens: int, batches: list[int],
                  timeout_s: float, max_rss: int) -> tuple[dict[int, float], Finished]:
    """Generated tok/s for each batch size in `batches` (> 1), from one llama-batched-bench run."""
    context = max(batches) * (PROMPT_TOKENS + tokens)
    run = run_measured([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(context),
                        "-npp", str(PROMPT_TOKENS), "-ntg", str(tokens), "-npl", ",".join(map(str, batches)),
                        "-t", str(threads), "--output-format", "jsonl"], timeout_s, max_rss)
    speeds = {}
    for line in run.output.splitlines():
        if line.startswith("{") and '"pl"' in line:
            row = json.loads(line)
            speeds[row["pl"]] = row["pl"] * row["tg"] / row["t"]
    return speeds, _parsed(run, set(speeds) == set(batches), "not every batch size in its output")


def _parsed(run: Finished, found, missing: str) -> Finished:
    """`run`, failed with `missing` where it exited 0 but its figure is not in its output."""
    if run.failure is None and not found:
        return Finished(run.output, run.seconds, run.peak_rss_bytes, missing)
    return run
