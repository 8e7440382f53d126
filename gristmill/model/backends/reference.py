"""The torch reference backend: every op spelled in plain torch, on any device and
dtype. It is the oracle the CPU and CUDA backends are tested against, and what runs
where they do not apply."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gristmill.model.layers.linear import GATE_UP, QKV, project
from gristmill.model.layers.activations import ACTIVATIONS
from gristmill.model.metadata import HostStep, StepMetadata


class Backend:
    """One implementation of the model's arithmetic, picked once by the model runner:
    norms, q/k/v preparation, the MLP activation, paged attention, how decoder layers
    run, and how a step's inputs reach the device."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.dtype = dtype

    def prepare(self, model: nn.Module, max_model_len: int = 0) -> None:
        """Fit the model to this backend once, before the first step (nothing here)."""

    # -- inputs ---------------------------------------------------------------------

    #: dtype of token ids, positions, slots and block tables on the device
    index_dtype = torch.long

    def upload(self, step: HostStep) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:
        """(input_ids, positions, metadata, sample_indices) of a step, on the device."""
        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device=self.device, dtype=self.index_dtype)

        metadata = StepMetadata(slot_mapping=put(step.slot_mapping), query_start=put(step.query_start),
                                seq_lens=put(step.seq_lens), block_tables=put(step.block_tables),
                                num_decodes=step.num_decodes, block_size=step.block_size,
                                query_start_host=step.query_start.tolist(), seq_lens_host=step.seq_lens.tolist())
        return put(step.input_ids), put(step.positions), metadata, put(step.sample_indices)

    # -- ops ------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        dtype = x.dtype
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps)
        if norm.offset:
            return (out * (norm.offset + norm.weight.float())).to(dtype)
        return norm.weight * out.to(dtype)

    def residual_norm(self, x, delta, delta_norm, out_norm):
        x = x + (self.rms_norm(delta, delta_norm) if delta_norm else delta)
        return x, self.rms_norm(x, out_norm) if out_norm else None

    def add_layer_norm(self, x, delta, norm: nn.LayerNorm):
        return F.layer_norm(x if delta is None else x + delta, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    def attention_inputs(self, module: nn.Module, positions, x, q_norm, k_norm):
        n, heads, kv_heads, dim = x.shape[0], module.num_heads, module.num_kv_heads, module.head_dim
        q, k, v = project(module, x, *QKV)
        q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
        if q_norm is not None:
            q, k = self.rms_norm(q, q_norm), self.rms_norm(k, k_norm)
        return module.rotary(positions, q), module.rotary(positions, k), v

    def gated_activation(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(mlp, x, *GATE_UP)
        return mlp.act(gate) * up

    def linear_activation(self, linear: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
        return ACTIVATIONS[activation](linear(x))

    def run_layers(self, layers: nn.ModuleList, positions, x):
        for layer in layers:
            x = layer(positions, x)
        return x

    # -- attention ------------------------------------------------------------------

    def attention(self, layer, q, k, v, md: StepMetadata) -> torch.Tensor:
        """Write this step's k, v into `layer`'s cache, then attend: (num_tokens, heads, dim)."""
        self.write_kv(layer, k, v, md)
        out = torch.empty_like(q)
        if md.num_decodes:
            out[:md.num_decodes] = self.decode_attention(layer, q[:md.num_decodes], md)
        for start, end, context_len, table in md.prefills():
            out[start:end] = self.prefill_attention(layer, q[start:end], k[start:end], v[start:end],
                                                    context_len, table, md.block_size)
        return out

    def bidirectional_attention(self, layer, q, k, v, md: StepMetadata) -> torch.Tensor:
        """A decoder's attention run both ways (EmbeddingGemma: BidirectionalAttention),
        each sequence on its own: (num_tokens, heads, dim)."""
        out = torch.empty_like(q)
        bounds = md.query_start_host
        for start, end in zip(bounds[:-1], bounds[1:]):
            out[start:end] = self.bidirectional_sequence(layer, q[start:end], k[start:end], v[start:end])
        return out

    def bidirectional_sequence(self, layer, q, k, v) -> torch.Tensor:
        """One sequence's tokens each attending to all of its tokens, or with
        `layer.sliding_window` to those fewer than that many places away on either side."""
        seq = [t.transpose(0, 1)[None] for t in (q, k, v)]  # (1, heads, len, dim)
        mask = None
        if layer.sliding_window is not None and q.shape[0] > layer.sliding_window:
            places = torch.arange(q.shape[0], device=q.device)
            mask = (places[:, None] - places[None, :]).abs() < layer.sliding_window
        return F.scaled_dot_product_attention(*seq, attn_mask=mask, scale=layer.scale,
                                              enable_gqa=True)[0].transpose(0, 1)

    def encoder_attention(self, layer, q, k, v, md: StepMetadata) -> torch.Tensor:
        """Each sequence's tokens attend to all of that sequence's (an encoder step holds
        whole prompts): (num_tokens, heads, dim). Sequences of near lengths are padded to
        the longest and attended in one SDPA call, padding keys masked; where padding
        would more than quadruple the rows (a long sequence among short ones), one call
        per sequence costs less."""
        if "encoder_padding" not in md.extras:  # (once per step: every layer pads alike)
            md.extras["encoder_padding"] = _padding(md.query_start_host, q.device)
        padding = md.extras["encoder_padding"]
        if padding is None:
            out = torch.empty_like(q)
            bounds = md.query_start_host
            for start, end in zip(bounds[:-1], bounds[1:]):
                seq = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # (1, heads, len, dim)
                out[start:end] = F.scaled_dot_product_attention(*seq, scale=layer.scale)[0].transpose(0, 1)
            return out
        rows, valid = padding
        num_seqs, longest = rows.shape
        if valid is None:  # one length: the step's rows are the batch as they stand
            batch = [t.view(num_seqs, longest, layer.num_heads, layer.head_dim).transpose(1, 2) for t in (q, k, v)]
            return F.scaled_dot_product_attention(*batch, scale=layer.scale).transpose(1, 2).reshape(q.shape)
        batch = [t[rows].transpose(1, 2) for t in (q, k, v)]  # (num_seqs, heads, longest, dim)
        mask = valid[:, None, None, :]  # the keys that are tokens
        return F.scaled_dot_product_attention(*batch, attn_mask=mask, scale=layer.scale).transpose(1, 2)[valid]

    def write_kv(self, layer, k, v, md: StepMetadata) -> None:
        flat_k = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        flat_v = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        flat_k.index_copy_(0, md.slot_mapping, k.to(flat_k.dtype))  # (rounded, where the cache is narrower)
        flat_v.index_copy_(0, md.slot_mapping, v.to(flat_v.dtype))

    @staticmethod
    def _gather(layer, cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # block_tables: (batch, max_blocks) -> (batch, num_kv_heads, max_blocks * block_size, head_dim)
        batch = block_tables.shape[0]
        rows = cache[block_tables].view(batch, -1, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
        return rows.to(dtype)  # (the queries' float type, where the cache holds a narrower one)

    def decode_attention(self, layer, q: torch.Tensor, md: StepMetadata) -> torch.Tensor:
        """Gather each sequence's keys and values, then SDPA: (num_decodes, heads, dim)."""
        keys = self._gather(layer, layer.k_cache, md.decode_block_tables, q.dtype)
        values = self._gather(layer, layer.v_cache, md.decode_block_tables, q.dtype)
        mask = md.decode_mask(layer.sliding_window)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask,
                                             scale=layer.scale, enable_gqa=True)
        return out[:, :, 0, :]

    def prefill_attention(self, layer, q, k, v, context_len: int, table: torch.Tensor,
                          block_size: int) -> torch.Tensor:
        """One prefill chunk of n tokens, the last n of `context_len`: (n, heads, dim)."""
        num_new = q.shape[0]
        query = q.transpose(0, 1)[None]  # (1, num_heads, num_new, head_dim)
        has_prior = context_len > num_new
        if has_prior:
            keys = self._gather(layer, layer.k_cache, table[None], q.dtype)[:, :, :context_len]
            values = self._gather(layer, layer.v_cache, table[None], q.dtype)[:, :, :context_len]
        else:
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        window = layer.sliding_window
        if has_prior or (window is not None and context_len > window):
            q_pos = torch.arange(context_len - num_new, context_len, device=q.device)[:, None]
            k_pos = torch.arange(context_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                 scale=layer.scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                 scale=layer.scale, enable_gqa=True)
        return out[0].transpose(0, 1)


# Padding past this many rows per token of the step: one SDPA call per sequence instead.
# Padding wastes work on a long sequence among short ones; a call per sequence pays each
# call's start (on a busy 2-core CPU a 24-token call took 8 ms with 2 threads, 0.1 ms
# with 1), and 100 sequences of up to 48 tokens ran 3x slower than padded.
_MAX_PADDED_ROWS_PER_TOKEN = 4


def _padding(query_start: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(rows, valid) of a step's sequences padded to the longest: rows (num_seqs, longest)
    the token row of each place (padding places read row 0), valid (num_seqs, longest)
    which places are tokens, None when every sequence has the same length. None when
    padding would cost too much."""
    starts = torch.tensor(query_start[:-1])
    lengths = torch.tensor(query_start[1:]) - starts
    longest = int(lengths.max())
    if len(starts) * longest > _MAX_PADDED_ROWS_PER_TOKEN * query_start[-1]:
        return None
    offsets = torch.arange(longest)
    valid = offsets[None, :] < lengths[:, None]
    rows = (starts[:, None] + offsets[None, :]) * valid
    return rows.to(device), (None if bool(valid.all()) else valid.to(device))
