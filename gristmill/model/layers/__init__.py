"""Building blocks shared by the model families: norms, rotary, attention, MLP.

The modules hold weights and say what to compute; the arithmetic is the step's
backend's (gristmill.model.backends), chosen once by the model runner."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.context import current_backend
from gristmill.model.layers.attention import EncoderAttention, PagedAttention, attention_inputs
from gristmill.model.layers.linear import GATE_UP, QKV, fuse_projections, project
from gristmill.model.layers.mlp import ACTIVATIONS, GatedMLP, linear_activation
from gristmill.model.layers.norm import RMSNorm, add_layer_norm, residual_norm
from gristmill.model.layers.rotary import RotaryEmbedding, clear_rotary_cache, rope_inv_freq, shared_rotary

__all__ = ["ACTIVATIONS", "EncoderAttention", "GATE_UP", "QKV", "GatedMLP", "PagedAttention", "RMSNorm",
           "RotaryEmbedding", "add_layer_norm", "attention_inputs", "clear_rotary_cache", "embedding",
           "fuse_projections", "linear_activation", "project", "residual_norm", "rope_inv_freq", "run_layers",
           "shared_rotary"]


def embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """A token embedding whose table is left for the checkpoint to fill: nn.Embedding's
    random init costs seconds on a 262k vocabulary, and on the meta device (where models
    are built) it imports torch._dynamo, another 2 s of every start."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


def run_layers(layers: nn.ModuleList, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x through every decoder layer, as the backend runs them (one by one, or the CPU
    backend's decode stack in one C++ call)."""
    return current_backend().run_layers(layers, positions, x)
