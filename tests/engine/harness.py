"""A fake model and a checking harness for scheduler and EngineCore tests: no model, no torch.

The fake executor plays the model: it keeps its own copy of the paged KV cache (token
ids written into the blocks the scheduler handed out), reads each sampled sequence
back through the request's block table, and returns a token that depends only on that
content. So outputs are the same whatever the batching, chunking, preemption or prefix
caching, and a block handed to the wrong request, or KV content assumed after a
preemption or reused from the prefix cache without being there, changes them.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from dataclasses import dataclass

from gristmill.config import EngineConfig
from gristmill.engine.core import EngineCore
from gristmill.engine.kv_blocks import blocks_needed
from gristmill.engine.messages import AddRequest
from gristmill.engine.request import Request, RequestStatus
from gristmill.sampling import SamplingParams
from gristmill.step import StepTokens

VOCAB = 1000
EOS = 5000  # outside the fake model's vocabulary: only a script emits it


def step_tokens(sampled: dict[str, int]) -> StepTokens:
    """A step's sampled tokens, given as {request id: token id} (no logprobs)."""
    return StepTokens(list(sampled), list(sampled.values()), [None] * len(sampled))


def model_token(seq: list[int], vocab: int = VOCAB) -> int:
    """The fake model: the next token is a hash of the whole sequence."""
    digest = hashlib.blake2b(repr(seq).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def reference_output(prompt, max_tokens, max_model_len, vocab=VOCAB, eos=frozenset({EOS}),
                     ignore_eos=False, stop_token_ids=(), script=None):
    """What a request must produce: one sequence alone, no batching, no cache limits."""
    seq, out = list(prompt), []
    script = script or {}
    while True:
        token = script.get(len(out), None)
        if token is None:
            token = model_token(seq, vocab)
        seq.append(token)
        out.append(token)
        if not ignore_eos and token in eos:
            return out, "stop"
        if token in stop_token_ids:
            return out, "stop"
        if len(out) >= max_tokens or len(seq) >= max_model_len:
            return out, "length"


@dataclass
class ItemRecord:
    request_id: str
    start: int
    num_new: int
    samples: bool
    block_ids: tuple


@dataclass
class StepRecord:
    items: list
    preempted: list
    finished: list
    sampled: dict

    def item(self, request_id):
        found = [i for i in self.items if i.request_id == request_id]
        return found[0] if found else None

    @property
    def ids(self):
        return [i.request_id for i in self.items]


class FakeExecutor:
    """Stands in for ModelRunner: `num_blocks`, `max_model_len`, `vocab_size`, `execute(out)`.
    It computes from the step contract alone, and checks it against the scheduler's
    `requests` (set by the Harness)."""

    def __init__(self, num_blocks, block_size, max_model_len, vocab=VOCAB, script=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab = self.vocab_size = vocab
        #: request_id -> {output index: token}: forced tokens (EOS, stop ids, ...).
        self.script = script or {}
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.steps: list[StepRecord] = []
        self.outs = []
        self.observer = None  # called with each SchedulerOutput, mid-step
        self.requests: dict[str, Request] = {}

    def execute(self, out):
        if self.observer is not None:
            self.observer(out)
        bs = self.block_size
        record = StepRecord([], list(out.preempted_request_ids), list(out.finished_request_ids), {})
        seen_ids, written = set(), {}  # written: block id -> the request that wrote it this step
        for item in out.scheduled:
            r = self.requests[item.request_id]
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            assert r.request_id not in seen_ids, "request scheduled twice in one step"
            seen_ids.add(r.request_id)
            assert r.status is RequestStatus.RUNNING
            assert item.num_new_tokens >= 1
            assert start == r.num_computed_tokens and item.pending == r.pending
            assert item.new_token_ids == r.token_ids[start:end], "scheduled tokens that do not exist yet"
            assert item.token_ids is r.token_ids and item.block_ids is r.block_ids  # shared, not copied
            # The cache holds exactly the computed tokens: no block missing, none wasted.
            assert len(item.block_ids) == blocks_needed(end, bs)
            assert all(0 <= b < self.num_blocks for b in item.block_ids)
            assert item.samples == (end == r.num_tokens)
            record.items.append(ItemRecord(item.request_id, start, item.num_new_tokens,
                                           item.samples, tuple(item.block_ids)))
            # Block tables may share cached prefix blocks, which nobody writes; every
            # block written this step has one writer. All writes land before any read,
            # as in the model's attention layers.
            for pos, token in enumerate(item.new_token_ids, start):
                block = item.block_ids[pos // bs]
                assert written.setdefault(block, item.request_id) == item.request_id, \
                    f"block {block} written by {written[block]} and {item.request_id} in one step"
                self.kv[block][pos % bs] = token
        sampled = {}
        for item in out.scheduled:
            if not item.samples:
                continue
            r = self.requests[item.request_id]
            end = item.num_computed_tokens + item.num_new_tokens
            seq = [self.kv[item.block_ids[p // bs]][p % bs] for p in range(end)]
            assert seq == r.token_ids, f"KV cache of {r.request_id} does not hold its tokens"
            token = self.script.get(item.request_id, {}).get(item.num_output_tokens)
            if token is None:
                token = model_token(seq, self.vocab)
            sampled[item.request_id] = token
        record.sampled = sampled
        self.steps.append(record)
        self.outs.append(out)
        return step_tokens(sampled)


class Harness:
    """An EngineCore over a FakeExecutor that checks the scheduler's invariants each step."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                 max_model_len=256, vocab=VOCAB, script=None, enable_prefix_caching=True):
        config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching)
        self.executor = FakeExecutor(num_blocks, block_size, max_model_len, vocab, script)
        self.executor.observer = self._during_step
        self.core = EngineCore(config, self.executor)
        self.sched = self.core.scheduler
        self.executor.requests = self.sched.requests
        self.bm = self.core.block_manager
        self.vocab = vocab
        self.max_model_len = max_model_len
        self.all: dict[str, Request] = {}
        self.updates = defaultdict(list)
        self.num_preemptions = 0
        #: (block id, hash) -> the block's content when first seen with that hash.
        self.hashed_content: dict[tuple[int, bytes], list[int]] = {}

    # -- requests ------------------------------------------------------------------

    def add(self, request_id, prompt, max_tokens=8, eos=frozenset({EOS}), **params) -> Request:
        refused = self.core.add_request(AddRequest(
            request_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, **params),
            frozenset(eos)))
        assert refused is None, refused
        r = self.sched.requests[request_id]
        self.all[request_id] = r
        self.check_invariants()
        return r

    def abort(self, request_id, mid_step=False):
        r = self.sched.requests.get(request_id)
        free_before = self.bm.num_free_blocks
        # Blocks only this request holds are freed; prefix blocks it shares are not.
        exclusive = [b for b in (r.block_ids if r is not None else []) if self.bm.ref_counts[b] == 1]
        self.core.abort([request_id])
        if r is not None:
            assert r.status is RequestStatus.FINISHED and r.finish_reason == "abort"
            assert r.block_ids == []
            # Freed at once, not at the next step.
            assert self.bm.num_free_blocks == free_before + len(exclusive)
            assert set(exclusive) <= set(self.bm._free)
        else:
            assert self.bm.num_free_blocks == free_before
        assert request_id not in self.sched.requests
        assert all(x.request_id != request_id for x in self.sched.running)
        assert all(x.request_id != request_id for x in self.sched.waiting)
        self.check_invariants(mid_step=mid_step)

    def reference(self, request_id):
        r = self.all[request_id]
        p = r.sampling_params
        return reference_output(r.prompt_token_ids, p.max_tokens, self.max_model_len, self.vocab,
                                r.eos_token_ids, p.ignore_eos, p.stop_token_ids,
                                self.executor.script.get(request_id))

    # -- steps ---------------------------------------------------------------------

    def _during_step(self, out):
        # After schedule, before execute: the scheduled requests are exactly the running ones.
        sched = self.sched
        assert len(sched.running) <= sched.max_num_seqs
        assert [s.request_id for s in out.scheduled] == [r.request_id for r in sched.running]
        assert out.num_tokens <= sched.max_num_batched_tokens
        self.check_invariants(mid_step=True)

    def step(self, abort_during=()):
        """One engine step (EngineCore.step, or its three parts when aborting mid-step)."""
        sched = self.sched
        running_before = [r.request_id for r in sched.running]
        waiting_before = [r.request_id for r in sched.waiting]
        outputs_before = {rid: list(r.output_token_ids) for rid, r in self.all.items()}
        waiting_tokens = {r.request_id: r.num_tokens for r in sched.waiting}
        queries_before, hits_before = self.bm.num_query_tokens, self.bm.num_hit_tokens
        n = len(self.executor.steps)
        if abort_during:
            out = sched.schedule()
            sampled = self.executor.execute(out)
            for rid in abort_during:
                self.abort(rid, mid_step=True)
            updates = sched.update(out, sampled)
        else:
            updates = self.core.step()
        assert len(self.executor.steps) == n + 1
        rec = self.executor.steps[-1]
        out = self.executor.outs[-1]
        cfg_budget = sched.max_num_batched_tokens

        # Budget.
        assert sum(i.num_new for i in rec.items) <= cfg_budget

        # Preemption takes the newest running requests, newest first, and puts them
        # back at the front of the waiting queue in their original order.
        k = len(rec.preempted)
        assert rec.preempted == list(reversed(running_before))[:k]
        self.num_preemptions += k
        for rid in rec.preempted:
            r = self.all[rid]
            assert r.num_computed_tokens == 0 and r.block_ids == []
            assert r.output_token_ids == outputs_before[rid], "preemption lost generated tokens"
        back = [rid for rid in reversed(rec.preempted) if rid not in abort_during]
        assert [r.request_id for r in sched.waiting][:len(back)] == back

        # Every running request that was not preempted is scheduled (decodes are never
        # starved), in order, before any waiting request is admitted (FCFS).
        survivors = running_before[:len(running_before) - k]
        assert rec.ids[:len(survivors)] == survivors
        admitted = rec.ids[len(survivors):]
        assert admitted == waiting_before[:len(admitted)]
        if k:
            assert admitted == [], "admitted a waiting request in a step that preempted"
        # A waiting request starts from scratch, or after the cached full blocks it
        # reuses: never at its last token, which is always computed.
        bs = self.bm.block_size
        for item in rec.items:
            if item.request_id in admitted:
                assert item.start % bs == 0 and item.start < waiting_tokens[item.request_id]
                assert item.start == 0 or self.bm.enable_prefix_caching
                assert all(self.bm.block_hashes[b] is not None for b in item.block_ids[:item.start // bs])
        # The prefix-cache counters count each admission once, in tokens.
        assert self.bm.num_hit_tokens - hits_before == sum(i.start for i in rec.items if i.request_id in admitted)
        queried = sum(waiting_tokens[rid] for rid in admitted) if self.bm.enable_prefix_caching else 0
        assert self.bm.num_query_tokens - queries_before == queried

        # Tokens are sampled only where the sequence end is reached, one update each.
        samplers = {i.request_id for i in rec.items if i.samples}
        assert set(rec.sampled) == samplers
        upd_ids = [u.request_id for u in updates]
        assert len(upd_ids) == len(set(upd_ids))
        sampled_now = samplers - set(abort_during)
        # A send_at_end request has one update, when it ends, with every output token.
        assert set(upd_ids) == {rid for rid in sampled_now if not self.all[rid].send_at_end
                                or self.all[rid].finish_reason is not None}
        for u in updates:
            r = self.all[u.request_id]
            if r.send_at_end:
                assert u.new_token_ids == r.output_token_ids and u.finish_reason is not None
            else:
                assert u.new_token_ids == [rec.sampled[u.request_id]]
            assert u.finish_reason == r.finish_reason
            if u.finish_reason is not None:
                assert r.status is RequestStatus.FINISHED
                assert r.block_ids == []  # freed at once: free, or still held by a request sharing it
                item = rec.item(u.request_id)
                held = {b for x in sched.requests.values() for b in x.block_ids}
                assert set(item.block_ids) <= set(self.bm._free) | held
            self.updates[u.request_id].append(u)
        for rid, r in self.all.items():
            grown = len(r.output_token_ids) - len(outputs_before[rid])
            assert grown == (1 if rid in sampled_now else 0)
        self.check_invariants()
        return rec, updates

    def run(self, max_steps=10_000):
        steps = 0
        while self.core.has_unfinished:
            self.step()
            steps += 1
            assert steps < max_steps, "engine did not finish: livelock?"
        return steps

    # -- invariants ----------------------------------------------------------------

    def check_invariants(self, mid_step=False):
        sched, bm = self.sched, self.bm
        running, waiting = list(sched.running), list(sched.waiting)
        live = list(sched.requests.values())
        assert len(running) <= sched.max_num_seqs
        assert len({id(r) for r in running + waiting}) == len(running) + len(waiting)
        assert {id(r) for r in running + waiting} == {id(r) for r in live}
        assert all(sched.requests[rid].request_id == rid for rid in sched.requests)
        for r in running:
            assert r.status is RequestStatus.RUNNING
            if not mid_step:
                assert len(r.block_ids) == blocks_needed(r.num_computed_tokens, bm.block_size)
                assert r.num_computed_tokens < r.num_tokens
        for r in waiting:
            assert r.status is RequestStatus.WAITING
            assert r.num_computed_tokens == 0 and r.block_ids == []
        for r in live:
            assert r.num_output_tokens < r.sampling_params.max_tokens
            assert r.finish_reason is None
        for rid, r in self.all.items():
            if rid not in sched.requests:
                assert r.status is RequestStatus.FINISHED
                assert r.finish_reason in ("stop", "length", "abort", "error")
                assert r.block_ids == []
        # Every block is free, cached, or held by exactly ref_count block tables of live
        # requests, and shared only as a cached prefix block.
        bm.check_invariants(live)
        if not mid_step:
            self._check_cache_contents(running)

    def _check_cache_contents(self, running):
        """The fake KV cache holds each running request's computed tokens, and a block
        keeps its content while it carries the same hash (cached blocks are not
        overwritten before they are evicted)."""
        bs, kv = self.bm.block_size, self.executor.kv
        for r in running:
            cached = [kv[r.block_ids[p // bs]][p % bs] for p in range(r.num_computed_tokens)]
            assert cached == r.token_ids[:r.num_computed_tokens], f"KV cache of {r.request_id} is wrong"
        for block, digest in enumerate(self.bm.block_hashes):
            if digest is not None:
                seen = self.hashed_content.setdefault((block, digest), list(kv[block]))
                assert kv[block] == seen, f"cached block {block} was overwritten"

    def check_all_done(self):
        sched, bm = self.sched, self.bm
        assert not self.core.has_unfinished
        assert bm.num_free_blocks == bm.num_total_blocks
        assert sched.requests == {}
        assert list(sched.running) == [] and list(sched.waiting) == []
        for rid, r in self.all.items():
            assert r.is_finished and r.block_ids == []
            if r.finish_reason not in ("abort", "error"):  # ended from outside, not by a step
                # The streamed updates add up to the output, the reason on the last one only.
                ups = self.updates[rid]
                assert [t for u in ups for t in u.new_token_ids] == r.output_token_ids
                assert [u.finish_reason for u in ups[:-1]] == [None] * (len(ups) - 1)
                assert ups[-1].finish_reason == r.finish_reason
        # One more step: nothing to compute, the last finished ids are reported.
        rec, updates = self.step()
        assert rec.items == [] and updates == []
        rec, updates = self.step()
        assert rec.items == [] and rec.finished == [] and updates == []
        assert bm.num_free_blocks == bm.num_total_blocks

    def check_matches_reference(self, request_id):
        r = self.all[request_id]
        expected, reason = self.reference(request_id)
        assert r.output_token_ids == expected
        assert r.finish_reason == reason
        return expected


def prompt(seed, length, vocab=VOCAB):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]
