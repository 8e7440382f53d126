"""What a step's attention needs to know, the same for every backend.

Token order contract: sequences [0, num_decodes) have one new token each (decodes), the
others are prefill chunks; sequence i's new tokens are step tokens
query_start[i] : query_start[i + 1], contiguous. KV slot of a position p of a sequence
= block_table[p // block_size] * block_size + p % block_size, and `slot_mapping` holds
that slot for every token of the step (-1: write nothing, a padding row).

`HostStep` holds it in numpy, built from the scheduler's output without a tensor op;
each backend uploads it once (`Backend.upload`) as a `StepMetadata` of device tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch


@dataclass
class HostStep:
    input_ids: np.ndarray       # (num_tokens,)
    positions: np.ndarray       # (num_tokens,)
    slot_mapping: np.ndarray    # (num_tokens,)
    query_start: np.ndarray     # (num_seqs + 1,)
    seq_lens: np.ndarray        # (num_seqs,) tokens in the cache once this step is written
    block_tables: np.ndarray    # (num_seqs, width)
    sample_indices: np.ndarray  # (num_samples,) token rows whose hidden state is sampled
    num_decodes: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.seq_lens) and self.num_decodes > 0


def build_host_step(sequences: Sequence[tuple[Sequence[int], int, Sequence[int], bool]],
                    block_size: int) -> HostStep:
    """`sequences`: (new token ids, position of the first, block ids, whether the last new
    token is sampled) per scheduled sequence, decodes first. Costs a fixed number of
    numpy calls, whatever the batch: it runs before every step."""
    num_seqs = len(sequences)
    new_ids, starts, blocks, samples = zip(*sequences) if num_seqs else ((),) * 4
    counts = np.fromiter(map(len, new_ids), dtype=np.int64, count=num_seqs)
    starts = np.fromiter(starts, dtype=np.int64, count=num_seqs)
    num_blocks = np.fromiter(map(len, blocks), dtype=np.int64, count=num_seqs)
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    num_tokens = int(query_start[-1])
    ids = np.fromiter(chain.from_iterable(new_ids), dtype=np.int64, count=num_tokens)
    # each sequence's block ids, left-aligned in a (num_seqs, width) table padded with 0
    width = max(int(num_blocks.max()) if num_seqs else 1, 1)
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    tables[np.arange(width) < num_blocks[:, None]] = np.fromiter(  # (row-major: each row's blocks in order)
        chain.from_iterable(blocks), dtype=np.int64, count=int(num_blocks.sum()))
    # position of each token: its sequence's first new position + its index within it
    if num_tokens == num_seqs:  # one token each (decodes)
        seq_of_token, positions = np.arange(num_seqs), starts
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), counts)
        positions = starts[seq_of_token] + np.arange(num_tokens) - query_start[:-1][seq_of_token]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    samples = np.flatnonzero(np.fromiter(samples, dtype=bool, count=num_seqs))
    num_decodes = int(np.argmax(counts != 1)) if (counts != 1).any() else num_seqs
    return HostStep(ids, positions, slots, query_start, starts + counts, tables, query_start[samples + 1] - 1,
                    num_decodes, block_size)


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor    # (num_tokens,)
    query_start: torch.Tensor     # (num_seqs + 1,)
    seq_lens: torch.Tensor        # (num_seqs,)
    block_tables: torch.Tensor    # (num_seqs, width)
    num_decodes: int
    block_size: int
    #: Host copies, for backends that walk the prefill chunks in Python.
    query_start_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    #: A backend's own per-step tensors (the Triton backend's program maps).
    extras: dict = field(default_factory=dict)
    #: The step's rows by LoRA adapter slot (model/lora.py's LoRAStep); None: no row
    #: uses an adapter.
    lora: object | None = None
    _decode_masks: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_block_tables(self) -> torch.Tensor:
        return self.block_tables[:self.num_decodes]

    @property
    def decode_context_lens(self) -> torch.Tensor:
        return self.seq_lens[:self.num_decodes]

    def prefills(self):
        """(first token, end token, context length, block table) of each prefill chunk."""
        qs, lens = self.query_start_host, self.seq_lens_host
        for i in range(self.num_decodes, len(lens)):
            yield qs[i], qs[i + 1], lens[i], self.block_tables[i]

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """(num_decodes, 1, 1, max_len) bool: which cached keys each decode token sees."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            max_len = self.block_tables.shape[1] * self.block_size
            key_pos = torch.arange(max_len, device=self.slot_mapping.device)
            lens = self.decode_context_lens[:, None]
            mask = key_pos[None, :] < lens
            if sliding_window is not None:
                mask &= key_pos[None, :] >= lens - sliding_window
            mask = mask[:, None, None, :]
            self._decode_masks[sliding_window] = mask
        return mask

