"""Building blocks shared by the model families: norms, rotary, paged attention, MLP."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from torch import nn

from gristmill.model import kernels
from gristmill.model.context import get_context
from gristmill.model.kernels import paged_decode_attention

_EMPTY = torch.empty(0)


def cpu_ops(x: torch.Tensor, fused: bool = True):
    """The fused-op extension (csrc/fused_ops.cpp) when x can use it (CPU, float32) and
    `fused`, else None: callers then spell the same arithmetic out in torch (the
    reference the fused ops are tested against)."""
    if not fused or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return kernels.fused_ops()


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + weight), the others by weight."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def float_weight(self) -> torch.Tensor:
        """The weight as the fused ops take it: float32, contiguous (it already is, in a
        float32 model)."""
        weight = self._parameters["weight"]
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            weight = weight.float().contiguous()
        return weight

    def forward(self, x: torch.Tensor, fused: bool = True) -> torch.Tensor:
        ops = cpu_ops(x, fused)
        if ops is not None:
            return ops.rms_norm(x, self.float_weight(), self.offset, self.eps)
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies of rotary embedding from HF `rope_parameters`
    (`rope_theta`, `rope_type` and its fields), with llama3 / linear scaling applied."""
    base = params.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(in_band, blended, scaled)
    elif rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported (default, linear, llama3 are)")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding over a cos/sin table computed once for all positions."""

    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        self.head_dim, self.max_positions, self.params = head_dim, max_positions, params
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        if self.cos.device.type != "meta":
            self.reset()

    def reset(self) -> None:
        """(Re)compute the tables, e.g. after the model was built on the meta device."""
        inv_freq = rope_inv_freq(self.head_dim, self.params)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos = freqs.cos().to(self.cos.device)  # (max_positions, head_dim / 2)
        self.sin = freqs.sin().to(self.sin.device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, num_heads, head_dim)
        cos = self.cos[positions].to(x.dtype)[:, None, :]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


_ROTARY_CACHE: dict = {}


def shared_rotary(head_dim: int, max_positions: int, params: dict) -> RotaryEmbedding:
    """One rotary table per distinct setting, shared by every layer that uses it."""
    key = (head_dim, max_positions, json.dumps(params, sort_keys=True, default=str))
    rotary = _ROTARY_CACHE.get(key)
    if rotary is None:
        rotary = _ROTARY_CACHE[key] = RotaryEmbedding(head_dim, max_positions, params)
    return rotary


def clear_rotary_cache() -> None:
    _ROTARY_CACHE.clear()


class PagedAttention(nn.Module):
    """Writes this step's keys and values into the paged cache and attends over it.

    `k_cache` / `v_cache` are this layer's views of the one KV allocation, each
    (num_blocks, block_size, num_kv_heads, head_dim), set by the model runner.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim)
        ctx = get_context()
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, ctx.slot_mapping, k)
        flat_v.index_copy_(0, ctx.slot_mapping, v)

        out = torch.empty_like(q)
        if ctx.num_decodes:
            out[:ctx.num_decodes] = self._decode(q[:ctx.num_decodes], ctx)
        for chunk in ctx.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, chunk)
        return out

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        # block_tables: (batch, max_blocks) -> (batch, num_kv_heads, max_blocks * block_size, head_dim)
        batch = block_tables.shape[0]
        return cache[block_tables].view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _decode(self, q: torch.Tensor, ctx) -> torch.Tensor:
        kernel = paged_decode_attention() if q.device.type == "cpu" and q.dtype == torch.float32 else None
        if kernel is not None:
            return kernel(q, self.k_cache, self.v_cache, ctx.decode_block_tables,
                          ctx.decode_context_lens, self.scale, self.sliding_window or 0)
        return self.decode_reference(q, ctx)

    def decode_reference(self, q: torch.Tensor, ctx) -> torch.Tensor:
        """Pure-torch decode: gather each sequence's keys and values, then SDPA."""
        keys = self._gather(self.k_cache, ctx.decode_block_tables)
        values = self._gather(self.v_cache, ctx.decode_block_tables)
        mask = ctx.decode_mask(self.sliding_window)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask,
                                             scale=self.scale, enable_gqa=True)
        return out[:, :, 0, :]  # (num_decodes, num_heads, head_dim)

    def _prefill(self, q, k, v, chunk) -> torch.Tensor:
        num_new = chunk.end - chunk.start
        query = q[chunk.start:chunk.end].transpose(0, 1)[None]  # (1, num_heads, num_new, head_dim)
        if chunk.has_prior_context:
            table = chunk.block_table[None]
            keys = self._gather(self.k_cache, table)[:, :, :chunk.context_len]
            values = self._gather(self.v_cache, table)[:, :, :chunk.context_len]
        else:
            keys = k[chunk.start:chunk.end].transpose(0, 1)[None]
            values = v[chunk.start:chunk.end].transpose(0, 1)[None]
        first_pos = chunk.context_len - num_new
        window = self.sliding_window
        if chunk.has_prior_context or (window is not None and chunk.context_len > window):
            q_pos = torch.arange(first_pos, chunk.context_len, device=q.device)[:, None]
            k_pos = torch.arange(chunk.context_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                 scale=self.scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                 scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)  # (num_new, num_heads, head_dim)


def residual_norm(x: torch.Tensor, delta: torch.Tensor, delta_norm: RMSNorm | None,
                  out_norm: RMSNorm | None, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream around a sublayer: x + delta_norm(delta) (x + delta without a
    delta_norm), and out_norm of that, the next sublayer's input (None without out_norm)."""
    ops = cpu_ops(x, fused)
    if delta_norm and out_norm and (delta_norm.offset, delta_norm.eps) != (out_norm.offset, out_norm.eps):
        ops = None  # the fused op takes one offset and eps for both
    if ops is not None:
        norm = delta_norm or out_norm
        x, h = ops.residual_norm(x, delta, delta_norm.float_weight() if delta_norm else _EMPTY,
                                 out_norm.float_weight() if out_norm else _EMPTY,
                                 norm.offset if norm else 0.0, norm.eps if norm else 0.0)
        return x, h if out_norm else None
    x = x + (delta_norm(delta, fused=False) if delta_norm else delta)
    return x, out_norm(x, fused=False) if out_norm else None


def attention_inputs(module: nn.Module, positions: torch.Tensor, x: torch.Tensor,
                     q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, fused: bool = True):
    """q (n, num_heads, head_dim), k and v (n, num_kv_heads, head_dim) of an attention
    module (num_heads, num_kv_heads, head_dim, rotary, q/k/v projections): projected,
    q and k normed per head when the family does, rotated."""
    n, heads, kv_heads, dim = x.shape[0], module.num_heads, module.num_kv_heads, module.head_dim
    q, k, v = project(module, x, *QKV)
    ops = cpu_ops(q, fused)
    if ops is not None:
        has_norm = q_norm is not None
        return ops.qkv_rotary(q, k, v, heads, kv_heads, dim,
                              q_norm.float_weight() if has_norm else _EMPTY,
                              k_norm.float_weight() if has_norm else _EMPTY,
                              q_norm.offset if has_norm else 0.0, q_norm.eps if has_norm else 0.0,
                              module.rotary.cos, module.rotary.sin, positions)
    q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
    if q_norm is not None:
        q, k = q_norm(q, fused=False), k_norm(k, fused=False)
    return module.rotary(positions, q), module.rotary(positions, k), v


def project(module: nn.Module, x: torch.Tensor, fused: str, parts: tuple[str, ...]) -> list[torch.Tensor]:
    """The outputs of `module`'s projections `parts` (e.g. q_proj, k_proj, v_proj) of x:
    one matmul when they were fused into `fused` (see quant.fuse_projections), else one each."""
    layer = getattr(module, fused, None)
    if layer is None:
        return [getattr(module, name)(x) for name in parts]
    return list(layer(x).split(layer.split_sizes, dim=-1))


QKV = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"))


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported ({sorted(ACTIVATIONS)} are)")
        self.activation = activation
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, x, *GATE_UP)
        return self.down_proj(self.act(gate) * up)


_STACK_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


class DecodeStack:
    """A model's decoder layers as one C++ call (csrc/decode_stack.cpp), for steps where
    every token is a decode: the same ops the layers' forward runs, without the Python
    between them, which at batch 1 costs as much as the matmuls of a small model.

    Used only where it applies: CPU float32 activations, q/k/v and gate/up fused into
    int8 or q4 layers (as quantization makes them), and no prefill in the step. Each
    decoder layer names its norms with `stack_norms()`: (in, attn_out, mlp_in, mlp_out),
    None for those its family lacks."""

    def __init__(self, layers: nn.ModuleList):
        from gristmill.model import qlinear

        kinds = {qlinear.Int8Linear: 1, qlinear.Q4Linear: 2}
        ext = kernels.int8_extension()
        tensors, ints, scales = [], [], []
        first = layers[0]
        for layer in layers:
            attn_module, mlp = layer.self_attn, layer.mlp
            linears = [getattr(attn_module, "qkv_proj", None), getattr(attn_module, "o_proj", None),
                       getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)]
            if any(type(lin) not in kinds for lin in linears) or mlp.activation not in _STACK_ACTIVATIONS:
                raise ValueError("the decode stack needs fused int8 or q4 projections")
            norms = list(layer.stack_norms()) + [getattr(attn_module, "q_norm", None),
                                                 getattr(attn_module, "k_norm", None)]
            tensors += [n.float_weight() if n is not None else _EMPTY for n in norms]
            for lin in linears:
                tensors += [getattr(lin, name) for name in lin._buffers_of_kernel]
                tensors.append(lin.bias if lin.bias is not None else _EMPTY)
            rotary, attn = attn_module.rotary, attn_module.attn
            tensors += [rotary.cos, rotary.sin, attn.k_cache, attn.v_cache]
            isa = {lin.isa for lin in linears} - {None}
            ints += [kinds[type(lin)] for lin in linears] + [lin.out_features for lin in linears]
            ints += [attn.sliding_window or 0, isa.pop() if isa else ext.best_isa()]
            scales.append(attn.scale)
        norm = first.stack_norms()[0]
        attn = first.self_attn
        self.args = (tensors, ints, scales, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                     _STACK_ACTIVATIONS[first.mlp.activation], norm.offset, norm.eps)

    @staticmethod
    def key_of(layers: nn.ModuleList) -> tuple:
        # What quantizing the model or reallocating the KV cache replaces (compared by identity).
        attn = layers[0].self_attn
        return getattr(attn, "qkv_proj", None), attn.attn.k_cache, layers[-1].self_attn.attn.k_cache

    @classmethod
    def of(cls, layers: nn.ModuleList, x: torch.Tensor) -> "DecodeStack | None":
        """The stack for this step, or None where the layers must run one by one."""
        ctx = get_context()
        if ctx is None or ctx.prefills or ctx.num_decodes != x.shape[0] or cpu_ops(x) is None \
                or kernels.int8_extension() is None:
            return None
        key = cls.key_of(layers)
        cached = layers.__dict__.get("_decode_stack")
        if cached is not None and all(old is new for old, new in zip(cached[0], key)):
            return cached[1]
        try:
            stack = cls(layers)
        except ValueError:  # float projections, an unsupported activation: the layers run one by one
            stack = None
        layers.__dict__["_decode_stack"] = (key, stack)
        return stack

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        return kernels.fused_ops().decode_stack(x, positions, ctx.slot_mapping, ctx.decode_block_tables,
                                                ctx.decode_context_lens, *self.args)


def run_layers(layers: nn.ModuleList, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x through every decoder layer: in one C++ call when the step allows it (see
    DecodeStack), else one layer after another."""
    stack = DecodeStack.of(layers, x)
    if stack is not None:
        return stack(positions, x)
    for layer in layers:
        x = layer(positions, x)
    return x
