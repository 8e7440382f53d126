"""Write a safetensors file tensor by tensor, piece by piece, as each is computed; read
one's tensors into new memory.

`safetensors.numpy.save_file` takes whole arrays: a converted GGUF's float32 weights (a
gigabyte for the bundled model) would first be dequantized into fresh memory, and first
touching that many pages costs more than the arithmetic. Here the header is written first
(its offsets follow from the dtypes and shapes alone) and each tensor's data follows in
pieces that its producer may compute into one reused buffer. The file is byte for byte
what `save_file` writes for the same arrays (tests/model/test_loader.py checks it): the
tensors ordered as safetensors orders them, the same compact JSON header padded with
spaces to a multiple of 8 bytes.

`SafetensorsReader` reads tensors into new tensors with one read each, where
`safetensors.safe_open` maps the file and a copy of its tensors (a warm start's int8
weights must not stay mapped: a cache file rewritten in place would crash the engine with
SIGBUS) takes a second copy through the mapping, at several times the cost.
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
_DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int16): "I16",
                np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8"}


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


# safetensors' dtype names -> (torch's, bytes per value).
_TORCH_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
                 "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
                 "U8": ("uint8", 1), "BOOL": ("bool", 1)}


class SafetensorsReader:
    """A safetensors file's tensors, each read into a new torch tensor (`read`). A file
    whose header or data is not whole raises ValueError (a truncated file too)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close() / the with block
        try:
            self._entries = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> dict[str, dict]:
        size = self._file.seek(0, 2)
        self._file.seek(0)
        length = int.from_bytes(self._file.read(8), "little")
        if size < 8 or 8 + length > size:
            raise ValueError(f"{self.path} is not a whole safetensors file (its header runs past its end)")
        header = json.loads(self._file.read(length))
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        for name, entry in header.items():
            start, stop = entry["data_offsets"]
            itemsize = _TORCH_DTYPES[entry["dtype"]][1]
            if stop - start != math.prod(entry["shape"]) * itemsize or self._data_start + stop > size:
                raise ValueError(f"{self.path}: tensor {name!r} does not fit the file (truncated or corrupt)")
        return header

    def keys(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> dict:
        """Tensor `name`'s header entry: its "dtype", "shape" and "data_offsets"."""
        return self._entries[name]

    def read(self, name: str):
        """Tensor `name`, as stored, in new memory."""
        import torch

        entry = self._entries[name]
        tensor = torch.empty(entry["shape"], dtype=getattr(torch, _TORCH_DTYPES[entry["dtype"]][0]))
        start, stop = entry["data_offsets"]
        self._file.seek(self._data_start + start)
        if stop > start and self._file.readinto(tensor.view(-1).view(torch.uint8).numpy()) != stop - start:
            raise ValueError(f"{self.path}: tensor {name!r} was cut short while it was read")
        return tensor

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
