"""Projections that read the same input, fused into one matmul (q/k/v, gate/up)."""

from __future__ import annotations

import torch
from torch import nn

QKV = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"))


def project(module: nn.Module, x: torch.Tensor, fused: str, parts: tuple[str, ...]) -> list[torch.Tensor]:
    """The outputs of `module`'s projections `parts` (e.g. q_proj, k_proj, v_proj) of x:
    one matmul when they were fused into `fused` (see fuse_projections), else one each."""
    layer = getattr(module, fused, None)
    if layer is None:
        return [getattr(module, name)(x) for name in parts]
    return list(layer(x).split(layer.split_sizes, dim=-1))


def fuse_projections(model: nn.Module) -> None:
    """Concatenate q/k/v and gate/up projections that read the same input into one layer
    each (`project` splits the output again): fewer, larger matmuls, and a quantized
    input is quantized once instead of three times. Each output channel is still its own
    dot product of the same numbers."""
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
            layer.weight = _cat([lin.weight for lin in linears])
            if layer.bias is not None:
                layer.bias = _cat([lin.bias for lin in linears])
            for name in parts:
                delattr(module, name)
            setattr(module, fused, layer)
            layer.split_sizes = [lin.out_features for lin in linears]
            layer.part_names = parts  # (what the checkpoint calls its parts: model/cpu/quant.py)


def _cat(tensors: list[torch.Tensor]) -> nn.Parameter:
    """The parameters stacked by rows, as one parameter."""
    if tensors[0].is_meta:  # a model built to be filled from a cache: only the shape counts
        # (torch.cat of meta tensors runs a Python reference that imports torch._dynamo: 2 s)
        return nn.Parameter(torch.empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), device="meta",
                                        dtype=tensors[0].dtype), requires_grad=False)
    return nn.Parameter(torch.cat([t.detach() for t in tensors]), requires_grad=False)


def head_argmax(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """`head(hidden).argmax(-1)` where the head gives it without writing its outputs (a
    quantized LM head on CPU: `QuantizedLinear.argmax`), else None."""
    argmax = getattr(head, "argmax", None)
    return None if argmax is None else argmax(hidden)
