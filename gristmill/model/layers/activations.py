"""The MLP activations a config may name (`hidden_act`), by name: a leaf, so the backends
(the reference applies one after a linear) and the layers both import it."""

from __future__ import annotations

import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
