"""This machine's memory rates, for benchmarks/sizes.py's bandwidth bound: how fast its
threads read memory (what a batch-1 step does to its weights) and copy it.

A read is measured by a loop of our own (C, compiled here with the system's `cc` and
called through ctypes, which lets go of the GIL: one slice per thread): numpy's
reductions compute too much per byte to keep up with the memory of a fast core (32 GB/s
on one thread where the loop read 41). Where no compiler is found the read rate is
numpy's (a lower figure, so a bound that is easier to meet: said in the line that
prints it).

On a VM the rate moves (the same loop read 41-46 GB/s in some minutes and 64-83 in
others, on a 2-core Zen 5), so every rate is the best over a few freshly allocated
buffers (and sizes.py measures before and after each file's block): the most this
machine gave, a bound no side can beat.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

_READ_LOOP = r"""
#include <stddef.h>
#include <stdint.h>
typedef uint64_t words __attribute__((vector_size(64)));  /* the compiler's widest loads */
uint64_t read_words(const uint64_t *p, size_t n) {
    words a = {0}, b = {0}, c = {0}, d = {0};
    const words *v = (const words *)p;
    size_t i = 0, m = n / 8;
    for (; i + 4 <= m; i += 4) { a |= v[i]; b |= v[i + 1]; c |= v[i + 2]; d |= v[i + 3]; }
    for (; i < m; i++) a |= v[i];
    a |= b | c | d;
    uint64_t r = 0;
    for (int j = 0; j < 8; j++) r |= a[j];
    for (i = m * 8; i < n; i++) r |= p[i];
    return r;
}
"""


def _compiled_read_loop():
    """The C read loop as a ctypes function, or None where there is no C compiler."""
    cc = next(filter(None, map(shutil.which, ("cc", "gcc", "clang", "c++", "g++"))), None)
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="gristmill-read-loop-") as build:
        source, library = Path(build) / "read.c", Path(build) / "read.so"
        source.write_text(_READ_LOOP)
        try:
            subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(library), "-x", "c", str(source)],
                           check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        function = ctypes.CDLL(str(library)).read_words  # (mapped: the file may go)
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return function


class MemoryRates:
    """`measure()` gives (copy, read): bytes read + written a second by a copy (as
    STREAM's Copy counts them) and bytes read a second, each the best over `buffers`
    fresh allocations of `total_bytes`, `runs` passes each, one slice per thread."""

    def __init__(self, threads: int, total_bytes: int = 2**31, buffers: int = 3, runs: int = 3):
        self.threads, self.total_bytes, self.buffers, self.runs = threads, total_bytes, buffers, runs
        self.read_loop = _compiled_read_loop()
        #: What measured the read rate, for the line that prints it.
        self.reader = "a C loop" if self.read_loop is not None else \
            "numpy (no C compiler found: a lower rate than the memory's)"

    def measure(self) -> tuple[float, float]:
        seconds = [float("inf")] * 2
        with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
            for _ in range(self.buffers):
                seconds = [min(pair) for pair in zip(seconds, self._seconds_in_a_fresh_buffer(pool))]
        return 2 * self.total_bytes / seconds[0], self.total_bytes / seconds[1]

    def _seconds_in_a_fresh_buffer(self, pool) -> list[float]:
        """The best seconds of a copy and of a read, over `runs` passes of one buffer."""
        source = np.ones(self.total_bytes // 8, dtype=np.uint64)
        target = np.zeros_like(source)
        target.fill(1)  # (written once first: no first-touch faults timed)
        slices = [slice(s[0], s[-1] + 1) for s in np.array_split(np.arange(len(source)), self.threads)]
        works = (functools.partial(_copy, source, target), functools.partial(_read, self.read_loop, source))
        seconds = [float("inf")] * 2
        for _ in range(self.runs):
            for i, work in enumerate(works):
                start = time.perf_counter()
                list(pool.map(work, slices))
                seconds[i] = min(seconds[i], time.perf_counter() - start)
        return seconds


def _copy(source: np.ndarray, target: np.ndarray, part: slice) -> None:
    np.copyto(target[part], source[part])


def _read(read_loop, source: np.ndarray, part: slice) -> None:
    words = source[part]
    if read_loop is not None:
        read_loop(words.ctypes.data, len(words))
    else:
        np.bitwise_or.reduce(words)
