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
    """Every block id is free or owned by exactly one request, never both or neither."""
    owned = [b for r in requests for b in r.block_ids]
    free = list(bm._free)  # the free list itself: catches a block freed twice
    assert len(owned) == len(set(owned)), f"a block is owned by two requests: {sorted(owned)}"
    assert len(free) == len(set(free)), f"a block is in the free list twice: {sorted(free)}"
    assert not set(owned) & set(free), "a block is both owned and free"
    assert sorted(owned + free) == list(range(bm.num_total_blocks))
    assert bm.num_free_blocks == len(free)


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
