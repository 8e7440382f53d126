"""The CPU backend: the compiled C++ ops (model/cpu/csrc) for float32 activations -
fused norms, residual adds and q/k/v preparation, paged decode attention, encoder
attention straight from the fused q/k/v, an encoder's residual + LayerNorm and GELU
(inside the quantized linears' kernels, or in place after a float one), and the decode
stack that runs a decode-only step's layers in one call. Prefill attention is matrix
products over chunks of queries where those pay (`chunked_attention`), else SDPA; so is
a long sequence's windowed bidirectional attention (EmbeddingGemma).
With other dtypes, or without a compiler (GRISTMILL_KERNELS=0), it is the torch reference."""

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

    def prefill_attention(self, layer, q, k, v, context_len, table, block_size):
        prior = context_len - q.shape[0]
        if not _chunks_pay(layer, q, context_len):
            return super().prefill_attention(layer, q, k, v, context_len, table, block_size)
        if prior:  # the sequence's keys and values so far, this step's written already
            flat = (layer.num_kv_heads, layer.head_dim)
            k = layer.k_cache[table].view(-1, *flat)[:context_len].to(q.dtype)
            v = layer.v_cache[table].view(-1, *flat)[:context_len].to(q.dtype)
        return chunked_attention(q, k, v, layer.scale, prior, layer.sliding_window)

    def bidirectional_sequence(self, layer, q, k, v):
        window = layer.sliding_window
        if q.dtype != torch.float32 or window is None or q.shape[0] <= window + _CHUNK:
            return super().bidirectional_sequence(layer, q, k, v)
        return chunked_attention(q, k, v, layer.scale, 0, window, causal=False)

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


# Queries a chunk of `chunked_attention`, and the most scores one may hold.
_CHUNK = 64
_CHUNK_SCORES = 1 << 20
# [query, _, key] of a chunk: the key comes after the query (the causal edge's triangle).
_LATER = torch.ones(_CHUNK, _CHUNK, dtype=torch.bool).triu_(1)[:, None]


def _chunks_pay(layer, q: torch.Tensor, context_len: int) -> bool:
    """Where chunks of queries beat SDPA (docs/performance.md, "Prefill attention in
    chunks"): a sliding window shorter than the context (SDPA scores every key, then masks
    them), or two chunks' queries or more whose scores stay small enough for the caches
    (below 128 queries the chunks' own ops cost more than they save)."""
    if q.dtype != torch.float32:
        return False
    window = layer.sliding_window
    if window is not None and context_len > window + _CHUNK:
        return True
    return q.shape[0] >= 2 * _CHUNK and _CHUNK * layer.num_heads * context_len <= _CHUNK_SCORES


def chunked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, prior: int,
                      window: int | None = None, causal: bool = True) -> torch.Tensor:
    """Attention of n queries at positions prior .. prior + n - 1 over keys and values at 0,
    1, ...: q (n, heads, dim), keys and values (T, kv_heads, dim) -> (n, heads, dim).
    Causal: a query sees the keys up to its own place (T = prior + n); else keys on both
    sides. With `window`, only the keys fewer than `window` places away.

    _CHUNK queries at a time, each chunk against only the keys it may see, in two matrix
    products with the softmax between; a key head's query heads go as one matrix. SDPA
    at head_dim 256 and 4 heads (Gemma 3 270M) ran ~100 GFLOP/s on a 2-core Zen 5 and
    scored every key of a sliding window's layer before masking it."""
    n, heads, dim = q.shape
    total, kv_heads = keys.shape[:2]
    group = heads // kv_heads
    grouped = q.view(n, kv_heads, group, dim).transpose(0, 1)  # (kv_heads, n, group, dim)
    keys_t, values_h = keys.permute(1, 2, 0), values.transpose(0, 1)  # (kv_heads, dim, T), (kv_heads, T, dim)
    out = torch.empty(n, kv_heads, group, dim, dtype=q.dtype)
    for s in range(0, n, _CHUNK):
        e = min(n, s + _CHUNK)
        c, first_place = e - s, prior + s
        lo = 0 if window is None else max(0, first_place - window + 1)
        hi = prior + e if causal else total if window is None else min(total, prior + e - 1 + window)
        rows = grouped[:, s:e].reshape(kv_heads, c * group, dim)
        scores = torch.bmm(rows, keys_t[:, :, lo:hi]).mul_(scale).view(kv_heads, c, group, hi - lo)
        # Only the first c keys can lie a window or more before a query of the chunk, and
        # only the last c come after one (causal) or a window or more after one: each
        # edge a c x c triangle.
        places = torch.arange(first_place, prior + e)[:, None, None]
        if window is not None and prior + e - 1 - window >= lo:
            edge = min(c, hi - lo)
            scores[..., :edge].masked_fill_(torch.arange(lo, lo + edge) <= places - window, float("-inf"))
        if causal:
            scores[..., hi - lo - c:].masked_fill_(_LATER[:c, :, :c], float("-inf"))
        elif window is not None and first_place + window < hi:
            edge = min(c, hi - lo)
            scores[..., hi - lo - edge:].masked_fill_(torch.arange(hi - edge, hi) >= places + window, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kv_heads, c * group, hi - lo)
        out[s:e] = torch.bmm(probs, values_h[:, lo:hi]).view(kv_heads, c, group, dim).transpose(0, 1)
    return out.view(n, heads, dim)
