"""The CPU backend: the compiled C++ ops (model/cpu/csrc) for float32 activations -
fused norms, residual adds and q/k/v preparation, paged decode attention, encoder
attention straight from the fused q/k/v, an encoder's residual + LayerNorm and GELU
(inside the quantized linears' kernels, or in place after a float one), and the decode
stack that runs a decode-only step's layers in one call. Prefill attention is SDPA. With other dtypes, or without a
compiler (GRISTMILL_KERNELS=0), it is the torch reference."""

from __future__ import annotations

import torch

from gristmill.model.backends.reference import Backend
from gristmill.model.context import get_metadata
from gristmill.model.cpu import kernels
from gristmill.model.cpu.qlinear import QuantizedLinear
from gristmill.model.cpu.decode_stack import DecodeStack
from gristmill.model.layers.linear import QKV, project
from gristmill.model.layers.mlp import ACTIVATIONS

_EMPTY = torch.empty(0)


def _or_empty(weight: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if weight is None else weight


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, device="cpu", dtype: torch.dtype = torch.float32):
        super().__init__(device, dtype)
        #: the compiled extension, or None: the reference arithmetic then runs
        self.ops = kernels.fused_ops() if dtype == torch.float32 else None

    def _ops_for(self, x: torch.Tensor):
        return self.ops if x.dtype == torch.float32 else None

    def rms_norm(self, x, norm):
        ops = self._ops_for(x)
        if ops is None:
            return super().rms_norm(x, norm)
        return ops.rms_norm(x, norm.float_weight(), norm.offset, norm.eps)

    def residual_norm(self, x, delta, delta_norm, out_norm):
        ops = self._ops_for(x)
        if ops is None or (delta_norm and out_norm
                           and (delta_norm.offset, delta_norm.eps) != (out_norm.offset, out_norm.eps)):
            return super().residual_norm(x, delta, delta_norm, out_norm)  # the fused op takes one offset and eps
        norm = delta_norm or out_norm
        x, h = ops.residual_norm(x, delta, delta_norm.float_weight() if delta_norm else _EMPTY,
                                 out_norm.float_weight() if out_norm else _EMPTY,
                                 norm.offset if norm else 0.0, norm.eps if norm else 0.0)
        return x, h if out_norm else None

    def add_layer_norm(self, x, delta, norm):
        ops = self._ops_for(x)
        if ops is None or (delta is not None and delta.dtype != x.dtype):
            return super().add_layer_norm(x, delta, norm)
        return ops.add_layer_norm_(x, _EMPTY if delta is None else delta, _or_empty(norm.weight),
                                   _or_empty(norm.bias), norm.eps)  # over delta

    def linear_activation(self, linear, x, activation):
        if isinstance(linear, QuantizedLinear):
            return linear(x, activation)  # GELU in the kernel
        out = linear(x)
        if activation == "gelu" and self._ops_for(out) is not None:
            return self.ops.gelu_(out.contiguous())  # (a float linear's output is its own: in place)
        return ACTIVATIONS[activation](out)

    def attention_inputs(self, module, positions, x, q_norm, k_norm):
        ops = self._ops_for(x)
        if ops is None:
            return super().attention_inputs(module, positions, x, q_norm, k_norm)
        q, k, v = project(module, x, *QKV)
        has_norm = q_norm is not None
        return ops.qkv_rotary(q, k, v, module.num_heads, module.num_kv_heads, module.head_dim,
                              q_norm.float_weight() if has_norm else _EMPTY,
                              k_norm.float_weight() if has_norm else _EMPTY,
                              q_norm.offset if has_norm else 0.0, q_norm.eps if has_norm else 0.0,
                              module.rotary.cos, module.rotary.sin, positions)

    def decode_attention(self, layer, q, md):
        if self._ops_for(q) is None:
            return super().decode_attention(layer, q, md)
        return self.ops.paged_decode_attention(q, layer.k_cache, layer.v_cache, md.decode_block_tables,
                                               md.decode_context_lens, layer.scale, layer.sliding_window or 0, -1)

    def encoder_attention(self, layer, q, k, v, md):
        if self._ops_for(q) is None:
            return super().encoder_attention(layer, q, k, v, md)
        return self.ops.encoder_attention(q, k, v, md.query_start_host, layer.scale)

    def run_layers(self, layers, positions, x):
        md = get_metadata()
        stack = None
        if self._ops_for(x) is not None and md.num_decodes == x.shape[0] == md.num_seqs:
            stack = DecodeStack.of(layers)
            if stack is not None and md.lora is not None and not stack.runs_lora:
                stack = None  # (adapter rows whose update only the layers' hooks make)
        if stack is None:
            return super().run_layers(layers, positions, x)
        return stack(positions, x, md)
