"""Optional C++ kernels, compiled once per machine on first use.

`paged_decode_attention()`, `fused_ops()` and `int8_extension()` return the compiled op /
module, or None when it cannot be built (no compiler, GRISTMILL_KERNELS=0): callers then
use a pure-torch path, which gives the same results, only slower.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from gristmill import startup

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512_vnni"}


def _build(name: str, sources: list[Path], flags: list[str]):
    if os.environ.get("GRISTMILL_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    from gristmill.paths import cache_root

    # Headers count too: a changed header rebuilds every source that includes it. So does
    # where the sources are: torch's build rebuilds when their paths change, so two
    # installs sharing one build directory would rebuild each other's kernels at every start.
    inputs = sorted(sources) + sorted(_CSRC.glob("*.h"))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in inputs) + " ".join(flags).encode()
                         + str(_CSRC.resolve()).encode()
                         + torch.__version__.encode() + _cpu_identity(flags)).hexdigest()[:12]
    build_dir = cache_root() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        # torch's own build lock is a file that stays behind when its builder is killed,
        # and every later build then waits on it forever. An flock is released by the OS
        # when its holder dies: whoever holds it is the only builder, so a torch lock
        # file found then is stale and goes.
        with open(build_dir / "gristmill.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            module = f"gristmill_{name}_{key}"
            what = f"compiling the C++ kernels '{name}' for this CPU"
            built = (build_dir / f"{module}.so").exists()
            with contextlib.nullcontext() if built else startup.phase(what, build_dir):
                extension = load(name=module, sources=[str(p) for p in sources], build_directory=str(build_dir),
                                 extra_cflags=flags, verbose=False)
            if built:
                startup.cached(f"C++ kernels '{name}'", build_dir)
            return extension
    except Exception as exc:  # noqa: BLE001 - the torch path still works
        logger.warning("C++ kernel %s unavailable (%s); using the slower pure-torch path", name, exc)
        return None


def _cpu_identity(flags: list[str]) -> bytes:
    """What a -march=native build depends on: the CPU's model and feature flags, so a
    cache shared between machines never hands one a binary built for another."""
    if "-march=native" not in flags:
        return b""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted)).encode()


@functools.cache
def _cpu_ops_extension():
    # The decode stack runs the quantized linear kernels too, so they are compiled in here
    # as well (their vector paths are still picked at run time).
    sources = ["fused_ops.cpp", "paged_attention.cpp", "decode_stack.cpp", "int8_linear.cpp", "q4_linear.cpp",
               "isa.cpp"]
    return _build("cpu_ops", [_CSRC / f for f in sources], ["-O3", "-march=native", "-fopenmp"])


@functools.cache
def _int8_extension():
    # No -march=native: the vector paths carry their own target attributes and are picked
    # at run time from what the CPU reports, so the portable path stays portable.
    sources = ["linear_module.cpp", "int8_linear.cpp", "q4_linear.cpp", "isa.cpp"]
    return _build("quantized_linear", [_CSRC / f for f in sources], ["-O3", "-fopenmp"])


def paged_decode_attention():
    ext = _cpu_ops_extension()
    return None if ext is None else ext.paged_decode_attention


def fused_ops():
    """The CPU float32 extension: the fused ops (`rms_norm`, `residual_norm`, `qkv_rotary`;
    csrc/fused_ops.cpp), `paged_decode_attention` and `decode_stack`; or None."""
    return _cpu_ops_extension()


def int8_extension():
    """The quantized linear extension (`int8_linear`, `q4_linear`, `best_isa`), or None."""
    return _int8_extension()
