"""Optional C++ kernels, compiled once per machine on first use.

`paged_decode_attention()` returns the compiled op, or None when it cannot be built
(no compiler, GRISTMILL_KERNELS=0): callers then use the pure-torch path, which gives
the same results, only slower.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


@functools.cache
def _extension():
    if os.environ.get("GRISTMILL_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    from gristmill.model.loader import cache_root

    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    build_dir = cache_root() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load(name=f"gristmill_kernels_{key}", sources=[str(_SOURCE)], build_directory=str(build_dir),
                    extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - the torch path still works
        logger.warning("C++ kernels unavailable (%s); using the slower pure-torch attention", exc)
        return None


def paged_decode_attention():
    ext = _extension()
    return None if ext is None else ext.paged_decode_attention
