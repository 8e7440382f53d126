"""Start-up, side by side in one run: `python -c "import torch"` (the floor: every start
imports torch), a warm `gristmill generate` of one short prompt on the bundled model
(kernels, converted model and int8 weights cached), and, with --cold, a first start on an
empty cache (GGUF conversion, int8 quantization and the kernels' compile), and the GGUF
conversion alone (nothing compiling beside it), its files checked byte for byte against the
warm cache's. Each is a fresh process, timed from its launch to its exit; `engine ready` is what the engine
itself reports. Prints the median of --runs and warm - import torch. With --before DIR,
also a warm `gristmill generate` of the checkout in DIR (another worktree: its code is
imported there), alternating with this one's, so drift on a shared machine hits both.

    python benchmarks/startup.py [--runs 3] [--cold] [--before ../main]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

GENERATE = [sys.executable, "-m", "gristmill.cli", "generate", "Hello", "--max-tokens", "4"]
# The bundled model's GGUF directory alone (config, tokenizer, a link to the file: its
# weights stay in the file), into the directory it is given; prints its seconds.
CONVERT = [sys.executable, "-c", "import pathlib, sys, time\n"
           "from gristmill.model.loader import convert_gguf\n"
           "from gristmill.paths import default_model_path\n"
           "start = time.perf_counter()\n"
           "convert_gguf(default_model_path(), pathlib.Path(sys.argv[1]), weights=False)\n"
           "print(time.perf_counter() - start)"]


def timed(command: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed, done.stderr


def phases(stderr: str) -> dict[str, float]:
    """The start-up steps the command line reported ("...: done in 1.2 s"), and `ready`."""
    found = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"gristmill: (.*?): done in ([\d.]+) s", stderr)}
    ready = re.search(r"engine ready in ([\d.]+) s", stderr)
    if ready:
        found["engine ready"] = float(ready.group(1))
    return found


def conversion_alone() -> list[tuple[str, float]]:
    """The GGUF conversion in a process of its own, nothing else starting; its files must
    be the warm cache's, byte for byte."""
    import hashlib
    from pathlib import Path

    from gristmill.paths import converted_gguf_dir, default_model_path

    warm = converted_gguf_dir(default_model_path())
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        done = subprocess.run([*CONVERT, out], capture_output=True, text=True, check=True, timeout=900)
        elapsed, seconds = time.perf_counter() - start, float(done.stdout.split()[-1])
        files = sorted(p.name for p in Path(out).iterdir())
        differ = [name for name in files if hashlib.sha256((warm / name).read_bytes()).digest()
                  != hashlib.sha256(Path(out, name).read_bytes()).digest()]
    if differ:
        raise RuntimeError(f"the conversion's {differ} differ from the warm cache's ({warm})")
    return [("GGUF conversion alone, process", elapsed),
            (f"  of which converting ({len(files)} files, = cache's)", seconds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="also a first start on an empty cache (~25-60 s)")
    parser.add_argument("--before", metavar="DIR", help="also a warm start of the checkout in DIR, alternating")
    args = parser.parse_args()
    checkouts = {"": None} if args.before is None else {"": None, " (before)": args.before}
    for cwd in checkouts.values():
        timed(GENERATE, cwd=cwd)  # warm the cache (and the OS's file cache) once
    torch_s = []
    warm_s, ready_s = ({name: [] for name in checkouts} for _ in range(2))
    for _ in range(args.runs):  # alternating, so drift on a shared machine hits all alike
        torch_s.append(timed([sys.executable, "-c", "import torch"])[0])
        for name, cwd in checkouts.items():
            elapsed, stderr = timed(GENERATE, cwd=cwd)
            warm_s[name].append(elapsed)
            ready_s[name].append(phases(stderr).get("engine ready", float("nan")))
    rows = [("python -c 'import torch'", statistics.median(torch_s))]
    for name in checkouts:
        rows += [(f"gristmill generate, warm{name}", statistics.median(warm_s[name])),
                 ("  of which: engine ready", statistics.median(ready_s[name]))]
    if args.cold:
        with tempfile.TemporaryDirectory() as cache:
            elapsed, stderr = timed(GENERATE, env={**os.environ, "GRISTMILL_CACHE": cache})
        rows.append(("gristmill generate, empty cache", elapsed))
        rows += [(f"  {name}", seconds) for name, seconds in phases(stderr).items()]
        rows += conversion_alone()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split() if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")})
    print(f"{cpu}, {os.cpu_count()} CPUs, {' '.join(flags)}; median of {args.runs} runs")
    for name, seconds in rows:
        print(f"{name:<40} {seconds:6.1f} s")
    for name in checkouts:
        print(f"{'warm - import torch' + name:<40} {statistics.median(warm_s[name]) - rows[0][1]:6.1f} s"
              f" (target: <= 2 s)")


if __name__ == "__main__":
    main()
