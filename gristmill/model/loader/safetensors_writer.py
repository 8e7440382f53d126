"""Write a safetensors file tensor by tensor, piece by piece, as each is computed.

`safetensors.numpy.save_file` takes whole arrays: a converted GGUF's float32 weights (a
gigabyte for the bundled model) would first be dequantized into fresh memory, and first
touching that many pages costs more than the arithmetic. Here the header is written first
(its offsets follow from the dtypes and shapes alone) and each tensor's data follows in
pieces that its producer may compute into one reused buffer. The file is byte for byte
what `save_file` writes for the same arrays (tests/model/test_loader.py checks it): the
tensors ordered as safetensors orders them, the same compact JSON header padded with
spaces to a multiple of 8 bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

# safetensors' names of the dtypes written here, in the order its files list them (it
# sorts tensors by dtype, the wider first, then by name).
_DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int8): "I8"}


class TensorSource(NamedTuple):
    """One tensor to write: `pieces()` yields its data in order, as C-contiguous arrays
    of `dtype` whose sizes add up to the shape's; each piece is written before the next
    is asked for, so a producer may reuse one buffer."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    pieces: Callable[[], Iterable[np.ndarray]]


def write_safetensors(path: Path, tensors: list[TensorSource], metadata: dict[str, str] | None = None) -> None:
    order = list(_DTYPE_NAMES)
    tensors = sorted(tensors, key=lambda t: (order.index(np.dtype(t.dtype)), t.name))
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        size = math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
        header[tensor.name] = {"dtype": _DTYPE_NAMES[np.dtype(tensor.dtype)], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for tensor in tensors:
            start, stop = header[tensor.name]["data_offsets"]
            for piece in tensor.pieces():
                if piece.dtype != tensor.dtype or not piece.flags.c_contiguous:
                    raise ValueError(f"a piece of {tensor.name} is not C-contiguous {np.dtype(tensor.dtype)}")
                start += f.write(piece.reshape(-1).view(np.uint8).data)
            if start != stop:
                raise ValueError(f"the pieces of {tensor.name} hold {start - stop:+d} bytes more than its shape")
