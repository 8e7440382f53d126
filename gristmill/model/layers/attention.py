"""Attention as the model families use it: q/k/v preparation; `PagedAttention`, the
layer that writes this step's keys and values into the paged KV cache and attends over
it; and `EncoderAttention`, bidirectional attention within each sequence of a step with
no cache at all. How (SDPA over gathered blocks, C++ or Triton kernels) is the step's
backend's."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.context import current_backend, get_metadata


class PagedAttention(nn.Module):
    """`k_cache` / `v_cache` are this layer's views of the one KV allocation, each
    (num_blocks, block_size, num_kv_heads, head_dim), set by the model runner."""

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
        return current_backend().attention(self, q, k, v, get_metadata())


class EncoderAttention(nn.Module):
    """An encoder's attention: every token sees every token of its own sequence, none of
    the others'. Contract: each sequence of the step is a whole prompt (the runner never
    splits a bidirectional model's prompt across steps), so nothing is cached."""

    def __init__(self, num_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: (num_tokens, num_heads, head_dim)
        return current_backend().encoder_attention(self, q, k, v, get_metadata())


class BidirectionalAttention(nn.Module):
    """A decoder's attention run bidirectionally (EmbeddingGemma): each token sees every
    token of its own sequence, or with `sliding_window` those fewer than that many places
    away on either side; keys and values may have fewer heads (grouped). Contract as
    EncoderAttention's: whole prompts, nothing cached."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return current_backend().bidirectional_attention(self, q, k, v, get_metadata())


def attention_inputs(module: nn.Module, positions: torch.Tensor, x: torch.Tensor,
                     q_norm=None, k_norm=None):
    """q (n, num_heads, head_dim), k and v (n, num_kv_heads, head_dim) of an attention
    module (num_heads, num_kv_heads, head_dim, rotary, q/k/v projections): projected,
    q and k normed per head when the family does, rotated."""
    return current_backend().attention_inputs(module, positions, x, q_norm, k_norm)
