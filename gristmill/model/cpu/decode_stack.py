"""A model's decoder layers as one C++ call (csrc/decode_stack.cpp), for CPU steps where
every token is a decode: the same ops the layers' forward runs, without the Python
between them, which at batch 1 costs as much as the matmuls of a small model."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.cpu import kernels

_EMPTY = torch.empty(0)
_NO_ROWS = torch.empty(0, dtype=torch.int64)
_STACK_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


def _slot(linear) -> list[torch.Tensor]:
    """A linear's four tensors in the stack (csrc/decode_stack.cpp): its kernel's weights
    (a GGUF layer's layout, then two empty), then its bias."""
    if linear.kernel == "gguf_linear":
        weights = [linear.layout, _EMPTY, _EMPTY]
    else:
        weights = [getattr(linear, name) for name in linear._buffers_of_kernel]
    return weights + [linear.bias.float() if linear.bias is not None else _EMPTY]


class DecodeStack:
    """Applies where activations are float32 and q/k/v and gate/up are fused into int8,
    q4 or GGUF layers (as quantization and the GGUF loader make them; one layer's linears
    may be of different kinds). Each decoder layer names its norms with
    `stack_norms()`: (in, attn_out, mlp_in, mlp_out), None for those its family lacks."""

    def __init__(self, layers: nn.ModuleList):
        from gristmill.model.cpu import qlinear
        from gristmill.model.cpu.gguf_linear import GGUFLinear

        kinds = {qlinear.Int8Linear: 1, qlinear.Q4Linear: 2, GGUFLinear: 3}
        q4 = any(isinstance(m, qlinear.Q4Linear) for layer in layers for m in layer.modules())
        self.ops = ext = kernels.q4_extension() if q4 else kernels.int8_extension()
        if ext is None:
            raise ValueError("the decode stack needs the compiled kernels")
        tensors, ints, scales = [], [], []
        #: Each linear's LoRA site tensors and split points (see csrc/decode_stack.cpp).
        lora, lora_bounds, sites = [], [], []
        first = layers[0]
        for layer in layers:
            attn_module, mlp = layer.self_attn, layer.mlp
            linears = [getattr(attn_module, "qkv_proj", None), getattr(attn_module, "o_proj", None),
                       getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)]
            if any(type(lin) not in kinds for lin in linears) or mlp.activation not in _STACK_ACTIVATIONS:
                raise ValueError("the decode stack needs fused int8, q4 or GGUF projections")
            norms = list(layer.stack_norms()) + [getattr(attn_module, "q_norm", None),
                                                 getattr(attn_module, "k_norm", None)]
            tensors += [n.float_weight() if n is not None else _EMPTY for n in norms]
            for lin in linears:
                tensors += _slot(lin)
                site = getattr(lin, "lora_site", None)
                sites.append(site)
                lora += [_EMPTY] * 3 if site is None else [site.a, site.b, site.parts_used]
                lora_bounds += [0] if site is None else [len(site.split_points), *site.split_points]
            rotary, attn = attn_module.rotary, attn_module.attn
            tensors += [rotary.cos, rotary.sin, attn.k_cache, attn.v_cache]
            isa = {lin.isa for lin in linears} - {None}
            ints += [kinds[type(lin)] for lin in linears] + [lin.out_features for lin in linears]
            ints += [attn.sliding_window or 0, isa.pop() if isa else ext.best_isa()]
            scales.append(attn.scale)
        norm = first.stack_norms()[0]
        attn = first.self_attn
        self.args = (tensors, ints, scales, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                     _STACK_ACTIVATIONS[first.mlp.activation], norm.offset, norm.eps, lora, lora_bounds)
        #: It runs steps with adapter rows too: every LoRA site's update is the kernels'
        #: (float32 slots on CPU); else such steps run layer by layer, through the hooks.
        self.runs_lora = any(sites) and all(site.in_kernels for site in sites if site is not None)

    @staticmethod
    def key_of(layers: nn.ModuleList) -> tuple:
        # What quantizing the model, reallocating the KV cache or adding LoRA slots
        # replaces (compared by identity).
        attn = layers[0].self_attn
        qkv = getattr(attn, "qkv_proj", None)
        return qkv, attn.attn.k_cache, layers[-1].self_attn.attn.k_cache, getattr(qkv, "lora_site", None)

    @classmethod
    def of(cls, layers: nn.ModuleList) -> "DecodeStack | None":
        """The stack of these layers, or None where they must run one by one (float
        projections, an unsupported activation, no quantized-linear extension)."""
        if kernels.int8_extension() is None:
            return None
        key = cls.key_of(layers)
        cached = layers.__dict__.get("_decode_stack")
        if cached is not None and all(old is new for old, new in zip(cached[0], key)):
            return cached[1]
        try:
            stack = cls(layers)
        except ValueError:
            stack = None
        layers.__dict__["_decode_stack"] = (key, stack)
        return stack

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, md) -> torch.Tensor:
        lora = md.lora
        rows = (_NO_ROWS,) * 3 if lora is None else (lora.rows, lora.group_slots, lora.group_starts)
        return self.ops.decode_stack(x, positions, md.slot_mapping, md.decode_block_tables,
                                     md.decode_context_lens, *self.args, *rows)
