"""Linear layers and embeddings over a GGUF file's quantized blocks, as they lie in it.

`GGUFLinear` hands each matrix's blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K), straight
from the mapped file, to a kernel that multiplies by them in their own format
(`csrc/gguf_linear.cpp`): the weights it multiplies by are `gguf.dequantize`'s, and the
only rounding is of the activations (per row, in blocks of 32, to int8, as the other
quantized kernels do). Nothing is converted or copied: a GGUF model takes the file's
bytes, not 4x that as float32.

A layer is one or more *parts* stacked along the output dimension (a fused q/k/v or
gate/up projection; Q4_K_M files mix Q4_K and Q6_K parts in one layer). The layer keeps
the parts' tensors, so the kernel's pointers into them stay valid.

Many activation rows meet a matrix's weights laid out afresh as *panels* (the same codes
and float scales, in the order the vector units take them). The kernel packs a tile's
panels at each call; `pack_panels` packs a layer's once, where memory allows (the loader
decides: `gristmill.model.cpu.quant`), and the kernel reads those instead: from 4 rows,
and for Q8_0 (whose panels are its bytes' size) at every row count, so that the file's
pages of it can go.

Without the compiled extension, each runs the same arithmetic in plain torch, with
`gguf`'s own dequantization.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
from torch import nn

from gristmill.model.cpu import kernels
from gristmill.model.cpu.qlinear import _EMPTY, QuantizedLinear, _quantize_rows
from gristmill.model.layers.mlp import ACTIVATIONS

# The block types the kernels multiply by as stored.
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"))
_DEQUANTIZE_ROWS = 4096  # rows a dequantization without the kernels takes at a time


def _checked_part(ggml_type, data: torch.Tensor, in_features: int) -> tuple[GGMLQuantizationType, torch.Tensor]:
    if not GGUFLinear.supports(ggml_type):
        raise ValueError(f"ggml type {ggml_type!r} is not one the GGUF kernels take ({_type_names()})")
    ggml_type = GGMLQuantizationType(int(ggml_type))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if in_features % block_size:
        raise ValueError(f"in_features {in_features} is not a multiple of {ggml_type.name}'s block of {block_size}")
    row_bytes = in_features // block_size * type_size
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes or data.device.type != "cpu":
        raise ValueError(f"a {ggml_type.name} part of {in_features} inputs must be a CPU uint8 tensor "
                         f"(rows, {row_bytes}), not {data.dtype} {tuple(data.shape)} on {data.device}")
    if data.shape[0] > 1 and data.stride() != (row_bytes, 1):
        raise ValueError(f"a {ggml_type.name} part's rows must lie one after another (strides {data.stride()})")
    return ggml_type, data


def _type_names() -> str:
    return ", ".join(sorted(t.name for t in SUPPORTED_TYPES))


def _layout(parts: list[tuple[int, ...]]) -> torch.Tensor:
    """The kernels' int64 layout: [ggml_type, rows, data_ptr] per part, (P, 3); or (P, 5)
    with [panels_ptr, panels_isa] after them."""
    return torch.tensor(parts, dtype=torch.int64).view(len(parts), -1)


class GGUFLinear(QuantizedLinear):
    """y = x @ W^T + bias with W the stacked `parts`: (ggml type, (rows, bytes a row)
    uint8 blocks), read where they lie. `split_sizes` defaults to the parts' rows."""

    kernel = "gguf_linear"

    def __init__(self, parts: list[tuple[int | GGMLQuantizationType, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None = None):
        checked = tuple(_checked_part(t, data, in_features) for t, data in parts)
        if not checked:
            raise ValueError("a GGUF linear layer needs at least one part")
        out_features = sum(data.shape[0] for _, data in checked)
        super().__init__(in_features, out_features, bias is not None)
        if bias is not None:
            if bias.shape != (out_features,):
                raise ValueError(f"bias must have {out_features} values, not shape {tuple(bias.shape)}")
            self.bias = bias.detach().float().contiguous()
        self.parts = checked  # kept: the layout points into them
        self.panels = ()  # (pack_panels) each part's, and the code path they are for
        self.panels_isa = None
        self.layout = _layout([(int(t), data.shape[0], data.data_ptr()) for t, data in checked])
        rows = [data.shape[0] for _, data in checked]
        self.split_sizes = rows if len(checked) > 1 else None
        self._starts = torch.tensor([0] + rows[:-1]).cumsum(0)  # each part's first row

    @classmethod
    def supports(cls, ggml_type: int | GGMLQuantizationType) -> bool:
        """Whether the kernels multiply by blocks of this ggml type as they are."""
        return int(ggml_type) in SUPPORTED_TYPES

    def panel_bytes(self, isa: int | None = None, types=SUPPORTED_TYPES) -> list[int]:
        """The bytes `pack_panels` would take for each part (of `types`; others 0) on code
        path `isa` (None: the layer's); zeros where the path has no panels (portable) or
        the kernels are not built."""
        ext = kernels.int8_extension()
        if ext is None:
            return [0] * len(self.parts)
        isa = self._isa(ext) if isa is None else isa
        return [ext.gguf_panel_bytes(int(t), data.shape[0], self.in_features, isa) if t in types else 0
                for t, data in self.parts]

    def panels_replace_bytes(self, isa: int | None = None) -> list[bool]:
        """Whether each part's panels, once packed, are read at every row count (Q8_0's and
        Q4_0's, compact), so that its bytes are never read again."""
        ext = kernels.int8_extension()
        if ext is None:
            return [False] * len(self.parts)
        isa = self._isa(ext) if isa is None else isa
        return [ext.gguf_panels_from_rows(int(t), isa) == 1 for t, _ in self.parts]

    def pack_panels(self, isa: int | None = None, types=SUPPORTED_TYPES) -> int:
        """Pack the panels of each part of `types` once, for code path `isa` (None: the
        layer's), which the kernel then reads instead of packing them at every call (module
        docstring). The outputs stay the same floats. Returns the bytes they take (0: none
        packed, where the path has no panels). On another path the layer reads its bytes."""
        ext = kernels.int8_extension()
        if ext is None or not any(self.panel_bytes(isa, types)):
            return 0
        isa = self._isa(ext) if isa is None else isa
        panels = tuple(ext.gguf_pack_panels(data, int(t), self.in_features, isa) if t in types else None
                       for t, data in self.parts)
        self.panels, self.panels_isa = tuple(p for p in panels if p is not None), isa
        self.layout = _layout([(int(t), data.shape[0], data.data_ptr(), 0 if p is None else p.data_ptr(), isa)
                               for (t, data), p in zip(self.parts, panels)])
        return sum(p.numel() for p in self.panels)

    def _isa(self, ext) -> int:
        return ext.best_isa() if self.isa is None else self.isa

    def _kernel(self, suffix: str = ""):
        ext = kernels.int8_extension()
        if ext is None:
            return None
        bias = self.bias.float() if self.bias is not None else _EMPTY
        return getattr(ext, "gguf_linear" + suffix), (self.layout, bias, self.in_features, self._isa(ext))

    def dequantized(self) -> torch.Tensor:
        """(out_features, in_features) float32: gguf.dequantize of the parts, bit for bit,
        from the kernels' own decode."""
        return torch.cat([torch.empty(0, self.in_features)] + [w for _, w in self._dequantized_chunks()])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (1-D int) of `dequantized()`, reading only those rows' blocks."""
        ids = ids.reshape(-1).long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must lie in [0, {self.out_features})")
        starts = self._starts
        ext = kernels.int8_extension()
        if ext is None:
            part = torch.bucketize(ids, starts, right=True) - 1
            out = torch.empty(ids.numel(), self.in_features)
            for p, (ggml_type, data) in enumerate(self.parts):
                chosen = (part == p).nonzero().view(-1)
                if chosen.numel():
                    rows = data[ids[chosen] - starts[p]].numpy()
                    out[chosen] = torch.from_numpy(dequantize(rows, ggml_type))
            return out
        if len(self.parts) == 1:  # (a token embedding table: one part)
            ggml_type, data = self.parts[0]
            types, pointers = torch.full_like(ids, int(ggml_type)), ids * data.shape[1] + data.data_ptr()
        else:
            part = torch.bucketize(ids, starts, right=True) - 1
            row_bytes = torch.tensor([data.shape[1] for _, data in self.parts])
            types = self.layout[part, 0]
            pointers = self.layout[part, 2] + (ids - starts[part]) * row_bytes[part]
        layout = torch.stack([types, torch.ones_like(ids), pointers], dim=1)  # one part a row
        return ext.gguf_dequantize(layout.contiguous(), self.in_features)

    def _dequantized_chunks(self):
        """(first row, float32 rows) over the whole matrix, at most _DEQUANTIZE_ROWS at a time."""
        ext = kernels.int8_extension()
        start = 0
        for ggml_type, data in self.parts:
            for r0 in range(0, data.shape[0], _DEQUANTIZE_ROWS):
                rows = data[r0:r0 + _DEQUANTIZE_ROWS]
                if ext is not None:
                    w = ext.gguf_dequantize(_layout([(int(ggml_type), rows.shape[0], rows.data_ptr())]),
                                            self.in_features)
                else:
                    w = torch.from_numpy(np.ascontiguousarray(dequantize(rows.numpy(), ggml_type)))
                yield start + r0, w
            start += data.shape[0]

    def reference(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """The kernel's arithmetic in plain torch: x rounded as the kernel rounds it, times
        the dequantized weights, summed in float64. The fallback without a compiler, and
        what tests hold the kernel to."""
        k = self.in_features
        xq, xs = _quantize_rows(x, k)  # (m, K / 32, 32), (m, K / 32)
        x_rounded = (xq.double() * xs.double()[:, :, None]).view(x.shape[0], k)
        out = torch.empty(x.shape[0], self.out_features)
        for start, w in self._dequantized_chunks():
            out[:, start:start + w.shape[0]] = (x_rounded @ w.double().T).float()
        out = out if self.bias is None else out + self.bias.float()
        return out if activation is None else ACTIVATIONS[activation](out)

    def extra_repr(self) -> str:
        types = "+".join(f"{t.name}x{data.shape[0]}" for t, data in self.parts)
        panels = f", panels for {kernels.ISA_NAMES[self.panels_isa]}" if self.panels else ""
        return f"{super().extra_repr()}, blocks={types}{panels}"


class GGUFEmbedding(nn.Module):
    """Token embeddings read from a GGUFLinear's blocks (the LM head a table is tied to, or
    the table's own): token t's embedding is row t of its dequantized weight, equal to
    gguf.dequantize's; only the rows asked for are decoded."""

    def __init__(self, head: GGUFLinear):
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule: the model owns a tied head as lm_head
        self.embedding_dim = head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.dequantize_rows(ids).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.head.out_features}, {self.embedding_dim}, from GGUF blocks"
