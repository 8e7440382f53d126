"""Llama 2 / 3 decoder; Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm) are variants of it."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.layers import (GatedMLP, PagedAttention, RMSNorm, attention_inputs, embedding, residual_norm,
                                    run_layers, shared_rotary)
from gristmill.model.layers.linear import head_argmax


class LlamaAttention(nn.Module):
    def __init__(self, config, max_positions: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # HF: `attention_bias` (Llama, Qwen3) biases q, k, v and o; Qwen2 always biases q, k, v.
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias or bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias or bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias or bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = shared_rotary(self.head_dim, max_positions, config.rope_parameters)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = attention_inputs(self, positions, x, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v).reshape(x.shape[0], -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, max_positions: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, max_positions, qkv_bias, qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def stack_norms(self) -> tuple:
        """(in, attn_out, mlp_in, mlp_out) norms, for the decode stack (layers.DecodeStack)."""
        return self.input_layernorm, None, self.post_attention_layernorm, None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x, h = residual_norm(x, self.self_attn(positions, self.input_layernorm(x)), None,
                             self.post_attention_layernorm)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, max_positions, qkv_bias, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        return self.norm(run_layers(self.layers, positions, x))


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions, self.qkv_bias, self.qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's logits of `hidden`, into `out` when given (the CUDA graphs' one buffer)."""
        if out is None:
            return self.lm_head(hidden)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden).argmax(-1)` from the LM head alone, where it can give
        it without the logits (None: it cannot)."""
        return head_argmax(self.lm_head, hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

