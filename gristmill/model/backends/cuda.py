"""The CUDA backend: Triton kernels for everything but the matmuls (cuBLAS), q/k/v and
gate/up fused into one projection each, a step's inputs in one host-to-device copy, and
decode steps replayed from CUDA graphs (model/cuda/graphs.py).

Per decoder layer a step runs: norm, qkv matmul, q/k norm + rotary (writing k and v into
the paged cache), one attention launch for all decodes and one for all prefill chunks, o
matmul, residual + norms, gate/up matmul, activation, down matmul, residual + norm."""

from __future__ import annotations

import numpy as np
import torch

from gristmill.model.backends.reference import Backend
from gristmill.model.context import get_metadata, has_metadata
from gristmill.model.layers.attention import PagedAttention
from gristmill.model.layers.linear import fuse_projections
from gristmill.model.metadata import HostStep, StepMetadata


def _norm(norm):
    return None if norm is None else (norm.weight, float(norm.offset), float(norm.eps))


class CudaBackend(Backend):
    name = "cuda"
    index_dtype = torch.int32

    def __init__(self, device, dtype: torch.dtype = torch.bfloat16):
        super().__init__(device, dtype)
        from gristmill.model.cuda import triton_kernels
        self.kernels = triton_kernels
        self.shape = None
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def prepare(self, model: torch.nn.Module, max_model_len: int = 0) -> None:
        """Fit the model to this backend once, before the first step: q/k/v and gate/up
        fused into one matmul each."""
        fuse_projections(model)
        attn = next((m for m in model.modules() if isinstance(m, PagedAttention)), None)
        if attn is not None:  # (an encoder has no paged attention)
            self.shape = self.kernels.AttentionShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.dtype,
                                                     max_model_len)

    # -- inputs: one pinned buffer, one copy ----------------------------------------

    def staging(self, size: int) -> torch.Tensor:
        """A pinned int32 host buffer of at least `size`, free to write (the copy out of
        it that the last step queued has finished)."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging is None or self._staging.numel() < size:
            pin = self.device.type == "cuda"
            self._staging = torch.empty(max(size, 2 * (self._staging.numel() if self._staging is not None else 0)),
                                        dtype=torch.int32, pin_memory=pin)
        return self._staging

    def copied(self) -> None:
        """Mark the staging buffer as in use by a queued copy."""
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def upload(self, step: HostStep):
        prog_seq, prog_block = self.kernels.prefill_programs(step.query_start, step.num_decodes,
                                                             self.shape.prefill_block_q)
        parts = [step.input_ids, step.positions, step.slot_mapping, step.query_start, step.seq_lens,
                 step.sample_indices, step.block_tables.ravel(), prog_seq, prog_block]
        sizes = [len(p) for p in parts]
        spans = [-(-size // 4) * 4 for size in sizes]  # each part 16-byte aligned (see triton_kernels)
        total = sum(spans)
        staging = self.staging(total)
        host = staging.numpy()
        offset = 0
        for part, size, span in zip(parts, sizes, spans):
            host[offset:offset + size] = part
            offset += span
        flat = staging[:total]
        flat = flat.to(self.device, non_blocking=True) if self.device.type == "cuda" else flat.clone()
        self.copied()
        ids, positions, slots, query_start, seq_lens, samples, tables, seqs, blocks = (
            part[:size] for part, size in zip(flat.split(spans), sizes))
        longest = int(step.seq_lens[:step.num_decodes].max()) if step.num_decodes else 0
        metadata = StepMetadata(
            slot_mapping=slots, query_start=query_start, seq_lens=seq_lens,
            block_tables=tables.view(step.block_tables.shape), num_decodes=step.num_decodes,
            block_size=step.block_size, query_start_host=step.query_start.tolist(),
            seq_lens_host=step.seq_lens.tolist(), extras={"programs": (seqs, blocks) if len(prog_seq) else None,
                                                          "decode_splits": self.shape.decode_splits(longest)})
        return ids, positions, metadata, samples

    # -- ops ------------------------------------------------------------------------

    def rms_norm(self, x, norm):
        return self.kernels.rms_norm(x, norm.weight, float(norm.offset), float(norm.eps))

    def residual_norm(self, x, delta, delta_norm, out_norm):
        return self.kernels.residual_norm(x, delta, _norm(delta_norm), _norm(out_norm))

    def attention_inputs(self, module, positions, x, q_norm, k_norm):
        """q, k, v; within a forward, k and v go straight into the layer's paged cache and
        come back as None (the attention launch reads every key from the cache)."""
        if not hasattr(module, "qkv_proj"):
            return super().attention_inputs(module, positions, x, q_norm, k_norm)
        attn, kv_cache = getattr(module, "attn", None), None
        if attn is not None and attn.k_cache is not None and has_metadata():
            kv_cache = (get_metadata().slot_mapping, attn.k_cache, attn.v_cache)
        return self.kernels.qkv_rotary(module.qkv_proj(x), positions, module.num_heads, module.num_kv_heads,
                                       module.head_dim, _norm(q_norm), _norm(k_norm), module.rotary.cos,
                                       module.rotary.sin, kv_cache)

    def gated_activation(self, mlp, x):
        if not hasattr(mlp, "gate_up_proj"):
            return super().gated_activation(mlp, x)
        return self.kernels.act_mul(mlp.gate_up_proj(x), mlp.activation)

    # -- attention ------------------------------------------------------------------

    def attention(self, layer, q, k, v, md: StepMetadata) -> torch.Tensor:
        kernels = self.kernels
        if k is not None:  # not written by attention_inputs already
            kernels.write_kv(k, v, layer.k_cache, layer.v_cache, md.slot_mapping)
        out = torch.empty_like(q)
        common = (md.query_start, md.seq_lens, md.block_tables, layer.scale, layer.sliding_window, self.shape)
        if md.num_decodes:
            kernels.paged_attention(q, layer.k_cache, layer.v_cache, out, *common, md.num_decodes,
                                    splits=md.extras.get("decode_splits", 1))
        programs = md.extras.get("programs")
        if programs is not None:
            kernels.paged_attention(q, layer.k_cache, layer.v_cache, out, *common, md.num_seqs, programs)
        return out
