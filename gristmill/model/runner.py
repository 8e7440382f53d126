"""ModelRunner: owns the model and the KV cache, turns a SchedulerOutput into tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gristmill.config import EngineConfig
from gristmill.engine.messages import SampledToken, SchedulerOutput
from gristmill.model import kernels, layers, quant
from gristmill.model.context import AttentionMetadata, PrefillChunk, set_context
from gristmill.model.loader import cache_root, load_config, load_weights, resolve_model
from gristmill.model.models import model_class
from gristmill.model.sampler import Sampler, SamplerRow

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _tie_weights(model: torch.nn.Module) -> None:
    # Moving parameters between devices can replace them; tied ones must stay one tensor.
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


@dataclass
class StepInputs:
    input_ids: torch.Tensor       # (num_tokens,)
    positions: torch.Tensor       # (num_tokens,)
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # (num_samples,) rows of the hidden states to sample from
    sample_items: list            # the ScheduledRequest of each sampled row


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path | None = None):
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.model_dir = model_dir or resolve_model(config.model, config.cache_dir)
        self.hf_config = load_config(self.model_dir)
        self.max_model_len = config.max_model_len or self.hf_config.max_position_embeddings
        self.vocab_size = self.hf_config.vocab_size
        self.quantization = quant.resolve_quantization(config.quantization, self.device)
        self.model = self._build_model()
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        if self.device.type == "cpu" and self.dtype == torch.float32:
            kernels.paged_decode_attention()  # build it now, not inside the first step
        self.sampler = Sampler(config.seed, self.device)
        self.generators: dict[str, torch.Generator] = {}

    def _build_model(self) -> torch.nn.Module:
        layers.clear_rotary_cache()
        with torch.device("meta"):
            model = model_class(self.hf_config)(self.hf_config, self.max_model_len)
        model = model.to_empty(device="cpu")
        for module in model.modules():
            if isinstance(module, layers.RotaryEmbedding):
                module.reset()
        _tie_weights(model)
        load_weights(model, self.model_dir)
        model = model.to(device=self.device, dtype=self.dtype).eval()
        _tie_weights(model)
        if self.quantization is not None:
            cache_file = quant.cache_file_for(self.model_dir, cache_root(self.config.cache_dir), self.quantization)
            quant.quantize_model(model, self.quantization, cache_file)
        return model

    def _kv_layers(self) -> list[layers.PagedAttention]:
        return [m for m in self.model.modules() if isinstance(m, layers.PagedAttention)]

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        attn = self._kv_layers()
        bytes_per_block = sum(2 * self.block_size * a.num_kv_heads * a.head_dim for a in attn)
        bytes_per_block *= torch.finfo(self.dtype).bits // 8
        return max(1, int(self.config.kv_cache_memory_gb * 2**30) // bytes_per_block)

    def _allocate_kv_cache(self) -> None:
        attn = self._kv_layers()
        kv_heads, head_dim = attn[0].num_kv_heads, attn[0].head_dim
        # One allocation for every layer: (2, num_layers, num_blocks, block_size, kv_heads, head_dim).
        self.kv_cache = torch.zeros(2, len(attn), self.num_blocks, self.block_size, kv_heads, head_dim,
                                    device=self.device, dtype=self.dtype)
        for i, layer in enumerate(attn):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # -- one step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        logits, items = self.forward(out)
        if not items:
            return {}
        rows = [SamplerRow(item.request.sampling_params, self._generator(item.request))
                for item in items]
        tokens, logprobs = self.sampler(logits, rows)
        return {item.request.request_id: SampledToken(token, lp)
                for item, token, lp in zip(items, tokens, logprobs)}

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list]:
        """Run the model over a step; returns (logits of the sampled rows, their
        ScheduledRequests). The KV cache is updated for every scheduled token. With int8
        weights the logits live in the LM head's reused buffer: valid until the next call."""
        if not out.scheduled:
            return None, []
        inputs = self.prepare_inputs(out)
        set_context(inputs.metadata)
        try:
            hidden = self.model(inputs.input_ids, inputs.positions)
        finally:
            set_context(None)
        if not inputs.sample_items:
            return None, []
        return self.model.compute_logits(hidden[inputs.sample_indices]), inputs.sample_items

    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk_size: int = 512) -> torch.Tensor:
        """Log-probability of each token of `token_ids` after the ones before it: a
        (len - 1,) float tensor. Runs chunked prefills over KV blocks 0, 1, ... of the
        cache (so nothing else may be running on this runner) and needs
        ceil(len / block_size) blocks."""
        bs = self.block_size
        needed = -(-len(token_ids) // bs)
        if needed > self.num_blocks or len(token_ids) > self.max_model_len:
            raise ValueError(f"scoring {len(token_ids)} tokens needs {needed} KV blocks and "
                             f"max_model_len >= {len(token_ids)}; this runner has {self.num_blocks} "
                             f"and {self.max_model_len}")
        table = torch.arange(needed, device=self.device)
        to = dict(device=self.device, dtype=torch.long)
        scores = []
        for start in range(0, len(token_ids) - 1, chunk_size):
            end = min(start + chunk_size, len(token_ids) - 1)
            positions = torch.arange(start, end, **to)
            set_context(AttentionMetadata(
                slot_mapping=table[positions // bs] * bs + positions % bs, num_decodes=0,
                decode_block_tables=None, decode_context_lens=None,
                prefills=[PrefillChunk(0, end - start, end, table)], block_size=bs))
            try:
                hidden = self.model(torch.tensor(token_ids[start:end], **to), positions)
            finally:
                set_context(None)
            logprobs = self.model.compute_logits(hidden).float().log_softmax(dim=-1)
            targets = torch.tensor(token_ids[start + 1:end + 1], **to)
            scores.append(logprobs.gather(1, targets[:, None])[:, 0])
        return torch.cat(scores)

    def _generator(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        generator = self.generators.get(request.request_id)
        if generator is None:
            generator = self.generators[request.request_id] = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        return generator

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        # Decodes (one new token) first, batched; then each prefill chunk.
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        bs = self.block_size
        ids, positions, slots, sample_rows, sample_items, chunks = [], [], [], [], [], []
        offset = 0
        for item in decodes + prefills:
            request, n = item.request, item.num_new_tokens
            start = request.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(request.block_ids)
            ids.append(request.token_ids[start:start + n])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if n > 1:
                chunks.append(PrefillChunk(offset, offset + n, start + n,
                                           torch.as_tensor(table, device=self.device)))
            if item.samples:
                sample_rows.append(offset + n - 1)
                sample_items.append(item)
            offset += n

        to = dict(device=self.device, dtype=torch.long)
        decode_tables = decode_lens = None
        if decodes:
            width = max(len(s.request.block_ids) for s in decodes)
            tables = np.zeros((len(decodes), width), dtype=np.int64)
            for row, s in enumerate(decodes):
                tables[row, :len(s.request.block_ids)] = s.request.block_ids
            decode_tables = torch.as_tensor(tables, **to)
            decode_lens = torch.tensor([s.request.num_computed_tokens + 1 for s in decodes], **to)
        metadata = AttentionMetadata(
            slot_mapping=torch.as_tensor(np.concatenate(slots), **to),
            num_decodes=len(decodes), decode_block_tables=decode_tables,
            decode_context_lens=decode_lens, prefills=chunks, block_size=bs)
        return StepInputs(
            input_ids=torch.tensor([t for chunk in ids for t in chunk], **to),
            positions=torch.as_tensor(np.concatenate(positions), **to),
            metadata=metadata,
            sample_indices=torch.tensor(sample_rows, **to),
            sample_items=sample_items)
