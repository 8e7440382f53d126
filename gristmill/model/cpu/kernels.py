"""Optional C++ kernels, compiled once per machine on first use.

`fused_ops()`, `int8_extension()` and `q4_extension()` return the compiled module, or None
when it cannot be built (no compiler, GRISTMILL_KERNELS=0): callers then use a pure-torch
path, which gives the same results, only slower.

The quantized kernels pick their vector path at run time, the best this CPU runs;
GRISTMILL_MAX_ISA (one of ISA_NAMES' names) caps it, as on a machine without the
instructions above it: the same floats, at that path's speed (for comparing machines).

Importing this module imports no torch, and neither does `is_built`: a client can find
out whether a first start must compile (and start it early, `build_in_background`)
without loading torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import logging
import os
import threading
from pathlib import Path

from gristmill import startup

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512_vnni"}
# The 4-bit linear kernel is compiled in only for models that use it (q4=True).
_SOURCES = ["bindings.cpp", "fused_ops.cpp", "paged_attention.cpp", "encoder_attention.cpp", "decode_stack.cpp",
            "int8_linear.cpp", "gguf_linear.cpp", "isa.cpp", "lora_update.cpp"]
_Q4_SOURCES = _SOURCES + ["q4_linear.cpp"]


class _Build:
    """One build of the kernels: its sources, flags, and where it lives in the cache."""

    def __init__(self, q4: bool):
        self.name = "cpu_kernels_q4" if q4 else "cpu_kernels"
        self.sources = [_CSRC / f for f in (_Q4_SOURCES if q4 else _SOURCES)]
        # -march=native lets the compiler vectorize the float loops for this CPU (the
        # build is keyed by the CPU); the quantized linears still pick their vector path
        # at run time (best_isa), so tests can pin each one.
        # Functions start on a cache line: a kernel's loops then lie where its own code puts
        # them, whatever else the build holds (with the default 16 bytes, a change to one
        # code path moved another's unchanged tiles and timed them up to 1.1x slower).
        self.flags = ["-O3", "-march=native", "-fopenmp", "-falign-functions=64", f"-DGRISTMILL_Q4={int(q4)}"]
        from gristmill.paths import cache_root

        # Headers count too: a changed header rebuilds every source that includes it. So
        # does where the sources are: torch's build rebuilds when their paths change, so
        # two installs sharing one build directory would rebuild each other's kernels.
        inputs = sorted(self.sources) + sorted(_CSRC.glob("*.h"))
        key = hashlib.sha256(b"".join(p.read_bytes() for p in inputs) + " ".join(self.flags).encode()
                             + str(_CSRC.resolve()).encode() + importlib.metadata.version("torch").encode()
                             + _cpu_identity()).hexdigest()[:12]
        self.dir = cache_root() / "kernels" / key
        self.module = f"gristmill_{self.name}_{key}"

    @property
    def built(self) -> bool:
        return (self.dir / f"{self.module}.so").exists()

    def load(self):
        """Build (once) and import the extension; None when it cannot be built."""
        if os.environ.get("GRISTMILL_KERNELS", "1") == "0":
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.built:  # a warm start: the module as it is, without torch's build machinery
            with open(self.dir / "gristmill.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # (never half written by a build beside us)
                (self.dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed builder (see below)
                extension = self._import_built()
            if extension is not None:
                startup.cached(f"C++ kernels '{self.name}'", self.dir)
                return extension
        try:
            from torch.utils.cpp_extension import load

            # torch's own build lock is a file that stays behind when its builder is
            # killed, and every later build then waits on it forever. An flock is released
            # by the OS when its holder dies: whoever holds it is the only builder, so a
            # torch lock file found then is stale and goes.
            with open(self.dir / "gristmill.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                (self.dir / "lock").unlink(missing_ok=True)
                built = self.built
                what = f"compiling the C++ kernels '{self.name}' for this CPU"
                with contextlib.nullcontext() if built else startup.phase(what, self.dir):
                    extension = load(name=self.module, sources=[str(p) for p in self.sources],
                                     build_directory=str(self.dir), extra_cflags=self.flags, verbose=False)
                if built:
                    startup.cached(f"C++ kernels '{self.name}'", self.dir)
                return extension
        except Exception as exc:  # noqa: BLE001 - the torch path still works
            logger.warning("C++ kernels %s unavailable (%s); using the slower pure-torch path", self.name, exc)
            return None


    def _import_built(self):
        """The cached build imported directly (torch.utils.cpp_extension, which pulls in
        setuptools, costs seconds of every start); None when it does not import (a build
        cut short), and the full build path decides."""
        import importlib.util

        import torch  # noqa: F401 - the extension links against libtorch, loaded by this

        spec = importlib.util.spec_from_file_location(self.module, self.dir / f"{self.module}.so")
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except ImportError as exc:
            logger.warning("the cached C++ kernels in %s do not import (%s); building them again", self.dir, exc)
            return None
        return module


def _cpu_identity() -> bytes:
    """What a -march=native build depends on: the CPU's model and feature flags, so a
    cache shared between machines never hands one a binary built for another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted)).encode()


_lock = threading.Lock()
_loaded: dict[bool, object] = {}  # with q4 -> the extension (None: it cannot be built)


def extension(q4: bool = False):
    """The kernels, built for this CPU on first use (or None). A process that has the
    build with the 4-bit kernel uses it for everything."""
    max_isa = os.environ.get("GRISTMILL_MAX_ISA")
    if max_isa and max_isa not in ISA_NAMES.values():  # (set empty: as unset)
        raise ValueError(f"GRISTMILL_MAX_ISA={max_isa!r} names no code path of the CPU kernels: set it to one of "
                         f"{', '.join(ISA_NAMES.values())}, or unset it for the best this CPU runs")
    if _loaded.get(True) is not None:
        return _loaded[True]
    if q4 not in _loaded:
        with _lock:  # one build and one load, whichever thread asks first
            if q4 not in _loaded:
                _loaded[q4] = _Build(q4).load()
    return _loaded[q4]


def is_built(q4: bool = False) -> bool:
    """Whether the kernels are in the cache already (a warm start): no torch needed."""
    return os.environ.get("GRISTMILL_KERNELS", "1") == "0" or _Build(q4).built


def build_in_background(q4: bool = False, unless_cuda: bool = False) -> threading.Thread:
    """Start building (or loading) the kernels on a thread, so a first start compiles them
    while it converts and loads the model; whoever asks for them later waits for it.
    unless_cuda: not when torch sees a GPU (where device="auto" will not use them)."""
    def run():
        if unless_cuda:
            import torch
            if torch.cuda.is_available():
                return
        with contextlib.suppress(ValueError):  # (a bad GRISTMILL_MAX_ISA: told to whoever asks next)
            extension(q4)

    thread = threading.Thread(target=run, name="gristmill-kernels", daemon=True)
    thread.start()
    return thread


def fused_ops():
    """The CPU float32 ops (`rms_norm`, `residual_norm`, `qkv_rotary`, `mask_logits`;
    csrc/fused_ops.cpp), `paged_decode_attention`, `encoder_attention` and
    `decode_stack`; or None."""
    return extension()


def int8_extension():
    """The int8 linear kernel (`int8_linear`, `best_isa`) and the rest, or None."""
    return extension()


def q4_extension():
    """The kernels with the 4-bit linear kernel (`q4_linear`) too, or None."""
    return extension(q4=True)


if __name__ == "__main__":
    # `python -m gristmill.model.cpu.kernels`: build both extensions now (`make test` does,
    # while pip installs the test tools), so nothing compiles on first use.
    for q4 in (False, True):
        _Build(q4).load()
