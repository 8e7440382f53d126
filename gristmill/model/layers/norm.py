"""RMSNorm, the residual stream around a sublayer, and a post-LayerNorm encoder's residual. Which arithmetic runs is the
step's backend's (model/backends): these modules hold the weights and say what to do."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.context import current_backend


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + weight), the others by weight."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def float_weight(self) -> torch.Tensor:
        """The weight as fused kernels take it: float32, contiguous (it already is, in a
        float32 model)."""
        weight = self._parameters["weight"]
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            weight = weight.float().contiguous()
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_backend().rms_norm(x, self)


def residual_norm(x: torch.Tensor, delta: torch.Tensor, delta_norm: RMSNorm | None,
                  out_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream around a sublayer: x + delta_norm(delta) (x + delta without a
    delta_norm), and out_norm of that, the next sublayer's input (None without out_norm)."""
    return current_backend().residual_norm(x, delta, delta_norm, out_norm)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.LayerNorm) -> torch.Tensor:
    """norm(x + delta) (norm(x) when delta is None): a post-LayerNorm encoder's residual.
    delta is the sublayer's output, and the backend may write the result over it."""
    return current_backend().add_layer_norm(x, delta, norm)
