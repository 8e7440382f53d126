"""The GGUF linear kernels (csrc/gguf_linear.cpp) per block type, shape and batch rows:
milliseconds a call, GB/s of weight bytes read, and that against the memory-copy
bandwidth measured in the same run (a 1 GiB torch copy_, counted as bytes read plus
bytes written, as STREAM's Copy counts it). At one row a call is bound by the bytes of
its weights, so the ratio says how close the kernel comes to what the memory gives.
The int8 kernel (Int8Linear) on the same shape is timed beside them; with --panels, each
type also with its panels packed once (GGUFLinear.pack_panels, as the loader packs them
where memory allows: "Q4_K+p"), its GB/s still counted in the file's bytes.

Each call reads weights that are not in any cache: the matrix is cycled through copies
totalling at least 256 MB, as a decode step reads a model's layers one after another.
Times are the median (and best) of repeated calls; on a machine that other processes
share, the best is the steadier figure, and the ratio is the best call's GB/s over the
best copy, the copy measured again before each shape.

    python benchmarks/gguf_kernels.py [--threads 2] [--rows 1 16 64] [--types Q4_K Q8_0] [--panels]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from gristmill.model.cpu import kernels
from gristmill.model.cpu.gguf_linear import GGUFLinear
from gristmill.model.cpu.qlinear import Int8Linear, quantize_weight

T = gguf.GGMLQuantizationType
SHAPES = [(2048, 2048), (8192, 2048), (4096, 4096), (14336, 4096)]  # (out, in)
TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q5_K"]
COLD_BYTES = 256 << 20  # weights cycled through per shape: several times any L3


def copy_bandwidth(repeats: int = 8) -> float:
    """GB/s of a 1 GiB float32 copy_ (bytes read + bytes written), the best of `repeats`."""
    src, dst = torch.ones(1 << 28), torch.zeros(1 << 28)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def random_blocks(ggml_type, rows: int, in_features: int, rng) -> torch.Tensor:
    """Random block bytes with small finite fp16 scales (the kernels' time does not
    depend on the values)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows, in_features // block_size, type_size), dtype=np.uint8)
    scales = (rng.standard_normal((rows, in_features // block_size, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    for offset in {T.Q6_K: (208,), T.Q4_K: (0, 2), T.Q5_K: (0, 2)}.get(ggml_type, (0,)):
        blocks[:, :, offset:offset + 2] = scales
    return torch.from_numpy(blocks.reshape(rows, -1))


def time_layers(layers: list, rows: int, in_features: int, min_seconds: float = 1.0) -> tuple[float, float]:
    """(median, best) seconds of one call, each call on the next layer of `layers`."""
    x = torch.randn(rows, in_features)
    for layer in layers[:2]:
        layer(x)
    cycle = itertools.cycle(layers)
    times, started = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - started < min_seconds and len(times) < 200):
        layer = next(cycle)
        times.append(_timed(lambda: layer(x)))
    return statistics.median(times), min(times)


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(flags.split())
    return " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni") if f in have)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES],
                        help="out x in, e.g. 4096x4096")
    parser.add_argument("--panels", action="store_true", help="also each type with its panels packed once")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = kernels.int8_extension()
    if ext is None:
        raise SystemExit("the kernels did not build")
    print(f"CPU flags: {cpu_flags()}; code path: {kernels.ISA_NAMES[ext.best_isa()]}; threads: {args.threads}\n")
    print(f"{'type':7} {'shape':>11} {'rows':>4} {'ms':>8} {'best ms':>8} {'GB/s':>6} {'best':>6} {'/copy':>6}")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        copy = copy_bandwidth()
        print(f"memory copy: {copy:.1f} GB/s (read + write; {copy / 2:.1f} GB/s copied)")
        names = [f"{t}{suffix}" for t in args.types for suffix in ("", "+p")[:1 + args.panels]]
        for name in names + ["int8"]:
            layers = _layers(name, n, k, rng)
            weight_bytes = _weight_bytes(layers[0])
            for rows in args.rows:
                median, best = time_layers(layers, rows, k)
                print(f"{name:7} {shape:>11} {rows:4} {median * 1e3:8.3f} {best * 1e3:8.3f} "
                      f"{weight_bytes / median / 1e9:6.1f} {weight_bytes / best / 1e9:6.1f} "
                      f"{weight_bytes / best / 1e9 / copy:6.0%}")
        print()


def _layers(name: str, n: int, k: int, rng) -> list:
    """Enough copies of one (n, k) layer of type `name` to total COLD_BYTES."""
    if name == "int8":
        first = Int8Linear(k, n, bias=False)
        for buffer, tensor in zip(first._buffers_of_kernel, quantize_weight(torch.randn(n, k))):
            setattr(first, buffer, tensor)
        copies = -(-COLD_BYTES // _weight_bytes(first))
        layers = [first]
        for _ in range(copies - 1):
            layer = Int8Linear(k, n, bias=False)
            for buffer in first._buffers_of_kernel:
                setattr(layer, buffer, getattr(first, buffer).clone())
            layers.append(layer)
        return layers
    ggml_type = T[name.removesuffix("+p")]
    first = GGUFLinear([(ggml_type, random_blocks(ggml_type, n, k, rng))], k)
    copies = -(-COLD_BYTES // _weight_bytes(first))
    layers = [first] + [GGUFLinear([(ggml_type, first.parts[0][1].clone())], k) for _ in range(copies - 1)]
    if name.endswith("+p"):
        for layer in layers:
            layer.pack_panels()
    return layers


def _weight_bytes(layer) -> int:
    if isinstance(layer, GGUFLinear):
        return sum(data.numel() for _, data in layer.parts)
    return sum(getattr(layer, b).numel() * getattr(layer, b).element_size() for b in layer._buffers_of_kernel)


if __name__ == "__main__":
    main()
