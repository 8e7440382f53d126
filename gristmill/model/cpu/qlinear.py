"""Quantized linear layers on CPU: int8 and 4-bit weights, int8 activations.

Both quantize in blocks of 32 input channels, the activations per token and block
inside the kernel (`csrc/`), so a row's result never depends on the rest of its batch:
- `Int8Linear`: int8 weights in [-127, 127] times an fp16 scale per output channel and
  block (as llama.cpp's Q8_0). Within 1% of float perplexity on Gemma 3.
- `Q4Linear`: 4-bit weights q in [0, 15], w = scale * q + min, an fp16 scale and minimum
  per output channel and block (as llama.cpp's Q4_1): half of int8's bytes, which is
  what a batch-1 step waits on.

Without the compiled extension each runs the same arithmetic in plain torch
(`reference`), which is also what the kernel is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.cpu import kernels
from gristmill.model.layers.mlp import ACTIVATIONS

_BLOCK, _PAD, Q = 16, 32, 32  # packing: 16 output channels a block; N and K padded to 32; blocks of 32
_EMPTY = torch.empty(0)
_PACK_ROWS = 1024  # rows packed at a time (a multiple of _PAD: only the last piece is padded)
# The activations the kernels apply as they write their output (csrc/linear_common.h,
# `Activation`): name -> the kernels' code.
FUSED_ACTIVATIONS = {"gelu": 1}


def _padded(out_features: int, in_features: int) -> tuple[int, int]:
    return -(-out_features // _PAD) * _PAD, -(-in_features // _PAD) * _PAD


def _padded_blocks(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) weight -> float32 (Np, Kp / 32, 32), zero padded."""
    out_features, in_features = weight.shape
    rows, cols = _padded(out_features, in_features)
    w = torch.zeros(rows, cols, dtype=torch.float32)
    w[:out_features, :in_features] = weight.detach().float()
    return w.view(rows, cols // Q, Q)


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """(Np, Kp / 32) -> the kernels' (Np / 16, Kp / 32, 16)."""
    rows, qblocks = t.shape
    return t.view(rows // _BLOCK, _BLOCK, qblocks).permute(0, 2, 1).contiguous()


def unpack_blocks(per_block: torch.Tensor) -> torch.Tensor:
    """(Np / 16, Kp / 32, 16) block scales, sums or minimums -> (Np, Kp / 32)."""
    return per_block.permute(0, 2, 1).reshape(-1, per_block.shape[1])


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> the int8 kernel's packed form, padded with zeros to (Np, Kp):
    int8 values (Np / 16, Kp / 4, 16, 4), fp16 block scales and int16 block sums, both
    (Np / 16, Kp / 32, 16)."""
    blocks = _padded_blocks(weight)
    scale = (blocks.abs().amax(dim=2) / 127).half()  # the values are rounded against the fp16 scale
    divisor = scale.float().clamp(min=torch.finfo(torch.float32).tiny)[:, :, None]
    q = torch.round(blocks / divisor).clamp_(-127, 127).to(torch.int8)
    return _pack(q, scale)


def pack_q8_0(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix as it is, (out, in) int8 values and (out, in / 32) fp16 scales (as
    llama.cpp makes them: the same rounding as `quantize_weight`), in the int8 kernel's
    packed form: what quantize_weight gives for its dequantized floats, without them."""
    out_features, in_features = values.shape
    rows, cols = _padded(out_features, in_features)
    q = torch.zeros(rows, cols, dtype=torch.int8)
    q[:out_features, :in_features] = values
    scale = torch.zeros(rows, cols // Q, dtype=torch.float16)
    scale[:out_features, :in_features // Q] = scales
    return _pack(q.view(rows, cols // Q, Q), scale)


def _pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Np, Kp / 32, 32) int8 values and (Np, Kp / 32) fp16 scales -> packed values, block
    scales and block sums."""
    rows, qblocks, _ = q.shape
    sums = q.sum(dim=2, dtype=torch.int16)
    packed = q.view(rows // _BLOCK, _BLOCK, qblocks * Q // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, _per_block(scale), _per_block(sums)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The padded (Np, Kp) int8 matrix of a packed int8 weight."""
    blocks, groups = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * _BLOCK, groups * 4)


def quantize_weight_q4(weight: torch.Tensor, refinements: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> the q4 kernel's packed form, padded with zeros to (Np, Kp):
    nibbles (Np / 16, Kp / 4, 32) uint8, fp16 block scales and minimums (Np / 16, Kp / 32, 16).

    Each block starts from its min-max fit, then a few rounds of least-squares refits
    of (scale, min) to the rounded values keep whichever fit has the smaller error."""
    blocks = _padded_blocks(weight)
    lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)
    best = _fit_q4(blocks, ((hi - lo) / 15).half(), lo.half())
    for _ in range(refinements):
        q = best[0].float()
        n, sq, sw = Q, q.sum(2), blocks.sum(2)
        det = n * (q * q).sum(2) - sq * sq
        scale = torch.where(det > 0, (n * (q * blocks).sum(2) - sq * sw) / det.clamp(min=1e-12), best[1].float())
        candidate = _fit_q4(blocks, scale.half(), ((sw - scale * sq) / n).half())
        better = candidate[3] < best[3]
        best = tuple(torch.where(better[:, :, None] if c.dim() == 3 else better, c, b)
                     for c, b in zip(candidate, best))
    q, scale, minimum, _ = best
    rows, qblocks, _ = blocks.shape
    q = q.view(rows // _BLOCK, 2, _BLOCK // 2, qblocks * Q // 4, 4)  # (nb, half, c, g, k % 4)
    q = q.permute(0, 3, 1, 2, 4).reshape(rows // _BLOCK, qblocks * Q // 4, 2, 32)
    packed = q[:, :, 0] | (q[:, :, 1] << 4)
    return packed.contiguous(), _per_block(scale), _per_block(minimum)


def _fit_q4(blocks, scale, minimum):
    """(q, scale, minimum, squared error per block) of `blocks` rounded against fp16 (scale, min)."""
    s = scale.float().clamp(min=torch.finfo(torch.float16).tiny)[:, :, None]
    q = torch.round((blocks - minimum.float()[:, :, None]) / s).clamp_(0, 15)
    error = ((q * s + minimum.float()[:, :, None] - blocks) ** 2).sum(2)
    return q.to(torch.uint8), scale, minimum, error


def unpack_weight_q4(packed: torch.Tensor) -> torch.Tensor:
    """The padded (Np, Kp) uint8 matrix of 4-bit values of a packed q4 weight."""
    nb, groups, _ = packed.shape
    halves = torch.stack((packed & 15, packed >> 4), dim=2)  # (nb, g, half, 32)
    q = halves.view(nb, groups, 2, _BLOCK // 2, 4).permute(0, 2, 3, 1, 4)  # (nb, half, c, g, k % 4)
    return q.reshape(nb * _BLOCK, groups * 4)


def dequantize_q4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The padded (Np, Kp) float weight that packed q4 values stand for."""
    q = unpack_weight_q4(packed).float()
    rows, cols = q.shape
    blocks = q.view(rows, cols // Q, Q) * unpack_blocks(scale).float()[:, :, None]
    return (blocks + unpack_blocks(minimum).float()[:, :, None]).view(rows, cols)


def _quantize_rows(x: torch.Tensor, cols: int, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, k) -> values in [-levels, levels] as float (m, Kp / 32, 32) and block scales
    (m, Kp / 32), as the kernels do."""
    xb = torch.nn.functional.pad(x.float(), (0, cols - x.shape[1])).view(x.shape[0], cols // Q, Q)
    absmax = xb.abs().amax(dim=2)
    inv = torch.where(absmax > 0, levels / absmax, torch.zeros_like(absmax))
    return torch.round(xb * inv[:, :, None]).clamp_(-levels, levels), absmax / levels


class QuantizedLinear(nn.Module):
    """A linear layer over packed quantized weights; takes and returns the activation dtype.
    Subclasses name their buffers (`_buffers_of_kernel`, in the kernel's argument order),
    the extension function, and the reference arithmetic."""

    kernel: str
    _buffers_of_kernel: tuple[str, ...]
    x_levels = 127  # activations quantized to [-127, 127]; Int8Linear may take 63

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.isa = None  # None: the best this CPU runs; tests pin a path (kernels.ISA_NAMES)
        # The LM head writes its (rows, vocab) logits into one reused buffer: a fresh
        # allocation of that size costs page faults every step (15 ms at 64 x 262k).
        # Its output is then only valid until the next call.
        self.reuse_output = False
        self._out = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "QuantizedLinear":
        return cls.from_weight(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "QuantizedLinear":
        """The layer of float `weight` (out, in) quantized, and `bias`."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None)
        # In pieces of rows (each row is quantized alone), so the float temporaries of
        # packing are a piece's, not a whole (say 28672 x 4096) matrix's several times over.
        pieces = [cls.pack(rows) for rows in weight.split(_PACK_ROWS)]
        for i, name in enumerate(layer._buffers_of_kernel):
            setattr(layer, name, torch.cat([piece[i] for piece in pieces]) if len(pieces) > 1 else pieces[0][i])
        if bias is not None:
            layer.bias = bias.float().clone()
        return layer

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        object.__setattr__(self, "_call", None)  # a buffer or the isa changed: bind again

    def _apply(self, *args, **kwargs):
        object.__setattr__(self, "_call", None)  # .to() and friends replace the buffers
        return super()._apply(*args, **kwargs)

    def _kernel(self, suffix: str = ""):
        """(the extension's function `kernel + suffix`, its arguments after x: weights,
        bias, out_features, code path, options), or None without it."""
        ext = kernels.q4_extension() if self.kernel == "q4_linear" else kernels.int8_extension()
        name = self.kernel + suffix
        if ext is None or (suffix and not hasattr(ext, name)):
            return None  # (no extension, or a variant this kernel lacks)
        function = getattr(ext, name)
        isa = ext.best_isa() if self.isa is None else self.isa
        bias = self.bias if self.bias is not None else _EMPTY
        weights = [getattr(self, name) for name in self._buffers_of_kernel]
        return function, (*weights, bias, self.out_features, isa, *self._kernel_options())

    def _bind(self):
        """The function of one (rows, in_features) float32 input and an output buffer that
        runs this layer: the kernel with its weights, bias and code path bound (a batch-1
        step makes ~70 of these calls, so looking each of them up every time counts)."""
        bound = self._kernel()
        if bound is None:
            call = lambda flat, out, activation: self.reference(flat, activation)  # noqa: E731
        else:
            kernel, args = bound

            def call(flat, out, activation):
                return kernel(flat, *args, FUSED_ACTIVATIONS.get(activation, 0), out)
        object.__setattr__(self, "_call", call)
        return call

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """`self(x).argmax(-1)`, int64, without the outputs ever being written: the kernel
        keeps each output tile's largest value per row (the same floats, so the same index,
        the first of equal values). Greedy decoding through an LM head, whose outputs are
        1 MiB a row for a 262k vocabulary. None where the kernel has no such call, or
        without the compiled kernels."""
        bound = self._kernel("_argmax")
        if bound is None:
            return None
        kernel, args = bound
        return kernel(x.reshape(-1, self.in_features).float(), *args).view(x.shape[:-1])

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x @ W^T + bias, then `activation` (an ACTIVATIONS name) when given: inside the
        kernel when it is one of FUSED_ACTIVATIONS, else after it."""
        call = self._call or self._bind()
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        fused = activation if activation in FUSED_ACTIVATIONS else None
        out = call(flat, self._output(flat.shape[0]) if self.reuse_output else _EMPTY, fused)
        if activation is not None and fused is None:
            out = ACTIVATIONS[activation](out)
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def reference(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """The kernel's arithmetic in plain torch (same rounding, same int32 block sums,
        float accumulation in another order; torch's `activation`): the fallback without
        a compiler, and the reference the kernel is tested against."""
        if x.shape[0] > 16:  # bound the (rows, out, blocks) float64 intermediate
            return torch.cat([self.reference(part, activation) for part in x.split(16)])
        rows, cols = _padded(self.out_features, self.in_features)
        xq, xs = _quantize_rows(x, cols, self.x_levels)
        w = self.unpacked().view(rows, cols // Q, Q)
        sums = torch.einsum("mbq,nbq->mnb", xq.double(), w.double())  # exact integers
        out = self._combine(sums, xq, xs.double()).sum(dim=2).float()[:, :self.out_features]
        out = out if self.bias is None else out + self.bias
        return out if activation is None else ACTIVATIONS[activation](out)

    def _kernel_options(self) -> tuple:
        """The kernel's arguments between the code path and the activation."""
        return ()

    def _output(self, rows: int) -> torch.Tensor:
        if self._out is None or self._out.shape[0] < rows:
            self._out = torch.empty(rows, self.out_features)
        return self._out[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantizedLinear):
    """`x_levels` is how finely the activations are quantized: 127 (int8), or 63 (7 bits),
    which the AVX2 kernel multiplies without the sign trick (docs/performance.md,
    "Embeddings"): what an encoder's layers use, whose calls are thousands of rows."""

    kernel = "int8_linear"
    _buffers_of_kernel = ("qweight", "scale", "qsum")
    pack = staticmethod(quantize_weight)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias)
        rows, cols = _padded(out_features, in_features)
        self.register_buffer("qweight", torch.zeros(rows // _BLOCK, cols // 4, _BLOCK, 4, dtype=torch.int8))
        self.register_buffer("scale", torch.zeros(rows // _BLOCK, cols // Q, _BLOCK, dtype=torch.float16))
        self.register_buffer("qsum", torch.zeros(rows // _BLOCK, cols // Q, _BLOCK, dtype=torch.int16))

    def unpacked(self) -> torch.Tensor:
        return unpack_weight(self.qweight)

    def _kernel_options(self) -> tuple:
        return (self.x_levels,)

    def _combine(self, sums, xq, xs):
        # sums, result: (m, n, blocks)
        return sums * xs[:, None, :] * unpack_blocks(self.scale).double()[None]


class Q4Linear(QuantizedLinear):
    kernel = "q4_linear"
    _buffers_of_kernel = ("qweight", "scale", "qmin")
    pack = staticmethod(quantize_weight_q4)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias)
        rows, cols = _padded(out_features, in_features)
        self.register_buffer("qweight", torch.zeros(rows // _BLOCK, cols // 4, 32, dtype=torch.uint8))
        self.register_buffer("scale", torch.zeros(rows // _BLOCK, cols // Q, _BLOCK, dtype=torch.float16))
        self.register_buffer("qmin", torch.zeros(rows // _BLOCK, cols // Q, _BLOCK, dtype=torch.float16))

    def unpacked(self) -> torch.Tensor:
        return unpack_weight_q4(self.qweight)

    def _combine(self, sums, xq, xs):
        # w = scale * q + min, so a block adds x_scale * (scale * sum(q x_q) + min * sum(x_q)).
        scale = unpack_blocks(self.scale).double()[None]
        minimum = unpack_blocks(self.qmin).double()[None]
        x_sums = xq.double().sum(dim=2)[:, None, :]
        return xs[:, None, :] * (sums * scale + minimum * x_sums)


LAYERS = {"int8": Int8Linear, "q4": Q4Linear}


class Int8Embedding(nn.Module):
    """Token embeddings read from the int8 LM head they are tied to: token t's embedding
    is row t of the head's weight, so the float table (vocab x hidden float32: 671 MB of
    Gemma 3 270M's ~1 GB) need not be kept at all. A GGUF's Q8_0 table comes back exactly
    (same int8 values, same fp16 scales); a float checkpoint's, as the head sees it."""

    def __init__(self, head: Int8Linear):
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule: the model owns it as lm_head
        self.embedding_dim = head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        block, channel = flat // _BLOCK, flat % _BLOCK
        q = self.head.qweight[block, :, channel]  # (n, Kp / 4, 4)
        scale = self.head.scale[block, :, channel]  # (n, Kp / 32)
        rows = q.view(flat.shape[0], -1, Q).float() * scale.float()[:, :, None]
        return rows.view(*ids.shape, -1)[..., :self.embedding_dim]

    def extra_repr(self) -> str:
        return f"{self.head.out_features}, {self.embedding_dim}, from the int8 LM head"

