"""Attention metadata for one forward pass, reachable from every attention layer.

The runner sets it before the forward and clears it after, so model `forward`
signatures stay `(input_ids, positions)`.

Token order contract: the first `num_decodes` tokens are one decode token each of
`num_decodes` sequences; then each prefill chunk's tokens, contiguous, in the order of
`prefills`. KV slot of a token = block_table[pos // block_size] * block_size
+ pos % block_size, and `slot_mapping` holds that slot for every token of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    start: int          # first token of the chunk in the step's token order
    end: int            # one past its last token
    context_len: int    # tokens of this sequence in the cache once the chunk is written
    block_table: torch.Tensor  # (num_blocks_of_seq,) long

    @property
    def has_prior_context(self) -> bool:
        return self.context_len > self.end - self.start


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor              # (num_tokens,) long
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # (num_decodes, max_blocks) long
    decode_context_lens: torch.Tensor | None  # (num_decodes,) long
    prefills: list[PrefillChunk]
    block_size: int
    _decode_masks: dict = field(default_factory=dict)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """(num_decodes, 1, 1, max_len) bool: which cached keys each decode token sees."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            max_len = self.decode_block_tables.shape[1] * self.block_size
            key_pos = torch.arange(max_len, device=self.slot_mapping.device)
            lens = self.decode_context_lens[:, None]
            mask = key_pos[None, :] < lens
            if sliding_window is not None:
                mask &= key_pos[None, :] >= lens - sliding_window
            mask = mask[:, None, None, :]
            self._decode_masks[sliding_window] = mask
        return mask


_context: AttentionMetadata | None = None


def set_context(metadata: AttentionMetadata | None) -> None:
    global _context
    _context = metadata


def get_context() -> AttentionMetadata:
    if _context is None:
        raise RuntimeError("attention metadata is not set: run the model through ModelRunner")
    return _context
