"""Prefix caching through the scheduler and EngineCore, over the fake executor
(tests/engine/harness.py): no model, no torch. The harness checks the block manager's
invariants and the fake KV cache's contents at every step, and the fake model's tokens
depend on what the cache holds, so a wrongly reused block changes the outputs."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from gristmill.config import EngineConfig
from gristmill.engine.messages import AddRequest
from gristmill.errors import RequestError
from gristmill.sampling import SamplingParams
from tests.engine.harness import Harness, prompt


def test_a_request_after_a_finished_one_computes_only_the_new_suffix():
    h = Harness(block_size=4, num_blocks=32)
    system = prompt(1, 16)
    h.add("a", system + prompt(2, 5), max_tokens=3)
    h.run()
    b = h.add("b", system + prompt(3, 6), max_tokens=3)
    rec, _ = h.step()
    assert (rec.item("b").start, rec.item("b").num_new) == (16, 6)
    assert b.block_ids[:4] == list(rec.item("b").block_ids[:4])
    h.run()
    for rid in "ab":
        h.check_matches_reference(rid)
    stats = h.core.stats()
    assert stats["prefix_cache_hits"] == 16
    assert stats["prefix_cache_queries"] == 21 + 22
    assert stats["prefix_cache_hit_rate"] == pytest.approx(16 / 43)
    assert stats["num_cached_blocks"] > 0
    h.check_all_done()


def test_a_reset_prefix_cache_makes_the_next_request_compute_its_whole_prompt():
    h = Harness(block_size=4, num_blocks=32)
    system = prompt(1, 16)
    h.add("a", system + prompt(2, 5), max_tokens=30)
    h.step()
    assert h.core.reset_prefix_cache() is False  # a request runs: nothing changes
    assert h.core.stats()["num_cached_blocks"] > 0
    h.run()
    assert h.core.reset_prefix_cache() is True
    assert h.core.stats()["num_cached_blocks"] == 0
    h.add("b", system + prompt(3, 6), max_tokens=3)
    rec, _ = h.step()
    assert (rec.item("b").start, rec.item("b").num_new) == (0, 22)
    h.run()
    for rid in "ab":
        h.check_matches_reference(rid)
    assert h.core.stats()["prefix_cache_hits"] == 0
    h.check_all_done()


def test_completions_of_one_prompt_admitted_in_one_step_share_its_blocks():
    # n > 1 becomes n requests with the same prompt. The first computes the prompt's
    # full blocks in this step; the others reuse them in the same step, since the model
    # writes every key and value of a step before any attention reads them.
    h = Harness(block_size=4, num_blocks=32, max_num_batched_tokens=64)
    p = prompt(7, 14)  # 3 full blocks, then 2 tokens
    for rid in ("n0", "n1", "n2"):
        h.add(rid, p, max_tokens=4)
    rec, _ = h.step()
    assert [(i.request_id, i.start, i.num_new) for i in rec.items] == [("n0", 0, 14), ("n1", 12, 2), ("n2", 12, 2)]
    shared = rec.item("n0").block_ids[:3]
    assert rec.item("n1").block_ids[:3] == rec.item("n2").block_ids[:3] == shared
    assert [h.bm.ref_counts[b] for b in shared] == [3, 3, 3]
    h.run()
    outputs = {rid: h.check_matches_reference(rid) for rid in ("n0", "n1", "n2")}
    assert outputs["n0"] == outputs["n1"] == outputs["n2"]  # greedy: the same completion
    h.check_all_done()


def test_a_request_reuses_blocks_of_a_prefill_still_in_chunks():
    # b shares a's first 24 tokens (6 blocks). It is admitted in the step of a's last
    # chunk and reuses the blocks a's first chunk filled and those this step fills.
    h = Harness(block_size=4, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=2)
    p = prompt(8, 26)
    h.add("a", p, max_tokens=2)
    rec, _ = h.step()
    assert [(i.request_id, i.start, i.num_new) for i in rec.items] == [("a", 0, 16)]
    h.add("b", p[:24] + prompt(9, 5), max_tokens=2)
    rec, _ = h.step()
    assert [(i.request_id, i.start, i.num_new) for i in rec.items] == [("a", 16, 10), ("b", 24, 5)]
    assert rec.item("b").block_ids[:6] == rec.item("a").block_ids[:6]
    h.run()
    for rid in "ab":
        h.check_matches_reference(rid)
    h.check_all_done()


def test_a_preempted_request_comes_back_to_its_cached_blocks():
    # 6 blocks of 4. c (13 tokens: 3 full blocks and a partial one) is preempted when a
    # needs a 3rd block; a takes c's partial block (a plain block goes first), so c's
    # full blocks stay cached, and when a finishes c comes back to them.
    h = Harness(block_size=4, num_blocks=6, max_num_seqs=2, max_num_batched_tokens=64)
    a = h.add("a", prompt(1, 8), max_tokens=2)
    c = h.add("c", prompt(2, 13), max_tokens=3)
    rec, _ = h.step()
    assert rec.ids == ["a", "c"] and h.bm.num_free_blocks == 0
    c_blocks = list(c.block_ids)
    rec, _ = h.step()
    assert rec.preempted == ["c"] and rec.item("a").block_ids[2] == c_blocks[3] and a.is_finished
    rec, _ = h.step()
    item = rec.item("c")
    assert (item.start, item.num_new) == (12, 2)  # its 14 tokens, 12 of them reused
    assert list(item.block_ids[:3]) == c_blocks[:3]
    h.run()
    for rid in "ac":
        h.check_matches_reference(rid)
    h.check_all_done()


@pytest.mark.parametrize("how", ["abort", "abort_during_step", "error"])
def test_a_request_ended_mid_prefill_leaves_only_its_computed_full_blocks_cached(how):
    # Chunks of 6 tokens of a 30-token prompt, blocks of 4: after 2 chunks (12 tokens)
    # blocks 0-2 are full; nothing past them may be reused.
    h = Harness(block_size=4, num_blocks=32, max_num_batched_tokens=6, max_num_seqs=4)
    p = prompt(5, 30)
    a = h.add("a", p, max_tokens=3)
    h.step()
    if how == "abort_during_step":  # the second chunk ran; its result arrives after the abort
        h.step(abort_during=["a"])
    else:
        h.step()
        assert a.num_computed_tokens == 12
        if how == "abort":
            h.abort("a")
        else:  # the core ends a request with "error" (here: its id sent again)
            assert h.core.add_request(AddRequest("a", [1], SamplingParams(max_tokens=1), frozenset()))
    assert a.is_finished and h.bm.num_cached_blocks == 3
    b = h.add("b", p, max_tokens=3)
    rec, _ = h.step()
    assert (rec.item("b").start, rec.item("b").num_new) == (12, 6)
    h.run()
    h.check_matches_reference("b")
    h.check_all_done()


def _shared_prefix_workload(h: Harness, seed: int = 3) -> None:
    rng = random.Random(seed)
    prefixes = [prompt(100 + i, rng.randint(4, 20)) for i in range(3)]
    for i in range(24):
        h.add(f"r{i}", rng.choice(prefixes) + prompt(rng.random(), rng.randint(1, 9)),
              max_tokens=rng.randint(1, 8))


def test_outputs_are_the_same_with_prefix_caching_off_and_it_computes_fewer_tokens():
    runs = {}
    for enabled in (True, False):
        h = Harness(block_size=4, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=24,
                    enable_prefix_caching=enabled)
        _shared_prefix_workload(h)
        h.run()
        for rid in h.all:
            h.check_matches_reference(rid)
        h.check_all_done()
        computed = sum(i.num_new for rec in h.executor.steps for i in rec.items)
        runs[enabled] = ({rid: r.output_token_ids for rid, r in h.all.items()}, computed, h.core.stats())
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1]
    on, off = runs[True][2], runs[False][2]
    assert on["prefix_cache_hits"] == runs[False][1] - runs[True][1] > 0
    assert 0 < on["prefix_cache_hit_rate"] < 1 and on["num_cached_blocks"] > 0
    assert (off["prefix_cache_hits"], off["prefix_cache_queries"], off["num_cached_blocks"]) == (0, 0, 0)
    assert off["prefix_cache_hit_rate"] == 0.0


def test_enable_prefix_caching_must_be_a_bool():
    with pytest.raises(RequestError, match="enable_prefix_caching") as raised:
        EngineConfig(enable_prefix_caching="no")
    assert raised.value.param == "enable_prefix_caching"


@pytest.mark.parametrize("cfg", [
    dict(block_size=4, num_blocks=20, max_num_seqs=6, max_num_batched_tokens=16),
    dict(block_size=2, num_blocks=36, max_num_seqs=8, max_num_batched_tokens=8),
    dict(block_size=8, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64),
], ids=["bs4", "bs2-tight-budget", "bs8-small-cache"])
def test_randomized_stress_with_shared_prefixes(cfg):
    # Prompts from a few shared prefixes (some whole prompts repeated), random aborts
    # between and during steps, and a cache small enough to preempt and evict. The
    # harness checks every invariant after every step.
    rng = random.Random(20240612 + cfg["block_size"])
    vocab = 50
    h = Harness(max_model_len=256, vocab=vocab, **cfg)
    prefixes = [prompt(rng.random(), rng.randint(1, 24), vocab) for _ in range(4)]
    num_requests, next_id, steps = 250, 0, 0
    aborted = set()
    came_back_to_cache = 0
    while next_id < num_requests or h.core.has_unfinished:
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if next_id >= num_requests:
                break
            suffix = prompt(rng.random(), rng.choice([0, 1, 3, 7, 12]), vocab)
            h.add(f"r{next_id}", (rng.choice(prefixes) + suffix) or [1], max_tokens=rng.randint(1, 20),
                  eos={vocab + 1})
            next_id += 1
        live = sorted(h.sched.requests)
        abort_during = []
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            h.abort(rid)
            aborted.add(rid)
            live.remove(rid)
        if live and rng.random() < 0.03:
            abort_during = [rng.choice(live)]
            aborted.update(abort_during)
        waiting = {r.request_id for r in h.sched.waiting}
        rec, _ = h.step(abort_during=abort_during)
        came_back_to_cache += sum(1 for i in rec.items if i.request_id in waiting and i.start > 0
                                  and h.all[i.request_id].num_preemptions > 0)
        steps += 1
        assert steps < 50_000, "did not finish: livelock?"

    for rid, r in h.all.items():
        expected, reason = h.reference(rid)
        if rid in aborted:
            assert r.output_token_ids == expected[:len(r.output_token_ids)]
        else:
            assert (r.output_token_ids, r.finish_reason) == (expected, reason), rid
    # Everything finished: every block is free or cached, and each cached block still
    # holds what its hash names (the harness compares contents at every step).
    assert h.bm.num_free_blocks == h.bm.num_total_blocks
    h.bm.check_invariants([])
    reasons = defaultdict(int)
    for r in h.all.values():
        reasons[r.finish_reason] += 1
    # The scenario exercised what it is meant to.
    stats = h.core.stats()
    assert stats["prefix_cache_hits"] > 0
    assert h.num_preemptions > 0 and came_back_to_cache > 0 and reasons["abort"] > 0
    evicted = [key for key in h.hashed_content if h.bm.block_hashes[key[0]] != key[1]]
    assert evicted, "no cached block was ever evicted"
    h.check_all_done()
