"""How many KV cache blocks fit on the GPU: `gpu_memory_utilization` of its memory, the
weights included, less a worst-case step's activations (measured by running one) and
room for the sampler. An explicit size that does not fit is refused at start, naming
the option to change, so a CUDA out-of-memory never happens mid-run. What the engine
takes is counted from before its weights loaded (`MemoryAtStart`): another engine in the
same process is not charged to it, but must leave room."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from gristmill.model.context import forward_context
from gristmill.model.metadata import build_host_step

logger = logging.getLogger(__name__)

GIB = 2**30


class MemoryAtStart(NamedTuple):
    """The device's free bytes and this process's torch-allocated and -reserved bytes,
    read before an engine loads its weights."""
    free: int
    allocated: int
    reserved: int

    @classmethod
    def read(cls, device) -> "MemoryAtStart":
        return cls(torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device),
                   torch.cuda.memory_reserved(device))


def profile_step(runner) -> int:
    """Peak bytes this engine has allocated while running a prefill of
    max_num_batched_tokens tokens (as sequences of at most max_model_len, each sampled),
    its weights included.
    Also compiles the prefill kernels before the first real step."""
    config, bs, device = runner.config, runner.config.block_size, runner.device
    lengths, left = [], config.max_num_batched_tokens
    while left > 0 and len(lengths) < config.max_num_seqs:
        lengths.append(min(left, runner.max_model_len))
        left -= lengths[-1]
    sequences, next_block = [], 0
    for n in lengths:
        count = -(-n // bs)
        sequences.append(([0] * n, 0, list(range(next_block, next_block + count)), True))
        next_block += count
    runner.num_blocks = next_block
    runner._allocate_kv_cache()
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        input_ids, positions, metadata, samples = runner.backend.upload(build_host_step(sequences, bs))
        with forward_context(metadata, runner.backend):
            hidden = runner.model(input_ids, positions)
        runner.model.compute_logits(hidden[samples])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv_bytes - runner.memory_at_start.allocated
    runner.kv_cache = None
    for layer in runner._kv_layers():
        layer.k_cache = layer.v_cache = None
    torch.cuda.empty_cache()
    return peak


def kv_cache_blocks(runner, at_start: MemoryAtStart, bytes_per_block: int) -> int:
    config, device = runner.config, runner.device
    peak = profile_step(runner)
    # What this engine holds now (its weights), and the most it will add in a step.
    to_come = max(0, peak - (torch.cuda.memory_allocated(device) - at_start.allocated))
    # Sampling a full batch: its logits (the graphs' output), float copies and masks.
    reserve = config.max_num_seqs * runner.vocab_size * (torch.finfo(runner.dtype).bits // 8 + 16)
    free_now, total = torch.cuda.mem_get_info(device)
    if config.num_kv_blocks or config.kv_cache_memory_gb is not None:
        blocks = config.num_kv_blocks or max(1, int(config.kv_cache_memory_gb * GIB) // bytes_per_block)
        room = free_now - to_come - reserve
        if blocks * bytes_per_block > room:
            option = "num_kv_blocks" if config.num_kv_blocks else "kv_cache_memory_gb"
            raise ValueError(
                f"a KV cache of {blocks} blocks ({blocks * bytes_per_block / GIB:.2f} GiB) does not fit on "
                f"{device}: {max(room, 0) / GIB:.2f} GiB are free after the weights and a step's activations; "
                f"lower {option}, or leave num_kv_blocks and kv_cache_memory_gb unset to size the cache "
                f"from gpu_memory_utilization")
        return blocks
    # As vLLM users expect: this engine may use gpu_memory_utilization of the GPU, its
    # weights, activations and memory outside torch's allocator (CUDA context, cuBLAS)
    # included; other processes' memory is not charged to it, but must leave room.
    requested = config.gpu_memory_utilization * total
    outside_torch = max(0, (at_start.free - free_now) - (torch.cuda.memory_reserved(device) - at_start.reserved))
    budget = requested - peak - reserve - outside_torch
    room = free_now - to_come - reserve
    blocks = int(min(budget, room) // bytes_per_block)
    if blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} of {device}'s {total / GIB:.1f} GiB leaves "
            f"no room for a KV cache: the weights and a step's activations take {peak / GIB:.2f} GiB, sampling "
            f"{reserve / GIB:.2f} GiB, and {(total - free_now) / GIB:.2f} GiB of the GPU are in use (other "
            f"processes included); raise gpu_memory_utilization, lower max_num_batched_tokens or "
            f"max_num_seqs, or free the GPU")
    if blocks * config.block_size < runner.max_model_len:
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: longer requests are refused",
                       blocks * config.block_size, runner.max_model_len)
    return blocks
