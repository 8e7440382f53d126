"""int8 weights on CPU: every linear layer, the tied LM head included.

Weights are quantized in blocks of 32 input channels (int8 in [-127, 127] times one fp16
scale per output channel and block, as llama.cpp's Q8_0) and packed once for the C++
kernel (`csrc/int8_linear.cpp`); activations are quantized the same way, per token and
block, inside the kernel. Embedding lookups, norms and attention stay in float.

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
from gristmill.model.layers import GATE_UP, QKV

logger = logging.getLogger(__name__)

_FORMAT = "int8-v3"  # bump when the packed layout changes: old cache files are then ignored
_BLOCK, _PAD, Q = 16, 32, 32  # packing: 16 channels x 4 inputs; N and K padded to 32; blocks of 32


_EMPTY = torch.empty(0)


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


def _padded(out_features: int, in_features: int) -> tuple[int, int]:
    return -(-out_features // _PAD) * _PAD, -(-in_features // _PAD) * _PAD


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> the kernel's packed form, padded with zeros to (Np, Kp):
    int8 values (Np / 16, Kp / 4, 16, 4), fp16 block scales and int16 block sums, both
    (Np / 16, Kp / 32, 16)."""
    out_features, in_features = weight.shape
    rows, cols = _padded(out_features, in_features)
    w = torch.zeros(rows, cols, dtype=torch.float32)
    w[:out_features, :in_features] = weight.detach().float()
    blocks = w.view(rows, cols // Q, Q)
    scale = (blocks.abs().amax(dim=2) / 127).half()  # the values are rounded against the fp16 scale
    divisor = scale.float().clamp(min=torch.finfo(torch.float32).tiny)[:, :, None]
    q = torch.round(blocks / divisor).clamp_(-127, 127).to(torch.int8)
    sums = q.sum(dim=2, dtype=torch.int16)
    packed = q.view(rows // _BLOCK, _BLOCK, cols // 4, 4).permute(0, 2, 1, 3).contiguous()

    def per_block(t):  # (Np, Kp / 32) -> (Np / 16, Kp / 32, 16)
        return t.view(rows // _BLOCK, _BLOCK, cols // Q).permute(0, 2, 1).contiguous()
    return packed, per_block(scale), per_block(sums)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The padded (Np, Kp) int8 matrix of a packed weight."""
    blocks, groups = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * _BLOCK, groups * 4)


def unpack_blocks(per_block: torch.Tensor) -> torch.Tensor:
    """(Np / 16, Kp / 32, 16) block scales or sums -> (Np, Kp / 32)."""
    return per_block.permute(0, 2, 1).reshape(-1, per_block.shape[1])


class Int8Linear(nn.Module):
    """A linear layer over int8 weights; takes and returns the activation dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        rows, cols = _padded(out_features, in_features)
        self.register_buffer("qweight", torch.zeros(rows // _BLOCK, cols // 4, _BLOCK, 4, dtype=torch.int8))
        self.register_buffer("scale", torch.zeros(rows // _BLOCK, cols // Q, _BLOCK, dtype=torch.float16))
        self.register_buffer("qsum", torch.zeros(rows // _BLOCK, cols // Q, _BLOCK, dtype=torch.int16))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.isa = None  # None: the best this CPU runs; tests pin a path (kernels.ISA_NAMES)
        # The LM head writes its (rows, vocab) logits into one reused buffer: a fresh
        # allocation of that size costs page faults every step (15 ms at 64 x 262k).
        # Its output is then only valid until the next call.
        self.reuse_output = False
        self._out = None

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
            out = ext.int8_linear(flat, self.qweight, self.scale, self.qsum, bias, self.out_features, isa,
                                  self._output(flat.shape[0]))
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _output(self, rows: int) -> torch.Tensor:
        if not self.reuse_output:
            return _EMPTY
        if self._out is None or self._out.shape[0] < rows:
            self._out = torch.empty(rows, self.out_features)
        return self._out[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_linear_reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """The kernel's arithmetic in plain torch (same rounding, same int32 block sums, float
    accumulation in another order): the fallback without a compiler, and the reference
    the kernel is tested against."""
    if x.shape[0] > 16:  # bound the (rows, out, blocks) float64 intermediate
        return torch.cat([int8_linear_reference(part, layer) for part in x.split(16)])
    x = x.float()
    rows, cols = _padded(layer.out_features, layer.in_features)
    xb = torch.nn.functional.pad(x, (0, cols - x.shape[1])).view(x.shape[0], cols // Q, Q)
    absmax = xb.abs().amax(dim=2)
    inv = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    xq = torch.round(xb * inv[:, :, None]).clamp_(-127, 127)
    w = unpack_weight(layer.qweight).view(rows, cols // Q, Q)
    sums = torch.einsum("mbq,nbq->mnb", xq.double(), w.double())  # exact integers
    scales = (absmax / 127).double()[:, None, :] * unpack_blocks(layer.scale).double()[None]
    out = (sums * scales).sum(dim=2).float()[:, :layer.out_features]
    return out if layer.bias is None else out + layer.bias


def fuse_projections(model: nn.Module) -> None:
    """Concatenate q/k/v and gate/up projections that read the same input into one layer
    each (`layers.project` splits the output again): fewer, larger matmuls, and the input
    is quantized once instead of three times. Exact for int8, where every output channel
    is computed on its own."""
    for module in list(model.modules()):
        for fused, parts in (QKV, GATE_UP):
            linears = [getattr(module, name, None) for name in parts]
            if not all(isinstance(lin, nn.Linear) for lin in linears):
                continue
            has_bias = {lin.bias is not None for lin in linears}
            if len({lin.in_features for lin in linears}) != 1 or len(has_bias) != 1:
                continue
            layer = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears),
                              bias=has_bias.pop(), device="meta")
            layer.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
            for name in parts:
                delattr(module, name)
            setattr(module, fused, layer)
            layer.split_sizes = [lin.out_features for lin in linears]


def quantize_model(model: nn.Module, cache_file: Path | None = None) -> None:
    """Fuse projections, then replace every nn.Linear of `model` by an Int8Linear, from
    `cache_file` when it holds this model's quantized weights, else quantizing them (and
    writing the cache)."""
    from safetensors.torch import load_file, save_file

    fuse_projections(model)
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    cached = {}
    if cache_file is not None and cache_file.exists():
        try:
            cached = load_file(str(cache_file))
        except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
            logger.warning("ignoring unreadable quantized cache %s (%s)", cache_file, exc)
    state, quantized_now = {}, False
    for name, linear in linears.items():
        layer = Int8Linear(linear.in_features, linear.out_features, linear.bias is not None)
        stored = {buf: cached.get(f"{name}.{buf}") for buf, _ in layer.named_buffers(recurse=False)}
        if all(t is not None and t.shape == getattr(layer, buf).shape for buf, t in stored.items()):
            layer.load_state_dict(stored)
        else:
            layer, quantized_now = Int8Linear.from_linear(linear), True
        layer.split_sizes = getattr(linear, "split_sizes", None)
        layer.reuse_output = name == "lm_head"
        state.update({f"{name}.{buf}": tensor for buf, tensor in layer.named_buffers(recurse=False)})
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    if cache_file is not None and (quantized_now or len(cached) != len(state)):
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
