"""BlockManager: owns the KV cache blocks and each request's block table."""

from __future__ import annotations

from collections import deque

from gristmill.engine.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size KV blocks. Check-then-change: `can_allocate` / `allocate`.

    Invariant: every block id is either in the free list or in exactly one
    request's `block_ids`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` still needs so the cache can hold `num_tokens` of its tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.num_new_blocks(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> None:
        needed = self.num_new_blocks(request, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"allocate without can_allocate: need {needed} blocks, "
                               f"{len(self._free)} free")
        request.block_ids.extend(self._free.popleft() for _ in range(needed))

    def free(self, request: Request) -> None:
        # Return blocks in reverse so the most recently used are handed out last.
        self._free.extend(reversed(request.block_ids))
        request.block_ids = []
