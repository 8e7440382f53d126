"""Read a GGUF file: its metadata, its tensor table and each tensor's bytes.

`gguf.GGUFReader` makes a numpy slice for every element of every metadata array, which
takes most of a minute for a 262,144-token vocabulary. This reader takes an array of
numbers with one `np.frombuffer` and an array of strings with a `struct` loop over the
mapped file, which takes a fraction of a second.

Tensor data comes as numpy views of the mapped file, shaped the way `gguf.GGUFReader`
shapes them (values for float and integer types, rows of block bytes for quantized
types), so `gguf.dequantize(tensor.data, tensor.tensor_type)` works on them.

A truncated or corrupt file raises ValueError naming the file and what is wrong.
Only little-endian files (what llama.cpp writes) of GGUF version 2 or 3 are read.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Fixed-size value types: struct format and numpy dtype, both little-endian.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<?", "?"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}

# Tensor types whose data is plain values; every other type is stored in blocks of bytes.
_VALUE_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: "<f4",
    GGMLQuantizationType.F16: "<f2",
    GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1",
    GGMLQuantizationType.I16: "<i2",
    GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}

# The fewest bytes a key/value pair and a tensor-table entry can take; used to reject
# counts that the rest of the file cannot hold before looping over them.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, one byte of value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dim count, ggml type, offset


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The GGUF file at `path`, its header parsed once within this process while the file
    is unchanged: an engine start reads a file's header for its memory check and again to
    load it, and a 262k-token vocabulary takes ~0.4 s to parse. Only the parsed header is
    kept (its arrays copied out of the file), for the last two files opened: each call
    maps the file afresh, so a model's mapping goes with the model. A file replaced or
    rewritten (another inode, size or modification time) is parsed again."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = (real, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    for i, (kept, header) in enumerate(_PARSED):
        if kept == key:
            _PARSED.insert(0, _PARSED.pop(i))
            return GGUFFile(real, _header=header)
    file = GGUFFile(real)
    _PARSED.insert(0, (key, file._kept_header()))
    del _PARSED[2:]
    return file


_PARSED: list[tuple[tuple, tuple]] = []  # (key, header), most recent first


def _detached(value: Any) -> Any:
    """A metadata value with its number arrays copied out of the mapping (read-only)."""
    if isinstance(value, np.ndarray):
        copy = np.array(value)
        copy.setflags(write=False)
        return copy
    if isinstance(value, list) and value and isinstance(value[0], (list, np.ndarray)):
        return [_detached(item) for item in value]
    return value


class GGUFTensor(NamedTuple):
    """One tensor: `shape` lists dimensions fastest-moving first (ggml order), as
    `gguf.GGUFReader` does; `data` is a view of the file shaped like its `data`."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray


class GGUFFile:
    """A parsed GGUF file.

    `fields` maps each metadata key to its value: an int, float, bool or str for a
    scalar, a read-only numpy array for an array of numbers or bools, a list of str for
    an array of strings, a list of those for an array of arrays. `field_types` maps each
    key to `(value type, element type)`, the element type None unless it is an array.
    """

    def __init__(self, path: str | os.PathLike, *, _header: tuple | None = None):
        self.path = str(path)
        self._buffer = _map_file(self.path)
        self._size = len(self._buffer)
        if _header is not None:  # (open_gguf: this file's header as parsed before)
            fields, self.field_types, infos, self.alignment, self.data_offset = _header
            self.fields = dict(fields)
        else:
            self.fields: dict[str, Any] = {}
            self.field_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
            pos, tensor_count, kv_count = self._read_header()
            pos = self._read_metadata(pos, kv_count)
            infos, pos = self._read_tensor_infos(pos, tensor_count)
            self.alignment = self._alignment()
            self.data_offset = -(-pos // self.alignment) * self.alignment  # next multiple
        self._infos = infos
        self.tensors = [self._tensor(*info) for info in infos]

    def _kept_header(self) -> tuple:
        """What open_gguf keeps of this file: its header, with no view of the mapping (a
        number array is a view of it: copied)."""
        return ({key: _detached(value) for key, value in self.fields.items()}, dict(self.field_types),
                list(self._infos), self.alignment, self.data_offset)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key`, or `default` when the file has no such key."""
        return self.fields.get(key, default)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop this process's mapping of `tensor`'s pages (the whole pages inside it): once
        its values have been copied elsewhere, the file's pages need not stay resident
        beside the copy. Reading the tensor again maps them again."""
        page = mmap.PAGESIZE
        start = -(-tensor.data_offset // page) * page
        stop = (tensor.data_offset + tensor.n_bytes) // page * page
        if stop > start and hasattr(self._buffer, "madvise"):
            self._buffer.madvise(mmap.MADV_DONTNEED, start, stop - start)

    # -- errors and bounds ---------------------------------------------------------------

    def _error(self, what: str) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {what}")

    def _truncated(self, what: str, pos: int) -> ValueError:
        return self._error(f"{what} at byte {pos} runs past the end of the file ({self._size} bytes); "
                           f"the file is truncated or corrupt")

    def _need(self, pos: int, n_bytes: int, what: str) -> None:
        if pos + n_bytes > self._size:
            raise self._truncated(what, pos)

    def _unpack(self, fmt: str, pos: int, what: str) -> tuple[tuple, int]:
        size = struct.calcsize(fmt)
        self._need(pos, size, what)
        return struct.unpack_from(fmt, self._buffer, pos), pos + size

    def _text(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._error(f"{what} is not valid UTF-8 ({exc})") from None

    def _check_count(self, pos: int, count: int, min_bytes: int, what: str) -> None:
        """Reject a count the bytes left in the file cannot hold (a corrupt count would
        otherwise drive a very long loop or a huge allocation)."""
        if count * min_bytes > self._size - pos:
            raise self._error(f"{what} says {count} entries, more than the {self._size - pos} bytes "
                              f"left after byte {pos} can hold; the file is truncated or corrupt")

    # -- header and metadata -------------------------------------------------------------

    def _read_header(self) -> tuple[int, int, int]:
        if self._buffer[:4] != MAGIC:
            raise self._error(f"it starts with {bytes(self._buffer[:4])!r}, not the GGUF magic {MAGIC!r}")
        (version,), pos = self._unpack("<I", 4, "the version")
        if version not in VERSIONS and version & 0xFFFF == 0:
            raise self._error("it is a big-endian GGUF file; only little-endian files are supported")
        if version not in VERSIONS:
            raise self._error(f"GGUF version {version} is not supported (only {VERSIONS})")
        self.version = version
        (tensor_count, kv_count), pos = self._unpack("<QQ", pos, "the tensor and key/value counts")
        self._check_count(pos, kv_count, _MIN_KV_BYTES, "the key/value count")
        self._check_count(pos, tensor_count, _MIN_TENSOR_INFO_BYTES, "the tensor count")
        return pos, tensor_count, kv_count

    def _read_string(self, pos: int, what: str) -> tuple[str, int]:
        (length,), pos = self._unpack("<Q", pos, f"the length of {what}")
        self._need(pos, length, what)
        return self._text(self._buffer[pos:pos + length], what), pos + length

    def _value_type(self, raw: int, what: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self._error(f"{what} has unknown value type {raw}") from None

    def _read_metadata(self, pos: int, count: int) -> int:
        for index in range(count):
            key, pos = self._read_string(pos, f"the key of metadata entry {index}")
            if key in self.fields:
                raise self._error(f"metadata key {key!r} appears twice")
            (raw_type,), pos = self._unpack("<I", pos, f"the value type of {key!r}")
            value_type = self._value_type(raw_type, f"metadata key {key!r}")
            element_type = None
            if value_type == GGUFValueType.ARRAY:
                element_type, value, pos = self._read_array(pos, key)
            else:
                value, pos = self._read_value(pos, value_type, key)
            self.fields[key] = value
            self.field_types[key] = (value_type, element_type)
        return pos

    def _read_value(self, pos: int, value_type: GGUFValueType, what: str) -> tuple[Any, int]:
        """One value that is not an array."""
        if value_type == GGUFValueType.STRING:
            return self._read_string(pos, f"the value of {what!r}")
        (value,), pos = self._unpack(_SCALAR_FORMATS[value_type][0], pos, f"the value of {what!r}")
        return value, pos

    def _read_array(self, pos: int, what: str) -> tuple[GGUFValueType, Any, int]:
        """An array: (element type, values, position after it)."""
        (raw_type, count), pos = self._unpack("<IQ", pos, f"the array header of {what!r}")
        element_type = self._value_type(raw_type, f"the elements of {what!r}")
        if element_type == GGUFValueType.STRING:
            self._check_count(pos, count, 8, f"the string array {what!r}")
            values, pos = self._read_string_array(pos, count, what)
        elif element_type == GGUFValueType.ARRAY:
            self._check_count(pos, count, 12, f"the array of arrays {what!r}")
            values = []
            for index in range(count):
                _, value, pos = self._read_array(pos, f"{what}[{index}]")
                values.append(value)
        else:
            values, pos = self._read_number_array(pos, count, element_type, what)
        return element_type, values, pos

    def _read_number_array(self, pos: int, count: int, element_type: GGUFValueType,
                           what: str) -> tuple[np.ndarray, int]:
        dtype = np.dtype(_SCALAR_FORMATS[element_type][1])
        self._check_count(pos, count, dtype.itemsize, f"the array {what!r}")
        values = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=pos) if count else \
            np.empty(0, dtype=dtype)
        return values, pos + count * dtype.itemsize

    def _read_string_array(self, pos: int, count: int, what: str) -> tuple[list[str], int]:
        # The one hot loop of the reader (a vocabulary has 10^5 strings): kept to plain locals.
        buffer, size, unpack = self._buffer, self._size, struct.unpack_from
        values = []
        for index in range(count):
            if pos + 8 > size:
                raise self._truncated(f"the length of {what}[{index}]", pos)
            (length,) = unpack("<Q", buffer, pos)
            start, pos = pos + 8, pos + 8 + length
            if pos > size:
                raise self._truncated(f"{what}[{index}]", start)
            values.append(self._text(buffer[start:pos], f"{what}[{index}]"))
        return values, pos

    # -- tensors ---------------------------------------------------------------------------

    def _read_tensor_infos(self, pos: int, count: int) -> tuple[list[tuple], int]:
        """The tensor table: [(name, dims, raw ggml type, offset in the data section)]."""
        infos = []
        names = set()
        for index in range(count):
            name, pos = self._read_string(pos, f"the name of tensor {index}")
            if name in names:
                raise self._error(f"tensor {name!r} appears twice")
            names.add(name)
            (n_dims,), pos = self._unpack("<I", pos, f"the dimension count of tensor {name!r}")
            dims, pos = self._unpack(f"<{n_dims}Q", pos, f"the dimensions of tensor {name!r}")
            (raw_type, offset), pos = self._unpack("<IQ", pos, f"the type and offset of tensor {name!r}")
            infos.append((name, dims, raw_type, offset))
        return infos, pos

    def _alignment(self) -> int:
        if "general.alignment" not in self.fields:
            return DEFAULT_ALIGNMENT
        alignment = self.fields["general.alignment"]
        if self.field_types["general.alignment"][0] != GGUFValueType.UINT32:
            raise self._error("general.alignment is not a uint32")
        if alignment == 0 or alignment & (alignment - 1):
            raise self._error(f"general.alignment {alignment} is not a power of two")
        return alignment

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise self._error(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        n_elements = math.prod(dims)
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + offset
        self._need(start, n_bytes, f"the data of tensor {name!r} ({n_bytes} bytes)")
        shape = tuple(reversed(dims))  # numpy order, slowest-moving first
        if tensor_type in _VALUE_TENSOR_DTYPES:
            dtype = np.dtype(_VALUE_TENSOR_DTYPES[tensor_type])
        else:
            dtype = np.dtype(np.uint8)
            shape = self._block_shape(name, shape, tensor_type, block_size, type_size)
        data = np.frombuffer(self._buffer, dtype=dtype, count=n_bytes // dtype.itemsize, offset=start)
        return GGUFTensor(name, tensor_type, tuple(dims), n_elements, n_bytes, start, data.reshape(shape))

    def _block_shape(self, name: str, shape: tuple[int, ...], tensor_type: GGMLQuantizationType,
                     block_size: int, type_size: int) -> tuple[int, ...]:
        """The byte shape of a blocked tensor: each row is its blocks' bytes."""
        if not shape or shape[-1] % block_size:
            raise self._error(f"tensor {name!r} has shape {shape}, whose rows are not whole "
                              f"{tensor_type.name} blocks of {block_size}")
        return (*shape[:-1], shape[-1] // block_size * type_size)


def _map_file(path: str) -> mmap.mmap:
    """The whole file mapped read-only (an empty file cannot be mapped, so it is refused)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path} is not a readable GGUF file: it is empty")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # 2 MiB pages where the kernel maps a file so (Linux: large folios): a decode step
    # streams every weight, at ~0.73x the rate over 4 KiB pages (docs/performance.md).
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapped.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # (advice only: a kernel without transparent huge pages refuses it)
            pass
    return mapped
