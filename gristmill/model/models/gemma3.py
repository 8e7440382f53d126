"""Gemma 3 (text): interleaved sliding-window / global attention, QK-norm, four norms per
layer (around attention and MLP), (1 + w) RMSNorm, embeddings scaled by sqrt(hidden)."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.layers import (GatedMLP, PagedAttention, RMSNorm, attention_inputs, embedding, residual_norm,
                                    run_layers, shared_rotary)
from gristmill.model.layers.attention import BidirectionalAttention
from gristmill.model.layers.linear import head_argmax


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_type: str, max_positions: int):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        sliding = layer_type == "sliding_attention"
        self.rotary = shared_rotary(self.head_dim, max_positions, config.rope_parameters[layer_type])
        attention = BidirectionalAttention if config.bidirectional else PagedAttention
        self.attn = attention(self.num_heads, self.num_kv_heads, self.head_dim, config.query_pre_attn_scalar ** -0.5,
                              sliding_window=config.sliding_window if sliding else None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = attention_inputs(self, positions, x, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v).reshape(x.shape[0], -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str, max_positions: int):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_type, max_positions)
        self.mlp = GatedMLP(dim, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(dim, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(dim, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, offset=1.0)

    def stack_norms(self) -> tuple:
        """(in, attn_out, mlp_in, mlp_out) norms, for the decode stack (layers.DecodeStack)."""
        return (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x))
        x, h = residual_norm(x, attn, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return residual_norm(x, self.mlp(h), self.post_feedforward_layernorm, None)[0]


class Gemma3TextModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, layer_type, max_positions)
                                    for layer_type in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        self.embed_scale = config.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        # The scale is rounded to the activation dtype first, as the reference does.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return self.norm(run_layers(self.layers, positions, x))


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.model = Gemma3TextModel(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = config.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's logits of `hidden`, into `out` when given (the CUDA graphs' one buffer)."""
        if out is None:
            logits = self.lm_head(hidden)
            return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits
        torch.mm(hidden, self.lm_head.weight.t(), out=out)
        if self.softcap:  # the same three roundings, in place
            out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden).argmax(-1)` from the LM head alone, where it can give
        it without the logits (None: it cannot, or a softcap's rounding could tie what
        the head's outputs do not)."""
        return None if self.softcap else head_argmax(self.lm_head, hidden)
