"""Scheduler and EngineCore tests with a fake executor (tests/engine/harness.py): no
model, no torch. Every step is checked against the scheduler's invariants."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

import gristmill.engine
from gristmill.engine.kv_blocks import blocks_needed
from gristmill.engine.messages import AddRequest
from gristmill.engine.request import Request, RequestStatus
from gristmill.engine.scheduler import Scheduler
from gristmill.errors import RequestError
from gristmill.sampling import SamplingParams
from gristmill.step import StepTokens
from tests.engine.harness import EOS, VOCAB, Harness, prompt, step_tokens


def test_engine_imports_no_torch():
    # The engine package is the CPU control plane: importing it (and these tests' other
    # imports) must not pull in torch. Checked in a fresh interpreter, since other test
    # modules in the same run may import torch.
    modules = sorted(f"gristmill.engine.{p.stem}" for p in Path(gristmill.engine.__file__).parent.glob("*.py")
                     if p.stem != "__init__")
    assert "gristmill.engine.async_engine" in modules and "gristmill.engine.builder" in modules
    # A structured-output constraint is checked where SamplingParams are built: no torch either.
    code = (f"import sys, {', '.join(modules)}, gristmill.tokenizer, gristmill.config, gristmill.sampling; "
            "gristmill.sampling.SamplingParams(structured_output={'json': {'type': 'object'}}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- budgets and chunked prefill ----------------------------------------------------


def test_long_prompt_is_chunked_and_nothing_sampled_before_prefill_completes():
    h = Harness(max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64, block_size=4)
    a = h.add("a", prompt(1, 50), max_tokens=3)
    for expected_start, expected_new in [(0, 16), (16, 16), (32, 16)]:
        rec, updates = h.step()
        assert rec.items == [rec.item("a")]
        item = rec.item("a")
        assert (item.start, item.num_new, item.samples) == (expected_start, expected_new, False)
        assert updates == [] and rec.sampled == {}
        assert a.num_output_tokens == 0
        assert a.num_computed_tokens == expected_start + expected_new
        assert len(a.block_ids) == blocks_needed(a.num_computed_tokens, 4)
    rec, updates = h.step()
    item = rec.item("a")
    assert (item.start, item.num_new, item.samples) == (48, 2, True)
    assert [u.request_id for u in updates] == ["a"] and a.num_output_tokens == 1
    for _ in range(2):  # then decode, one token a step
        rec, updates = h.step()
        assert rec.item("a").num_new == 1 and rec.item("a").samples
    assert a.finish_reason == "length" and a.num_output_tokens == 3
    h.check_matches_reference("a")
    h.check_all_done()


def test_chunked_output_equals_unchunked_output():
    outputs = {}
    for budget in (8, 13, 512):
        h = Harness(max_num_batched_tokens=budget, max_num_seqs=4, num_blocks=128)
        for i in range(4):
            h.add(f"r{i}", prompt(10 + i, 30 + 11 * i), max_tokens=6)
        h.run()
        outputs[budget] = {rid: r.output_token_ids for rid, r in h.all.items()}
        for rid in h.all:
            h.check_matches_reference(rid)
        h.check_all_done()
    assert outputs[8] == outputs[13] == outputs[512]


def test_budgets_respected_every_step():
    h = Harness(max_num_batched_tokens=20, max_num_seqs=3, num_blocks=128, block_size=4)
    rng = random.Random(7)
    for i in range(12):
        h.add(f"r{i}", prompt(i, rng.randint(1, 45)), max_tokens=rng.randint(1, 10))
    max_running, full_steps, seqs_bound = 0, 0, False
    while h.core.has_unfinished:
        rec, _ = h.step()
        assert sum(i.num_new for i in rec.items) <= 20
        assert len(rec.items) <= 3
        assert len(h.sched.running) <= 3
        max_running = max(max_running, len(rec.items))
        full_steps += sum(i.num_new for i in rec.items) == 20
        seqs_bound |= len(rec.items) == 3 and len(h.sched.waiting) > 0
    assert max_running == 3 and seqs_bound, "max_num_seqs never bound: the test is too easy"
    assert full_steps > 0, "the token budget never bound: the test is too easy"
    for rid in h.all:
        h.check_matches_reference(rid)
    h.check_all_done()


def test_decodes_of_running_requests_are_scheduled_before_new_prefills():
    h = Harness(max_num_batched_tokens=8, max_num_seqs=4, num_blocks=64, block_size=4)
    a = h.add("a", prompt(1, 4), max_tokens=10)
    rec, _ = h.step()
    assert [(i.request_id, i.num_new, i.samples) for i in rec.items] == [("a", 4, True)]
    h.add("b", prompt(2, 20), max_tokens=3)
    plan = [[("a", 1, True), ("b", 7, False)],
            [("a", 1, True), ("b", 7, False)],
            [("a", 1, True), ("b", 6, True)],
            [("a", 1, True), ("b", 1, True)]]
    for expected in plan:
        out_before = a.num_output_tokens
        rec, _ = h.step()
        assert [(i.request_id, i.num_new, i.samples) for i in rec.items] == expected
        assert a.num_output_tokens == out_before + 1  # a never waits for b's prefill
    h.run()
    h.check_matches_reference("a")
    h.check_matches_reference("b")
    h.check_all_done()


def test_decodes_not_starved_when_budget_equals_max_num_seqs():
    h = Harness(max_num_batched_tokens=4, max_num_seqs=4, num_blocks=64, block_size=4)
    for rid in "abc":
        h.add(rid, prompt(ord(rid), 1), max_tokens=20)
    rec, _ = h.step()
    assert [(i.request_id, i.num_new) for i in rec.items] == [("a", 1), ("b", 1), ("c", 1)]
    h.add("d", prompt(4, 10), max_tokens=2)
    for step in range(10):
        rec, _ = h.step()
        assert [(i.request_id, i.num_new) for i in rec.items] == [
            ("a", 1), ("b", 1), ("c", 1), ("d", 1)]
        assert rec.item("d").samples == (step == 9)
    h.run()
    for rid in "abcd":
        h.check_matches_reference(rid)
    h.check_all_done()


# -- continuous batching -------------------------------------------------------------


def test_requests_join_running_batch_and_finished_ones_leave_at_once():
    h = Harness(max_num_batched_tokens=64, max_num_seqs=8, num_blocks=64, block_size=4)
    a = h.add("a", prompt(1, 5), max_tokens=6)
    h.step()
    h.step()
    assert a.num_output_tokens == 2
    b = h.add("b", prompt(2, 3), max_tokens=8)
    rec, updates = h.step()
    # b joins the running batch right away, next to a's decode, and samples at once.
    assert [(i.request_id, i.num_new) for i in rec.items] == [("a", 1), ("b", 3)]
    assert {u.request_id for u in updates} == {"a", "b"}
    assert [r.request_id for r in h.sched.running] == ["a", "b"]
    # Run until a finishes.
    while not a.is_finished:
        rec, updates = h.step()
        assert "b" in rec.ids
    a_blocks = rec.item("a").block_ids
    assert a.finish_reason == "length" and a.num_output_tokens == 6
    assert a.block_ids == [] and set(a_blocks) <= set(h.bm._free)
    assert h.bm.num_free_blocks == h.bm.num_total_blocks - len(b.block_ids)
    assert [r.request_id for r in h.sched.running] == ["b"] and "a" not in h.sched.requests
    c = h.add("c", prompt(3, 9), max_tokens=4)
    rec, _ = h.step()
    assert rec.finished == ["a"]  # the runner is told to drop a's state
    assert rec.ids == ["b", "c"]
    n_steps = len(h.executor.steps)
    h.run()
    assert all("a" not in r.ids for r in h.executor.steps[n_steps - 1:])
    for rid in "abc":
        h.check_matches_reference(rid)
    assert c.finish_reason == "length"
    h.check_all_done()


def test_batched_outputs_equal_solo_outputs():
    prompts = {f"r{i}": prompt(100 + i, 3 + 7 * i) for i in range(6)}
    batched = Harness(max_num_batched_tokens=32, max_num_seqs=6, num_blocks=128)
    for rid, p in prompts.items():
        batched.add(rid, p, max_tokens=9)
    batched.run()
    batched.check_all_done()
    for rid, p in prompts.items():
        solo = Harness(max_num_batched_tokens=32, max_num_seqs=6, num_blocks=128)
        solo.add(rid, p, max_tokens=9)
        solo.run()
        assert solo.all[rid].output_token_ids == batched.all[rid].output_token_ids
        solo.check_all_done()


def test_duplicate_live_request_id_ends_both_and_the_core_goes_on():
    h = Harness()
    first = h.add("a", prompt(1, 4), max_tokens=2)
    h.add("b", prompt(2, 4), max_tokens=2)
    h.step()
    refused = h.core.add_request(AddRequest("a", [1, 2], SamplingParams(max_tokens=2, temperature=0),
                                            frozenset()))
    assert isinstance(refused, RequestError) and refused.param == "request_id"
    assert str(refused).startswith("request id 'a' was sent while a request with that id")
    assert first.is_finished and first.finish_reason == "error" and first.block_ids == []
    assert "a" not in h.sched.requests
    h.check_invariants()
    h.run()
    h.check_matches_reference("b")
    h.check_all_done()


@pytest.mark.parametrize("message,says", [
    (AddRequest("", [1], SamplingParams(max_tokens=2), frozenset()), "request_id must be a non-empty string"),
    (AddRequest("x", [1, "2"], SamplingParams(max_tokens=2), frozenset()), "list of token ids"),
    (AddRequest("x", [], SamplingParams(max_tokens=2), frozenset()), "token list is empty"),
    (AddRequest("x", [VOCAB + 3], SamplingParams(max_tokens=2), frozenset()), "outside the vocabulary"),
    (AddRequest("x", [1], {"max_tokens": 2}, frozenset()), "sampling_params must be SamplingParams"),
    (AddRequest("x", [1], SamplingParams(max_tokens=2, n=2), frozenset()), "one completion per request"),
    (AddRequest("x", [1] * 250, SamplingParams(max_tokens=20), frozenset()), "exceeds max_model_len"),
    (AddRequest("x", [1], SamplingParams(max_tokens=2), [5]), "eos_token_ids must be a set"),
])
def test_malformed_add_request_is_refused_and_the_core_goes_on(message, says):
    h = Harness()
    h.add("ok", prompt(3, 5), max_tokens=3)
    refused = h.core.add_request(message)
    assert isinstance(refused, RequestError) and says in str(refused)
    assert set(h.sched.requests) == {"ok"}
    h.check_invariants()
    h.run()
    h.check_matches_reference("ok")
    h.check_all_done()


# -- preemption ----------------------------------------------------------------------


def _preemption_workload(h):
    for i, rid in enumerate("abc"):
        h.add(rid, prompt(20 + i, 6), max_tokens=10)
    h.add("d", prompt(30, 5), max_tokens=5)


def test_preemption_with_tiny_cache_resumes_with_same_output():
    # 6 blocks of 4 tokens; a, b, c each end at 16 tokens (4 blocks): they cannot all fit.
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    _preemption_workload(h)
    rec, _ = h.step()
    assert rec.ids == ["a", "b", "c"] and [r.request_id for r in h.sched.waiting] == ["d"]
    assert h.bm.num_free_blocks == 0
    while not rec.preempted:
        outputs_before = list(h.all["c"].output_token_ids)
        running_before = [r.request_id for r in h.sched.running]
        rec, _ = h.step()
    c = h.all["c"]
    assert running_before == ["a", "b", "c"]
    assert rec.preempted == ["c"]  # the newest running request
    assert rec.ids == ["a", "b"]
    assert c.status is RequestStatus.WAITING and c.block_ids == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert c.output_token_ids == outputs_before and len(outputs_before) > 0
    assert [r.request_id for r in h.sched.waiting] == ["c", "d"]  # at the FRONT of waiting
    assert h.bm.num_free_blocks + sum(len(h.all[x].block_ids) for x in "ab") == 6

    # Resumed later: recomputed from scratch, prompt and generated tokens in one go.
    num_tokens_at_preemption = c.num_tokens
    while True:
        rec, _ = h.step()
        item = rec.item("c")
        if item is not None:
            break
    assert item.start == 0 and item.num_new == num_tokens_at_preemption and item.samples
    h.run()
    assert h.num_preemptions >= 1
    small = {rid: r.output_token_ids for rid, r in h.all.items()}
    assert all(r.finish_reason == "length" for r in h.all.values())
    h.check_all_done()

    big = Harness(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    _preemption_workload(big)
    big.run()
    assert big.num_preemptions == 0
    assert {rid: r.output_token_ids for rid, r in big.all.items()} == small
    for rid in "abcd":
        big.check_matches_reference(rid)
        assert len(small[rid]) == big.all[rid].sampling_params.max_tokens
    big.check_all_done()


def test_preemption_of_several_requests_keeps_their_order():
    # Four requests grow in lockstep and fill the cache (8 blocks of 2 tokens); when
    # they all cross a block boundary together the two newest must make room.
    h = Harness(num_blocks=8, block_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    for rid in "abcd":
        h.add(rid, prompt(ord(rid), 3), max_tokens=10)
    h.add("w", prompt(9, 3), max_tokens=3)
    rec, _ = h.step()  # 3 prompt tokens each: 2 blocks each, the whole cache
    assert rec.ids == ["a", "b", "c", "d"] and h.bm.num_free_blocks == 0
    rec, _ = h.step()  # the 4th token still fits in 2 blocks
    assert rec.ids == ["a", "b", "c", "d"] and rec.preempted == []
    rec, _ = h.step()  # the 5th token needs a 3rd block for everyone
    # a takes a block from d's two, b the other; c then finds nothing and is preempted
    # itself. Newest first, and back in the waiting queue in their original order.
    assert rec.preempted == ["d", "c"]
    assert rec.ids == ["a", "b"]
    assert [r.request_id for r in h.sched.waiting] == ["c", "d", "w"]
    for rid in "cd":
        r = h.all[rid]
        assert r.num_computed_tokens == 0 and r.block_ids == [] and r.num_output_tokens == 2
    h.run()
    for rid in "abcdw":
        h.check_matches_reference(rid)
    h.check_all_done()


# -- stop conditions -----------------------------------------------------------------


def test_eos_ends_with_stop():
    h = Harness(script={"a": {2: EOS}})
    a = h.add("a", prompt(1, 5), max_tokens=10)
    h.run()
    assert a.finish_reason == "stop"
    assert len(a.output_token_ids) == 3 and a.output_token_ids[-1] == EOS
    assert [u.finish_reason for u in h.updates["a"]] == [None, None, "stop"]
    h.check_matches_reference("a")
    h.check_all_done()


def test_eos_as_first_token_stops_at_prefill():
    h = Harness(script={"a": {0: EOS}})
    a = h.add("a", prompt(1, 5), max_tokens=10)
    rec, updates = h.step()
    assert a.finish_reason == "stop" and a.output_token_ids == [EOS]
    assert [(u.new_token_ids, u.finish_reason) for u in updates] == [([EOS], "stop")]
    h.check_all_done()


def test_any_of_several_eos_ids_stops():
    h = Harness(script={"a": {1: EOS + 1}})
    a = h.add("a", prompt(1, 5), max_tokens=10, eos={EOS, EOS + 1})
    h.run()
    assert a.finish_reason == "stop" and a.output_token_ids[-1] == EOS + 1
    assert a.num_output_tokens == 2
    h.check_all_done()


def test_ignore_eos_keeps_going_until_max_tokens():
    h = Harness(script={"a": {2: EOS}})
    a = h.add("a", prompt(1, 5), max_tokens=6, ignore_eos=True)
    h.run()
    assert a.finish_reason == "length"
    assert a.num_output_tokens == 6 and a.output_token_ids[2] == EOS
    h.check_matches_reference("a")
    h.check_all_done()


def test_stop_token_ids_end_with_stop():
    h = Harness(script={"a": {1: 42}, "b": {3: 42}, "c": {1: 42}})
    a = h.add("a", prompt(1, 5), max_tokens=10, stop_token_ids=[7, 42])
    # stop_token_ids are not EOS: ignore_eos does not disable them.
    b = h.add("b", prompt(2, 5), max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    # 42 without being a stop id is an ordinary token.
    c = h.add("c", prompt(3, 5), max_tokens=4)
    h.run()
    assert a.finish_reason == "stop" and a.num_output_tokens == 2 and a.output_token_ids[-1] == 42
    assert b.finish_reason == "stop" and b.num_output_tokens == 4 and b.output_token_ids[-1] == 42
    assert c.finish_reason == "length" and c.num_output_tokens == 4 and c.output_token_ids[1] == 42
    for rid in "abc":
        h.check_matches_reference(rid)
    h.check_all_done()


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_ends_with_length(max_tokens):
    h = Harness()
    a = h.add("a", prompt(1, 5), max_tokens=max_tokens)
    steps = h.run()
    assert steps == max_tokens  # one prefill step, then one decode step per token
    assert a.finish_reason == "length" and a.num_output_tokens == max_tokens
    assert [u.finish_reason for u in h.updates["a"]] == [None] * (max_tokens - 1) + ["length"]
    h.check_matches_reference("a")
    h.check_all_done()


def test_max_model_len_ends_with_length():
    # The core refuses such a request (clients check it too), so the scheduler's own
    # limit is reached only by a request added to it directly.
    h = Harness(max_model_len=12)
    a = Request("a", prompt(1, 8), SamplingParams(max_tokens=100, temperature=0), frozenset({EOS}))
    h.sched.add_request(a)
    h.all["a"] = a
    h.run()
    assert a.finish_reason == "length"
    assert a.num_tokens == 12 and a.num_output_tokens == 4
    h.check_matches_reference("a")
    h.check_all_done()


# -- abort ---------------------------------------------------------------------------


def test_abort_waiting_request():
    h = Harness(max_num_seqs=1, max_num_batched_tokens=16)
    h.add("a", prompt(1, 5), max_tokens=4)
    b = h.add("b", prompt(2, 5), max_tokens=4)
    h.step()
    assert b.status is RequestStatus.WAITING
    free = h.bm.num_free_blocks
    h.abort("b")  # checks blocks, queues and status
    assert h.bm.num_free_blocks == free
    rec, _ = h.step()
    assert rec.finished == ["b"] and "b" not in rec.ids
    h.run()
    assert all("b" not in r.ids for r in h.executor.steps)
    assert b.finish_reason == "abort" and b.output_token_ids == []
    h.check_matches_reference("a")
    h.check_all_done()


def test_abort_running_request_frees_blocks_immediately():
    h = Harness(max_num_batched_tokens=64, num_blocks=32)
    a = h.add("a", prompt(1, 9), max_tokens=20)
    h.add("b", prompt(2, 6), max_tokens=8)
    h.step()
    h.step()
    n_steps = len(h.executor.steps)
    assert a.status is RequestStatus.RUNNING and len(a.block_ids) == 3
    free = h.bm.num_free_blocks
    outputs = list(a.output_token_ids)
    h.abort("a")
    assert h.bm.num_free_blocks == free + 3
    rec, _ = h.step()
    assert rec.finished == ["a"] and rec.ids == ["b"]
    h.run()
    assert all("a" not in r.ids for r in h.executor.steps[n_steps:])
    assert a.output_token_ids == outputs and a.finish_reason == "abort"
    h.check_matches_reference("b")
    h.check_all_done()


def test_abort_during_chunked_prefill():
    h = Harness(max_num_batched_tokens=8, num_blocks=32)
    a = h.add("a", prompt(1, 30), max_tokens=3)
    h.step()
    assert 0 < a.num_computed_tokens < a.num_tokens and a.block_ids
    h.abort("a")
    h.step()
    h.check_all_done()
    assert a.output_token_ids == []


def test_abort_while_step_runs_drops_its_result():
    h = Harness(max_num_batched_tokens=64, num_blocks=32)
    a = h.add("a", prompt(1, 9), max_tokens=20)
    h.add("b", prompt(2, 6), max_tokens=5)
    h.step()
    n_steps = len(h.executor.steps)
    outputs = list(a.output_token_ids)
    rec, updates = h.step(abort_during=["a"])  # a was scheduled and sampled, then aborted
    assert "a" in rec.sampled
    assert [u.request_id for u in updates] == ["b"]
    assert a.output_token_ids == outputs and a.block_ids == []
    h.run()
    assert all("a" not in r.ids for r in h.executor.steps[n_steps + 1:])
    h.check_matches_reference("b")
    h.check_all_done()


def test_abort_of_preempted_request():
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    _preemption_workload(h)
    while True:
        rec, _ = h.step()
        if rec.preempted:
            break
    n_steps = len(h.executor.steps)
    h.abort("c")
    h.run()
    assert all("c" not in r.ids for r in h.executor.steps[n_steps:])
    for rid in "abd":
        h.check_matches_reference(rid)
    h.check_all_done()


def test_abort_unknown_or_finished_request_is_noop():
    h = Harness()
    a = h.add("a", prompt(1, 3), max_tokens=2)
    assert h.sched.finish_request("nope", "abort") is None
    h.run()
    assert h.sched.finish_request("a", "abort") is None
    assert a.finish_reason == "length"
    h.check_all_done()


# -- scheduler without EngineCore ----------------------------------------------------


def test_scheduler_direct_api():
    from gristmill.engine.kv_blocks import BlockManager
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    r = Request("x", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0),
                eos_token_ids=frozenset({EOS}))
    sched.add_request(r)
    assert list(sched.waiting) == [r] and sched.requests == {"x": r}
    out = sched.schedule()
    assert out.num_tokens == 3 and len(out.scheduled) == 1
    assert out.scheduled[0].samples and out.scheduled[0].num_new_tokens == 3
    assert sched.running == [r] and not sched.waiting
    assert sched.update(out, step_tokens({"x": 11}))[0].finish_reason is None
    out = sched.schedule()
    assert out.num_tokens == 1
    (update,) = sched.update(out, step_tokens({"x": 12}))
    assert update.new_token_ids == [12] and update.finish_reason == "length"
    assert r.output_token_ids == [11, 12]
    assert bm.num_free_blocks == 8 and sched.requests == {} and not sched.running
    out = sched.schedule()
    assert out.scheduled == [] and out.finished_request_ids == ["x"]


def test_a_pooling_request_is_one_step_with_no_sampling_params_and_no_token_after_its_prompt():
    # A pooling request does not pretend to generate: no SamplingParams, no placeholder
    # token appended after its prompt while its step runs, no token ids in its result.
    from gristmill.engine.kv_blocks import BlockManager
    from gristmill.pooling_params import PoolingParams
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    pooled = [Request(name, [first, 6, 7, 8, 9], None, pooling=PoolingParams(), send_at_end=True)
              for name, first in (("a", 5), ("b", 4))]
    for r in pooled:
        sched.add_request(r)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens, s.samples, s.sampling_params) for s in out.scheduled] == \
        [("a", 5, True, None), ("b", 5, True, None)]
    sched.advance(out)
    assert out.num_sampled == 2 and all(r.token_ids == r.prompt_token_ids and not r.pending for r in pooled)
    assert sched.schedule().scheduled == []  # (async scheduling: its step is not scheduled again)
    with pytest.raises(RuntimeError, match="1 request ids and 1 pooled results for a step of 2 rows"):
        sched.resolve(out, StepTokens(["a"], [], [], pooled=["va"]))
    updates = sched.resolve(out, StepTokens(["a", "b"], [], [], pooled=["va", "vb"]))
    assert [(u.request_id, u.new_token_ids, u.finish_reason, u.pooled) for u in updates] == \
        [("a", [], "stop", "va"), ("b", [], "stop", "vb")]
    assert all(r.token_ids == r.prompt_token_ids and r.is_finished for r in pooled)
    assert bm.num_free_blocks == 8 and sched.requests == {} and not sched.running


# -- randomized stress ---------------------------------------------------------------


def test_a_step_is_plain_only_while_every_unfinished_request_is_plain_greedy():
    # `SchedulerOutput.plain` lets the runner take the forward's argmax without looking at
    # any row: it must be False whenever any request in the engine samples, wants
    # logprobs or has a logits control, and True again once those have ended.
    from gristmill.engine.kv_blocks import BlockManager
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    greedy = Request("g", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
    sched.add_request(greedy)
    assert greedy.plain and sched.schedule().plain
    for name, params in [("t", SamplingParams(max_tokens=1, temperature=0.7)),
                         ("lp", SamplingParams(max_tokens=1, temperature=0, logprobs=2)),
                         ("bias", SamplingParams(max_tokens=1, temperature=0, logit_bias={3: 5.0})),
                         ("pen", SamplingParams(max_tokens=1, temperature=0, repetition_penalty=1.2)),
                         ("min", SamplingParams(max_tokens=2, temperature=0, min_tokens=1))]:
        fancy = Request(name, [5, 6], params)
        assert not fancy.plain
        sched.add_request(fancy)
        out = sched.schedule()
        assert not out.plain and name in [item.request_id for item in out.scheduled]
        sched.finish_request(name, "abort")
        assert sched.schedule().plain, name
    sched.finish_request("g", "abort")
    assert sched.num_not_plain == 0 and sched.schedule().plain


@pytest.mark.parametrize("stop_on", ["length", "eos"])
def test_a_send_at_end_request_sends_one_update_at_its_end_with_every_token(stop_on):
    # An offline request (AddRequest.send_at_end) costs no update a step: the core sends
    # its tokens once, when it ends, and they are the tokens a step-by-step twin got. One
    # whose client wants token times (AddRequest.token_times) gets each token's time too.
    h = Harness(max_num_batched_tokens=64, max_num_seqs=4, num_blocks=64, block_size=4)
    eos_at = {"length": None, "eos": 3}[stop_on]
    script = {} if eos_at is None else {name: {eos_at: EOS} for name in ("quiet", "loud", "timed")}
    h.executor.script = script
    quiet = h.add("quiet", prompt(1, 6), max_tokens=6)
    quiet.send_at_end = True
    timed = h.add("timed", prompt(1, 6), max_tokens=6)
    timed.send_at_end, timed.token_times = True, []
    loud = h.add("loud", prompt(1, 6), max_tokens=6)
    seen, step_ends = defaultdict(list), []
    while h.core.has_unfinished:
        _, updates = h.step()
        step_ends.append(time.monotonic())
        for update in updates:
            seen[update.request_id].append(update)
    assert len(seen["quiet"]) == len(seen["timed"]) == 1 and len(seen["loud"]) == len(loud.output_token_ids) > 1
    (last,), (last_timed,) = seen["quiet"], seen["timed"]
    assert last.finish_reason == last_timed.finish_reason == seen["loud"][-1].finish_reason == \
        ("stop" if eos_at else "length")
    assert last.new_token_ids == last_timed.new_token_ids == quiet.output_token_ids == loud.output_token_ids
    assert [t for u in seen["loud"] for t in u.new_token_ids] == loud.output_token_ids
    assert last.token_times is None and all(u.token_times is None for u in seen["loud"])
    times = last_timed.token_times
    assert len(times) == len(quiet.output_token_ids) and times == sorted(set(times))  # one step each
    assert times[-1] <= step_ends[-1] and times[0] <= step_ends[-len(times)]


def test_an_executor_that_gives_back_too_few_tokens_fails_the_step():
    # A sampled row without its token would stay pending, its placeholder fed to the
    # next step: the step fails instead (the engine then reports itself dead).
    h = Harness(max_num_batched_tokens=64, max_num_seqs=4, num_blocks=64, block_size=4)
    h.add("a", prompt(1, 5), max_tokens=4)
    h.add("b", prompt(2, 5), max_tokens=4)
    out = h.sched.schedule()
    h.sched.advance(out)
    assert out.num_sampled == 2
    with pytest.raises(RuntimeError, match="returned 1 request ids, 1 tokens and 1 logprobs for a step that "
                                           "samples 2 rows"):
        h.sched.resolve(out, step_tokens({"a": 7}))


@pytest.mark.parametrize("cfg", [
    dict(block_size=4, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=32),
    dict(block_size=2, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=6),
    dict(block_size=8, num_blocks=12, max_num_seqs=16, max_num_batched_tokens=64),
], ids=["bs4", "bs2-tight-budget", "bs8-many-seqs"])
def test_randomized_stress(cfg):
    seed = 20240611 + cfg["block_size"]
    rng = random.Random(seed)
    vocab = 50  # small, so EOS and stop ids are actually hit
    h = Harness(max_model_len=256, vocab=vocab, **cfg)
    num_requests = 300
    next_id = 0
    steps = 0
    aborted = set()
    quiet = random.Random(seed + 1)
    while next_id < num_requests or h.core.has_unfinished:
        # Arrivals between steps.
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if next_id >= num_requests:
                break
            params = {}
            eos = {vocab + 1}
            if rng.random() < 0.3:
                eos = {rng.randrange(vocab)}
                params["ignore_eos"] = rng.random() < 0.3
            if rng.random() < 0.25:
                params["stop_token_ids"] = rng.sample(range(vocab), rng.randint(1, 2))
            rid = f"r{next_id}"
            next_id += 1
            total_cap = cfg["num_blocks"] * cfg["block_size"]
            p_len = rng.randint(1, 40)
            max_tokens = rng.randint(1, 30)
            assert p_len + max_tokens <= total_cap  # what InputProcessor guarantees
            request = h.add(rid, prompt(rng.random(), p_len, vocab), max_tokens=max_tokens, eos=eos, **params)
            request.send_at_end = quiet.random() < 0.5  # (its own draws: the schedule stays the same)
        # Random aborts, between steps or while a step runs.
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
        if rng.random() < 0.01:
            h.abort("never-added")
        h.step(abort_during=abort_during)
        steps += 1
        assert steps < 50_000, "did not finish: livelock?"

    reasons = defaultdict(int)
    for rid, r in h.all.items():
        expected, reason = h.reference(rid)
        reasons[r.finish_reason] += 1
        if rid in aborted:
            assert r.finish_reason == "abort"
            # Aborted while unfinished: what it produced is a strict prefix of its output.
            assert r.output_token_ids == expected[:len(r.output_token_ids)]
            assert len(r.output_token_ids) < len(expected)
        else:
            assert r.output_token_ids == expected, rid
            assert r.finish_reason == reason, rid
            if reason == "length":
                assert r.num_output_tokens == r.sampling_params.max_tokens
            else:
                last = r.output_token_ids[-1]
                stops = set(r.sampling_params.stop_token_ids)
                if not r.sampling_params.ignore_eos:
                    stops |= r.eos_token_ids
                assert last in stops
                assert not stops & set(r.output_token_ids[:-1])
                assert r.num_output_tokens <= r.sampling_params.max_tokens
    assert len(h.all) == num_requests
    # The scenario exercised what it is meant to.
    assert h.num_preemptions > 0
    assert reasons["abort"] > 0 and reasons["stop"] > 0 and reasons["length"] > 0
    assert any(not i.samples for rec in h.executor.steps for i in rec.items), "no chunked prefill"
    h.check_all_done()
