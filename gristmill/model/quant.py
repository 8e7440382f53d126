"""int8 weights on CPU: every linear layer, the tied LM head included.

Weights are quantized per output channel (int8 in [-127, 127] times one float scale per
row) and packed once for the C++ kernel (`csrc/int8_linear.cpp`); activations are
quantized per token inside the kernel. Embedding lookups and norms stay in float.

The quantized model is cached on disk next to other converted models, keyed by the
checkpoint files it came from, so a later start loads it instead of quantizing again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from gristmill.model import kernels

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "int8")  # and None: float weights
_FORMAT = "int8-v1"  # bump when the packed layout changes: old cache files are then ignored
_BLOCK, _GROUP_N = 16, 64  # the kernel's packing: 16 channels x 4 inputs, N padded to 64


def resolve_quantization(quantization: str | None, device: torch.device) -> str | None:
    """What runs: "auto" is int8 on CPU when the kernel builds, float elsewhere."""
    if quantization == "auto":
        if device.type != "cpu":
            return None
        if kernels.int8_extension() is None:
            logger.warning("quantization='auto': the int8 kernel is unavailable, so weights stay float")
            return None
        return "int8"
    if quantization == "int8" and device.type != "cpu":
        raise ValueError("quantization='int8' runs on CPU only; use quantization=None (or 'auto') on CUDA")
    return quantization


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (packed int8, per-row scale, per-row int32 sum), padded
    to the kernel's layout: (Np / 16, Kp / 4, 16, 4) with Np % 64 == 0 and Kp % 4 == 0."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // _GROUP_N) * _GROUP_N, -(-in_features // 4) * 4
    w = torch.zeros(rows, cols, dtype=torch.float32)
    w[:out_features, :in_features] = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
    q = q.to(torch.int8)
    packed = q.view(rows // _BLOCK, _BLOCK, cols // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, scale, q.sum(dim=1, dtype=torch.int32)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The padded (Np, Kp) int8 matrix of a packed weight."""
    blocks, groups = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * _BLOCK, groups * 4)


class Int8Linear(nn.Module):
    """A linear layer over int8 weights; takes and returns the activation dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        rows, cols = -(-out_features // _GROUP_N) * _GROUP_N, -(-in_features // 4) * 4
        self.register_buffer("qweight", torch.zeros(rows // _BLOCK, cols // 4, _BLOCK, 4, dtype=torch.int8))
        self.register_buffer("scale", torch.zeros(rows))
        self.register_buffer("qsum", torch.zeros(rows, dtype=torch.int32))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.isa = None  # None: the best this CPU runs; tests pin a path (kernels.ISA_NAMES)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None)
        layer.qweight, layer.scale, layer.qsum = quantize_weight(linear.weight)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().float().clone()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        ext = kernels.int8_extension()
        if ext is None:
            out = int8_linear_reference(flat, self)
        else:
            isa = ext.best_isa() if self.isa is None else self.isa
            bias = self.bias if self.bias is not None else flat.new_empty(0)
            out = ext.int8_linear(flat, self.qweight, self.scale, self.qsum, bias, self.out_features, isa)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_linear_reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """The kernel's arithmetic in plain torch (same rounding, same int32 sums): the
    fallback without a compiler, and the reference the kernel is tested against."""
    x = x.float()
    absmax = x.abs().amax(dim=1)
    inv = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    xq = torch.round(x * inv[:, None]).clamp_(-127, 127)
    w = unpack_weight(layer.qweight)[:layer.out_features, :layer.in_features]
    sums = (xq.double() @ w.double().T).float()  # exact: every partial sum is an integer < 2^53
    out = sums * (absmax / 127)[:, None] * layer.scale[:layer.out_features]
    return out if layer.bias is None else out + layer.bias


def quantize_model(model: nn.Module, cache_file: Path | None = None) -> None:
    """Replace every nn.Linear of `model` by an Int8Linear, from `cache_file` when it holds
    this model's quantized weights, else quantizing them (and writing the cache)."""
    from safetensors.torch import load_file, save_file

    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    cached = {}
    if cache_file is not None and cache_file.exists():
        try:
            cached = load_file(str(cache_file))
        except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
            logger.warning("ignoring unreadable quantized cache %s (%s)", cache_file, exc)
    state = {}
    for name, linear in linears.items():
        layer = Int8Linear(linear.in_features, linear.out_features, linear.bias is not None)
        keys = [f"{name}.{buf}" for buf, _ in layer.named_buffers(recurse=False)]
        if all(k in cached and cached[k].shape == b.shape for k, (_, b) in zip(keys, layer.named_buffers(recurse=False))):
            layer.load_state_dict({k.rsplit(".", 1)[1]: cached[k] for k in keys})
        else:
            layer = Int8Linear.from_linear(linear)
        state.update({f"{name}.{buf}": tensor for buf, tensor in layer.named_buffers(recurse=False)})
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    if cache_file is not None and len(cached) != len(state):
        _save_atomically(state, cache_file, save_file)


def _save_atomically(state: dict, path: Path, save_file) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_file_for(model_dir: Path, root: Path) -> Path:
    """Where the int8 weights of `model_dir` are cached: keyed by its checkpoint files'
    paths, sizes and modification times, so a changed checkpoint is quantized afresh."""
    files = sorted(model_dir.glob("*.safetensors"))
    parts = [_FORMAT, str(model_dir.resolve())]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return root / "quantized" / f"{model_dir.name}-{key}.safetensors"
