"""Rotary position embedding: inverse frequencies from an HF config, and cos/sin tables
shared by every layer with the same setting."""

from __future__ import annotations

import json
import math

import torch
from torch import nn


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
    """Rotate-half rotary embedding over a float32 cos/sin table computed once for all
    positions: `cos`, `sin` are (max_positions, head_dim / 2)."""

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
        self.cos = freqs.cos().to(self.cos.device)
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
