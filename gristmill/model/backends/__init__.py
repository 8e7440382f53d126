"""Backends: one implementation of the model's arithmetic each, picked once per engine.

- `reference.Backend`: plain torch, any device; the oracle the others are tested against.
- `cpu.CpuBackend`: compiled C++ ops and the decode stack (float32 activations).
- `cuda.CudaBackend`: Triton kernels (fused norms, q/k/v + rotary, activation, KV write,
  paged attention with one call per layer for all decodes and one for all prefills).

Every backend shares one KV cache layout (per layer: num_blocks x block_size x
num_kv_heads x head_dim) and one step metadata (`metadata.StepMetadata`).
"""

from __future__ import annotations

import torch

from gristmill.model.backends.reference import Backend


def pick_backend(device: torch.device, dtype: torch.dtype) -> Backend:
    if device.type == "cuda":
        from gristmill.model.backends.cuda import CudaBackend
        return CudaBackend(device, dtype)
    if device.type == "cpu":
        from gristmill.model.backends.cpu import CpuBackend
        return CpuBackend(device, dtype)
    return Backend(device, dtype)
