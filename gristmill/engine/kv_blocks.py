"""BlockManager: owns the KV cache blocks, each request's block table, and the prefix cache.

Prefix caching: a full block is named by a hash of its token ids chained with the hash
of the block before it, so one hash names the whole prefix up to the block's end. A new
request reuses the longest run of cached full blocks that starts its sequence and
computes only the rest. Blocks are reference-counted; a block whose last user ended
keeps its hash (it is "cached") and is evicted, least recently freed first, only when
an allocation needs room.

Each block is in exactly one state:
- free:   ref_count 0, no hash, in the free queue;
- cached: ref_count 0, a hash, in the free queue (reusable until handed out again);
- owned:  ref_count >= 1, in that many block tables; it carries a hash once full.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from gristmill.engine.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: a digest of the previous block's hash and its token ids,
    so equal hashes mean equal prefixes (a 128-bit digest: collisions are not a concern)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """Hands out fixed-size KV blocks. Check-then-change: `can_allocate` / `allocate`.

    The scheduler admits a request with `computed = cached_prefix(request)` (the block
    ids of its cached leading blocks), then `can_allocate(request, n, computed)` and
    `allocate(request, n, computed)`; a failed check changes nothing.

    The free queue holds free and cached blocks; allocation takes from its front.
    Freed blocks with a hash go to the back, a request's last block first, so the
    least recently used prefixes, and of a request its tail, are evicted first. Freed
    blocks without a hash go to the front: handing them out evicts nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free = _FreeQueue(num_blocks)
        self._cached: dict[bytes, int] = {}  # hash -> the one block carrying it
        #: Prefix-cache lookups, in tokens: asked (each admission's num_tokens) and found.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones nobody uses."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks a new request could reuse: every block carrying a hash, used or not."""
        return len(self._cached)

    # -- prefix cache ------------------------------------------------------------------

    def cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest run of cached blocks matching the start of `request`.

        Only blocks within its first `num_tokens - 1` tokens count: the last token is
        always computed (its logits are sampled), so the block it lands in is never shared.
        Empty when caching is off or the request already holds blocks.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return []
        hits = []
        for i in range((request.num_tokens - 1) // self.block_size):
            block = self._cached.get(self._hash_of(request, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def _hash_of(self, request: Request, index: int) -> bytes:
        """The hash of the request's full block `index`, computed once: tokens are only
        ever appended, so a block's hash never changes."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else request.hash_seed,
                                     request.token_ids[i * bs:(i + 1) * bs]))
        return hashes[index]

    # -- check, then change ------------------------------------------------------------

    def num_new_blocks(self, request: Request, num_tokens: int, computed: Sequence[int] = ()) -> int:
        """Blocks `request` still needs so the cache can hold `num_tokens` of its tokens,
        beyond those it holds and the cached blocks `computed` it will reuse."""
        held = len(request.block_ids) + len(computed)
        return max(0, blocks_needed(num_tokens, self.block_size) - held)

    def can_allocate(self, request: Request, num_tokens: int, computed: Sequence[int] = ()) -> bool:
        if not computed:  # every running request, every step: kept lean
            return blocks_needed(num_tokens, self.block_size) - len(request.block_ids) <= len(self._free)
        # A reused block nobody holds leaves the free queue too.
        revived = sum(1 for block in computed if self.ref_counts[block] == 0)
        return self.num_new_blocks(request, num_tokens, computed) + revived <= len(self._free)

    def allocate(self, request: Request, num_tokens: int, computed: Sequence[int] = ()) -> None:
        """Grow `request`'s block table so the cache can hold `num_tokens` of its tokens,
        reusing the cached blocks `computed` (from `cached_prefix`, for a request holding
        none). Tokens from `request.num_computed_tokens` to `num_tokens` are computed in
        this step; each block they fill gets its hash now, so a request admitted later in
        the same step can reuse it: the model writes a step's keys and values into the
        cache before any attention reads it, and a step is never cut short by an abort.
        """
        needed = max(0, -(-num_tokens // self.block_size) - len(request.block_ids) - len(computed))
        revived = sum(1 for block in computed if self.ref_counts[block] == 0) if computed else 0
        if needed + revived > len(self._free):
            raise RuntimeError(f"allocate without can_allocate: need {needed + revived} blocks, "
                               f"{len(self._free)} free")
        if computed and request.block_ids:
            raise RuntimeError("allocate: cached blocks are reused only by a request holding none")
        if self.enable_prefix_caching and not request.block_ids and num_tokens > 0:
            self.num_query_tokens += request.num_tokens
            self.num_hit_tokens += len(computed) * self.block_size
        for block in computed:  # taken first: a new block must not evict a reused one
            if self.ref_counts[block] == 0:
                self._free.remove(block)
            self.ref_counts[block] += 1
        request.block_ids.extend(computed)
        for _ in range(needed):
            block = self._free.pop_first()
            self._evict(block)
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        if self.enable_prefix_caching:
            # Blocks full before this step were registered when they were scheduled, except
            # one a pending placeholder filled (async scheduling): it is named once the token
            # is known, so the block of the last computed token is looked at again.
            first = max(request.num_computed_tokens - 1, 0) // self.block_size
            end = min(num_tokens, request.num_known_tokens) // self.block_size
            if end > first:  # most decode steps fill no block
                self._register_full_blocks(request, first, end)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so later requests compute their whole prompt.
        Only while no request holds a block (True); otherwise nothing changes (False)."""
        if any(self.ref_counts):
            return False
        self._cached.clear()
        self.block_hashes = [None] * self.num_total_blocks
        return True

    def _register_full_blocks(self, request: Request, first: int, end: int) -> None:
        for i in range(first, end):
            block = request.block_ids[i]
            if self.block_hashes[block] is not None:
                continue
            digest = self._hash_of(request, i)
            # Another block holding the same tokens keeps the name; this one stays plain.
            if digest not in self._cached:
                self._cached[digest] = block
                self.block_hashes[block] = digest

    def _evict(self, block: int) -> None:
        digest = self.block_hashes[block]
        if digest is not None:
            del self._cached[digest]
            self.block_hashes[block] = None

    def free(self, request: Request) -> None:
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is None:
                    self._free.push_front(block)
                else:
                    self._free.push_back(block)
        request.block_ids = []

    # -- invariants (for tests) --------------------------------------------------------

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Assert the block states are consistent with `requests`, every request holding
        blocks: each block is free, cached or owned by exactly `ref_count` table entries."""
        requests = list(requests)
        refs = [0] * self.num_total_blocks
        for request in requests:
            assert len(set(request.block_ids)) == len(request.block_ids), \
                f"{request.request_id} holds a block twice"
            for block in request.block_ids:
                refs[block] += 1
        assert refs == self.ref_counts, "ref counts differ from the block tables"
        assert set(self._free) == {b for b, r in enumerate(refs) if r == 0}, "free queue != unused blocks"
        assert {b: h for b, h in enumerate(self.block_hashes) if h is not None} == \
            {b: h for h, b in self._cached.items()}, "hash map and block hashes disagree"
        for block, ref in enumerate(refs):
            assert ref <= 1 or self.block_hashes[block] is not None, f"block {block} shared without a hash"
        for request in requests:
            for i, block in enumerate(request.block_ids):
                digest = self.block_hashes[block]
                assert digest is None or digest == self._hash_of(request, i), \
                    f"block {block} of {request.request_id} carries another prefix's hash"


class _FreeQueue:
    """The free queue, front to back: blocks freed without a hash (the latest first), the
    blocks never used yet (in id order; counted, not listed, so a pool of millions of
    blocks, a tiny model's default 1 GiB, costs nothing to make), then blocks freed with
    a hash (the least recently freed first)."""

    def __init__(self, num_blocks: int):
        self._front: OrderedDict[int, None] = OrderedDict()
        self._next_unused = 0
        self._num_blocks = num_blocks
        self._back: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + self._num_blocks - self._next_unused + len(self._back)

    def __iter__(self) -> Iterator[int]:
        yield from self._front
        yield from range(self._next_unused, self._num_blocks)
        yield from self._back

    def pop_first(self) -> int:
        if self._front:
            return self._front.popitem(last=False)[0]
        if self._next_unused < self._num_blocks:
            self._next_unused += 1
            return self._next_unused - 1
        return self._back.popitem(last=False)[0]

    def remove(self, block: int) -> None:
        """Take out a block freed earlier (a cached one reused)."""
        if block in self._back:
            del self._back[block]
        else:
            del self._front[block]

    def push_front(self, block: int) -> None:
        self._front[block] = None
        self._front.move_to_end(block, last=False)

    def push_back(self, block: int) -> None:
        self._back[block] = None
