"""A checkpoint's tensors by HF name, each read when asked: from an HF directory's
safetensors files, or from a GGUF file mapped into memory (`GGUF_LINK` in its cache
directory points at it).

Nothing is read ahead: whoever builds the model asks for one tensor at a time, so a
start holds at most the model as it runs plus one tensor. A GGUF's quantized matrices
also come as they are stored (`stored`): rows of ggml blocks, views of the mapped file,
for the kernels that multiply by them where they lie.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from gristmill.gguf_file import open_gguf
from gristmill.model.loader.gguf_model import (GGUF_LINK, dequantize, hf_tensor_name, hf_transform, model_config,
                                               rotary_rows)
from gristmill.model.loader.safetensors_io import SafetensorsReader


class CheckpointTensors:
    """`names()`, `shape(name)`, `get(name)` (a float tensor, new memory), `stored(name)`
    (a GGUF's (ggml type, uint8 rows of blocks) or None) and `nbytes()` (the weights' bytes
    as stored)."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def stored(self, name: str) -> tuple[int, torch.Tensor] | None:
        return None

    def in_file(self, name: str) -> bool:
        """Whether `stored(name)` is a view of the mapped file (`release` can drop its pages)."""
        return False

    def release(self, name: str) -> None:
        """Drop the mapped file's pages of tensor `name` from this process: its values are
        held elsewhere now (reading the tensor again maps them again)."""

    def close(self) -> None:
        pass


class SafetensorsTensors(CheckpointTensors):
    """The `*.safetensors` files of an HF directory, each tensor read with one read."""

    def __init__(self, model_dir: Path, exclude: tuple[str, ...] = ()):
        files = sorted(f for f in model_dir.glob("*.safetensors") if f.name not in exclude)
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        self.readers = [SafetensorsReader(f) for f in files]
        self._where = {name: reader for reader in self.readers for name in reader.keys()}

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].entry(name)["shape"])

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


class GGUFTensors(CheckpointTensors):
    """A GGUF file's tensors under their HF names: `get` dequantizes (and applies what the
    HF checkpoint's tensor has beyond that: Gemma's norms, llama.cpp's rotary order);
    `stored` gives a matrix's blocks as the file holds them (q/k rows of a llama back in
    HF's rotary order: those two are copied)."""

    def __init__(self, path: Path):
        self.file = open_gguf(path)
        self.arch, self.config = model_config(self.file)
        self._tensors = {}
        for tensor in self.file.tensors:
            name = hf_tensor_name(tensor.name, self.arch)
            if name is None:
                if tensor.name == "rope_freqs.weight":  # (in the config: model_config)
                    continue
                raise ValueError(f"GGUF tensor {tensor.name!r} has no place in a {self.arch} model")
            self._tensors[name] = tensor

    def names(self) -> list[str]:
        return list(self._tensors)

    def gguf_name(self, name: str) -> str:
        return self._tensors[name].name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._tensors[name].shape))

    def tensor_type(self, name: str) -> int:
        return int(self._tensors[name].tensor_type)

    def get(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        values = dequantize(tensor.data, tensor.tensor_type).reshape(self.shape(name))
        transform = hf_transform(self.arch, name, self.config)
        if transform is not None:
            values = transform(values)
        values = np.ascontiguousarray(values, dtype=np.float32)
        values = values if values.flags.writeable else values.copy()  # (F32: a view of the file)
        self.file.release(tensor)  # (its values are in new memory now)
        return torch.from_numpy(values)

    def stored(self, name: str) -> tuple[int, torch.Tensor] | None:
        """A matrix's (ggml type, (rows, bytes a row) uint8 blocks): a view of the mapped file,
        or None for a float type or a tensor whose values need more than reordering rows."""
        tensor = self._tensors[name]
        if tensor.data.dtype != np.uint8 or len(tensor.shape) != 2:
            return None
        rows = tensor.data.reshape(tensor.shape[1], -1)
        order = rotary_rows(self.arch, name, self.config, len(rows))
        if order is not None:
            rows = rows[order]  # (a copy, in HF's row order)
            self.file.release(tensor)
        elif hf_transform(self.arch, name, self.config) is not None:
            return None
        with warnings.catch_warnings():  # a read-only mapping: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            return int(tensor.tensor_type), torch.from_numpy(rows)

    def in_file(self, name: str) -> bool:
        tensor = self._tensors[name]
        return (tensor.data.dtype == np.uint8 and len(tensor.shape) == 2
                and rotary_rows(self.arch, name, self.config, tensor.shape[1]) is None)

    def release(self, name: str) -> None:
        self.file.release(self._tensors[name])


def open_checkpoint(model_dir: Path, exclude: tuple[str, ...] = ()) -> CheckpointTensors:
    """The tensors of a model directory: its GGUF's (GGUF_LINK) or its safetensors files'
    (but those named in `exclude`)."""
    link = model_dir / GGUF_LINK
    if link.exists():
        return GGUFTensors(link)
    return SafetensorsTensors(model_dir, exclude)
