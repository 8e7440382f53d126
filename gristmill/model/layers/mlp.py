"""The gated MLP of every supported family, down(act(gate(x)) * up(x)), and an
encoder's activated projection, act(up(x))."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.context import current_backend
from gristmill.model.layers.activations import ACTIVATIONS


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
        return self.down_proj(current_backend().gated_activation(self, x))


def linear_activation(linear: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    """ACTIVATIONS[activation](linear(x)), as the backend runs it (the int8 kernel applies
    GELU as it writes its output)."""
    return current_backend().linear_activation(linear, x, activation)
