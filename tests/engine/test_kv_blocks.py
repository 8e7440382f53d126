"""BlockManager tests: no model, no torch."""

from __future__ import annotations

import random

import pytest

from gristmill.engine.kv_blocks import BlockManager, blocks_needed
from gristmill.engine.request import Request
from gristmill.sampling import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int = 4) -> Request:
    return Request(request_id, list(range(num_prompt_tokens)),
                   SamplingParams(max_tokens=4, temperature=0))


def check_ownership(bm: BlockManager, requests) -> None:
    """Every block is free, cached or held by as many of `requests` as its ref count."""
    bm.check_invariants(r for r in requests if r.block_ids)
    assert bm.num_free_blocks == sum(1 for c in bm.ref_counts if c == 0)


@pytest.mark.parametrize("num_tokens, block_size, expected", [
    (0, 4, 0), (1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3),
    (1, 16, 1), (16, 16, 1), (17, 16, 2), (1000, 16, 63),
])
def test_blocks_needed_is_ceil(num_tokens, block_size, expected):
    assert blocks_needed(num_tokens, block_size) == expected


def test_new_manager_has_every_block_free():
    bm = BlockManager(7, 4)
    assert bm.num_total_blocks == 7
    assert bm.num_free_blocks == 7
    assert bm.block_size == 4


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40])
def test_allocate_takes_ceil_tokens_over_block_size(num_tokens):
    bm = BlockManager(16, 4)
    r = make_request("a")
    bm.allocate(r, num_tokens)
    assert len(r.block_ids) == -(-num_tokens // 4)
    assert bm.num_free_blocks == 16 - len(r.block_ids)
    check_ownership(bm, [r])


def test_allocate_grows_incrementally_and_never_shrinks():
    bm = BlockManager(10, 4)
    r = make_request("a")
    bm.allocate(r, 5)
    first = list(r.block_ids)
    assert len(first) == 2 and bm.num_free_blocks == 8
    bm.allocate(r, 8)  # still fits in 2 blocks
    assert r.block_ids == first and bm.num_free_blocks == 8
    bm.allocate(r, 9)  # one more block, the old ones kept in place
    assert r.block_ids[:2] == first and len(r.block_ids) == 3 and bm.num_free_blocks == 7
    bm.allocate(r, 3)  # fewer tokens than held: nothing handed back, nothing taken
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 7
    bm.allocate(r, 0)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 7
    check_ownership(bm, [r])


def test_num_new_blocks_counts_only_missing_blocks():
    bm = BlockManager(10, 4)
    r = make_request("a")
    assert bm.num_new_blocks(r, 0) == 0
    assert bm.num_new_blocks(r, 1) == 1
    assert bm.num_new_blocks(r, 9) == 3
    bm.allocate(r, 6)
    assert bm.num_new_blocks(r, 6) == 0
    assert bm.num_new_blocks(r, 8) == 0
    assert bm.num_new_blocks(r, 9) == 1
    assert bm.num_new_blocks(r, 2) == 0


def test_can_allocate_false_when_not_enough_blocks():
    bm = BlockManager(3, 4)
    a, b = make_request("a"), make_request("b")
    assert bm.can_allocate(a, 12)  # exactly the whole cache
    assert not bm.can_allocate(a, 13)
    bm.allocate(a, 8)  # 2 of 3 blocks
    assert bm.can_allocate(b, 4)
    assert not bm.can_allocate(b, 5)
    # For a request that already holds blocks only the missing ones count.
    assert bm.can_allocate(a, 12)
    assert not bm.can_allocate(a, 13)
    bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(make_request("c"), 1)
    assert bm.can_allocate(make_request("c"), 0)
    assert bm.can_allocate(a, 8)  # needs nothing new
    check_ownership(bm, [a, b])


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(3, 4)
    a, b = make_request("a"), make_request("b")
    bm.allocate(a, 8)
    a_blocks = list(a.block_ids)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 5)  # needs 2, 1 free
    assert b.block_ids == []  # no partial allocation
    assert bm.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        bm.allocate(a, 13)  # needs 2 more, 1 free
    assert a.block_ids == a_blocks
    assert bm.num_free_blocks == 1
    check_ownership(bm, [a, b])


def test_free_returns_all_blocks():
    bm = BlockManager(12, 4)
    rs = [make_request(str(i)) for i in range(4)]
    for i, r in enumerate(rs):
        bm.allocate(r, 3 * (i + 1))
    held = sum(len(r.block_ids) for r in rs)
    assert bm.num_free_blocks == 12 - held
    before = bm.num_free_blocks
    n = len(rs[2].block_ids)
    bm.free(rs[2])
    assert rs[2].block_ids == []
    assert bm.num_free_blocks == before + n
    bm.free(rs[2])  # freeing again is a no-op, not a double free
    assert bm.num_free_blocks == before + n
    for r in rs:
        bm.free(r)
    assert bm.num_free_blocks == bm.num_total_blocks == 12
    check_ownership(bm, rs)


def test_free_of_request_without_blocks_is_noop():
    bm = BlockManager(4, 4)
    r = make_request("a")
    bm.free(r)
    assert bm.num_free_blocks == 4
    check_ownership(bm, [r])


def test_freed_blocks_can_be_reused_and_whole_cache_is_usable():
    bm = BlockManager(4, 2)
    a, b = make_request("a"), make_request("b")
    bm.allocate(a, 8)  # the whole cache
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(b, 1)
    bm.free(a)
    assert bm.can_allocate(b, 8)
    bm.allocate(b, 8)
    assert sorted(b.block_ids) == [0, 1, 2, 3]
    check_ownership(bm, [a, b])


def test_no_block_is_handed_to_two_requests_randomized():
    rng = random.Random(1234)
    bm = BlockManager(32, 4)
    live: dict[str, tuple[Request, int]] = {}  # id -> (request, tokens it holds)
    every = []
    for step in range(3000):
        op = rng.random()
        if op < 0.5 or not live:
            rid = f"r{step}"
            r = make_request(rid)
            n = rng.randint(1, 40)
            if bm.can_allocate(r, n):
                bm.allocate(r, n)
                assert len(r.block_ids) == blocks_needed(n, 4)
                live[rid] = (r, n)
                every.append(r)
            else:
                free_before = bm.num_free_blocks
                with pytest.raises(RuntimeError):
                    bm.allocate(r, n)
                assert r.block_ids == [] and bm.num_free_blocks == free_before
        elif op < 0.8:  # grow an existing request
            rid = rng.choice(sorted(live))
            r, n = live[rid]
            n2 = n + rng.randint(1, 9)
            if bm.can_allocate(r, n2):
                bm.allocate(r, n2)
                live[rid] = (r, n2)
                assert len(r.block_ids) == blocks_needed(n2, 4)
        else:
            rid = rng.choice(sorted(live))
            r, _ = live.pop(rid)
            bm.free(r)
            assert r.block_ids == []
        check_ownership(bm, every)
    for r, _ in live.values():
        bm.free(r)
    assert bm.num_free_blocks == bm.num_total_blocks
    check_ownership(bm, every)


# -- prefix caching --------------------------------------------------------------------


def tokens_request(request_id: str, token_ids) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=4, temperature=0))


def admit(bm: BlockManager, request: Request) -> int:
    """Admit `request` as the scheduler does and compute its whole sequence in one step;
    returns the tokens it reused from the cache."""
    computed = bm.cached_prefix(request)
    assert bm.can_allocate(request, request.num_tokens, computed)
    request.num_computed_tokens = len(computed) * bm.block_size
    bm.allocate(request, request.num_tokens, computed)
    reused = request.num_computed_tokens
    request.num_computed_tokens = request.num_tokens  # the step ran
    return reused


def finish(bm: BlockManager, request: Request) -> None:
    bm.free(request)
    request.num_computed_tokens = 0


def test_requests_with_a_common_prefix_share_its_full_blocks():
    bm = BlockManager(16, 4)
    shared = list(range(100, 112))  # 3 full blocks
    a = tokens_request("a", shared + [1, 2])
    b = tokens_request("b", shared + [7])
    assert admit(bm, a) == 0 and len(a.block_ids) == 4
    assert bm.num_cached_blocks == 3  # the partial 4th block has no name
    assert admit(bm, b) == 12
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert [bm.ref_counts[x] for x in b.block_ids] == [2, 2, 2, 1]
    assert bm.num_free_blocks == 16 - 5
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (14 + 13, 12)
    check_ownership(bm, [a, b])


def test_the_last_token_is_always_computed():
    # A prompt of exactly 3 blocks reuses 2: its last token must produce logits, so
    # the block it lands in is computed, not shared.
    bm = BlockManager(16, 4)
    a = tokens_request("a", range(12))
    admit(bm, a)
    assert bm.num_cached_blocks == 3
    b = tokens_request("b", range(12))
    assert bm.cached_prefix(b) == a.block_ids[:2]
    assert admit(bm, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    # b computed a block a already names: the name stays with a's block, b's stays plain.
    assert bm.block_hashes[b.block_ids[2]] is None and bm.num_cached_blocks == 3
    check_ownership(bm, [a, b])
    # A one-token prompt has no full block to reuse.
    assert bm.cached_prefix(tokens_request("c", [0])) == []


def test_a_finished_request_leaves_its_full_blocks_cached():
    bm = BlockManager(8, 4)
    a = tokens_request("a", range(10))  # blocks: full, full, partial
    b = tokens_request("b", range(9))
    admit(bm, a)
    admit(bm, b)  # reuses a's first 2 blocks, computes its 9th token in a new one
    a_blocks = list(a.block_ids)
    finish(bm, a)
    assert [bm.ref_counts[x] for x in a_blocks] == [1, 1, 0]  # still held by b, then free
    assert bm.num_free_blocks == 8 - 3 and bm.num_cached_blocks == 2
    check_ownership(bm, [b])
    finish(bm, b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    check_ownership(bm, [])
    # The cached blocks serve a later request, and taking them back leaves the free queue.
    c = tokens_request("c", list(range(8)) + [50, 51])
    assert admit(bm, c) == 8 and c.block_ids[:2] == a_blocks[:2]
    assert bm.num_free_blocks == 8 - 3
    check_ownership(bm, [c])


def test_cached_blocks_are_evicted_least_recently_freed_first_and_a_request_tail_first():
    bm = BlockManager(6, 2)
    x = tokens_request("x", [1, 2, 3, 4, 5])  # 2 full blocks (x0, x1) and a partial one
    y = tokens_request("y", [6, 7, 8, 9, 10])
    admit(bm, x)
    admit(bm, y)
    x0, x1, _ = x.block_ids
    y0, y1, _ = y.block_ids
    finish(bm, x)
    finish(bm, y)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4

    def still_cached(request_tokens):
        return len(bm.cached_prefix(tokens_request("probe", request_tokens)))

    # Plain blocks go first: two new blocks evict nothing (z names its own full block).
    z = tokens_request("z", [90, 91, 92])
    admit(bm, z)
    assert bm.num_cached_blocks == 5 and set(z.block_ids).isdisjoint({x0, x1, y0, y1})
    # Then the oldest prefix, x, from its tail: x1 goes before x0.
    w = tokens_request("w", [80])
    admit(bm, w)
    assert w.block_ids == [x1] and bm.block_hashes[x1] is None
    assert still_cached([1, 2, 3, 4, 5]) == 1 and still_cached([6, 7, 8, 9, 10]) == 2
    v = tokens_request("v", [70])
    admit(bm, v)
    assert v.block_ids == [x0] and still_cached([1, 2, 3, 4, 5]) == 0
    assert still_cached([6, 7, 8, 9, 10]) == 2
    check_ownership(bm, [z, w, v])


def test_reusing_a_cached_prefix_makes_it_recently_used():
    bm = BlockManager(4, 2)
    x = tokens_request("x", [1, 2, 3])
    y = tokens_request("y", [4, 5, 6])
    admit(bm, x)
    admit(bm, y)
    x0 = x.block_ids[0]
    finish(bm, x)
    finish(bm, y)  # x's prefix is now the older one...
    again = tokens_request("x2", [1, 2, 9])
    assert admit(bm, again) == 2
    finish(bm, again)  # ...until it is used again
    new = tokens_request("n", [7, 8, 9, 10, 11])  # 3 blocks: both plain ones, then y's
    admit(bm, new)
    assert bm.cached_prefix(tokens_request("p", [1, 2, 3])) == [x0]
    assert bm.cached_prefix(tokens_request("p", [4, 5, 6])) == []
    check_ownership(bm, [new])


def test_the_same_block_after_a_different_prefix_is_not_a_hit():
    bm = BlockManager(16, 4)
    admit(bm, tokens_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.cached_prefix(tokens_request("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])) == []
    assert len(bm.cached_prefix(tokens_request("c", [1, 2, 3, 4, 0, 0, 0, 0, 9]))) == 1
    assert len(bm.cached_prefix(tokens_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 0]))) == 2


def test_can_allocate_counts_reused_blocks_nobody_holds_as_taken():
    bm = BlockManager(4, 2)
    a = tokens_request("a", [1, 2, 3, 4, 5])  # 3 blocks, 2 of them full
    admit(bm, a)
    finish(bm, a)
    other = tokens_request("other", [9])
    admit(bm, other)  # 3 blocks left in the free queue: a's 2 cached ones and a plain one
    b = tokens_request("b", [1, 2, 3, 4, 5, 6, 7])  # reuses 2 cached blocks, needs 2 more
    computed = bm.cached_prefix(b)
    assert len(computed) == 2
    assert bm.num_new_blocks(b, 7, computed) == 2
    assert not bm.can_allocate(b, 7, computed)  # 2 reused + 2 new > 3 in the queue
    before = (list(bm.ref_counts), list(bm.block_hashes), list(bm._free), bm.num_query_tokens)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 7, computed)
    assert b.block_ids == [] and before == (list(bm.ref_counts), list(bm.block_hashes), list(bm._free),
                                            bm.num_query_tokens)
    c = tokens_request("c", [1, 2, 3, 4, 5])  # 2 reused + 1 new: fits, and the new
    assert admit(bm, c) == 4                    # block does not evict a reused one
    assert c.block_ids[:2] == computed and bm.num_free_blocks == 0
    check_ownership(bm, [other, c])


def test_allocate_names_only_the_blocks_the_step_fills():
    # A chunk of 6 tokens of a 10-token prompt fills 1 block of 4 (the 2nd is half written).
    bm = BlockManager(8, 4)
    a = tokens_request("a", range(10))
    bm.allocate(a, 6)
    assert [bm.block_hashes[x] is not None for x in a.block_ids] == [True, False]
    a.num_computed_tokens = 6
    bm.allocate(a, 10)
    assert [bm.block_hashes[x] is not None for x in a.block_ids] == [True, True, False]
    check_ownership(bm, [a])


def test_disabled_prefix_caching_never_hashes_or_shares():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a, b = tokens_request("a", range(13)), tokens_request("b", range(13))
    assert admit(bm, a) == 0 and admit(bm, b) == 0
    assert set(a.block_ids).isdisjoint(b.block_ids)
    assert a.block_hashes == [] and bm.block_hashes == [None] * 16
    assert (bm.num_cached_blocks, bm.num_query_tokens, bm.num_hit_tokens) == (0, 0, 0)
    finish(bm, a)
    assert bm.cached_prefix(tokens_request("c", range(13))) == []
    check_ownership(bm, [b])


def test_check_invariants_catches_a_leaked_or_doubly_held_block():
    bm = BlockManager(4, 2)
    a = tokens_request("a", [1, 2, 3])
    admit(bm, a)
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # a's blocks are held by nobody it was told of: a leak
    with pytest.raises(AssertionError):
        bm.check_invariants([a, a])
    bm.check_invariants([a])
