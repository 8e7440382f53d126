"""benchmarks/sizes_memory.py, which gives `sizes.py` its bandwidth bound: its read loop
reads every word it is given (a loop that skipped some would report a rate the memory
never gave), and both rates come out as bytes a second."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import sizes_memory


@pytest.fixture(scope="module")
def read_loop():
    loop = sizes_memory._compiled_read_loop()
    assert loop is not None, "the C read loop did not compile (the kernels' compiler is on every test machine)"
    return loop


@pytest.mark.parametrize("length", [1, 7, 8, 31, 32, 33, 1003])
def test_the_read_loop_sees_every_word(read_loop, length):
    words = np.zeros(length, dtype=np.uint64)
    for position in range(length):
        words[:] = 0
        words[position] = np.uint64(1) << np.uint64(position % 64)
        assert read_loop(words.ctypes.data, length) == 1 << (position % 64), position
    assert read_loop(words.ctypes.data, 0) == 0


def test_rates_are_bytes_a_second_of_a_copy_and_a_read():
    rates = sizes_memory.MemoryRates(threads=2, total_bytes=2**22, buffers=1, runs=2)
    assert rates.reader == "a C loop"
    copy, read = rates.measure()
    # 4 MiB in 2 slices: each rate between a slow disk's and far beyond any memory's.
    assert 1e8 < copy < 1e13 and 1e8 < read < 1e13
