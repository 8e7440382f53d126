"""Async scheduling over a fake executor (no torch), fuzzed: plain steps, StepTokens,
send_at_end requests, the decode fast path for a pending token that fills its block.

The fake plays ModelRunner.launch: a step's PLACEHOLDER tokens are filled from the ids
sampled by the step launched just before (as the runner reads them from
`token_buffer`), its KV content is kept per block, and a sampled token depends only on
the sequence read back through the block table. So a wrong placeholder, a block handed
out twice, or a prefix-cache block registered under a hash that is not its content
changes the outputs or fails a check.
"""

from __future__ import annotations

import random

from gristmill.config import EngineConfig
from gristmill.engine.core import EngineCore
from gristmill.engine.kv_blocks import block_hash, blocks_needed
from gristmill.engine.messages import AddRequest
from gristmill.engine.request import PLACEHOLDER
from gristmill.sampling import SamplingParams
from gristmill.step import StepTokens
from tests.engine.harness import model_token, prompt, reference_output


class _Launched:
    def __init__(self, tokens: StepTokens):
        self.tokens = tokens

    def result(self) -> StepTokens:
        return self.tokens


class AsyncFakeExecutor:
    prefers_async = True

    def __init__(self, num_blocks, block_size, max_model_len, vocab, script=None):
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.vocab = self.vocab_size = vocab
        self.script = script or {}
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.last: dict[str, int] = {}  # request id -> the id the last launched step sampled
        self.launches = 0

    def make_device_error(self):
        raise RuntimeError("no device")

    def execute(self, out):
        return self.launch(out).result()

    def launch(self, out):
        self.launches += 1
        bs = self.block_size
        for item in out.scheduled:
            start = item.num_computed_tokens
            assert len(item.block_ids) == blocks_needed(start + item.num_new_tokens, bs)
            for pos, token in enumerate(item.new_token_ids, start):
                if token == PLACEHOLDER:
                    assert item.pending and pos == len(item.token_ids) - 1, "a placeholder that is not pending"
                    token = self.last[item.request_id]  # the runner's token_buffer row
                self.kv[item.block_ids[pos // bs]][pos % bs] = token
        ids, tokens = [], []
        for item in out.scheduled:
            if not item.samples:
                continue
            end = item.num_computed_tokens + item.num_new_tokens
            seq = [self.kv[item.block_ids[p // bs]][p % bs] for p in range(end)]
            token = self.script.get(item.request_id, {}).get(item.num_output_tokens)
            ids.append(item.request_id)
            tokens.append(model_token(seq, self.vocab) if token is None else token)
        self.last = dict(zip(ids, tokens))
        return _Launched(StepTokens(ids, tokens, [None] * len(ids)))


def _core(async_scheduling=True, **cfg):
    config = EngineConfig(block_size=cfg.get("block_size", 4), max_num_seqs=cfg.get("max_num_seqs", 8),
                          max_num_batched_tokens=cfg.get("max_num_batched_tokens", 32),
                          enable_prefix_caching=True, async_scheduling=async_scheduling)
    executor = AsyncFakeExecutor(cfg.get("num_blocks", 24), config.block_size, 256, cfg.get("vocab", 50))
    core = EngineCore(config, executor)
    assert core.async_scheduling == async_scheduling
    return core, executor


def _check_hashes(core, executor):
    """Every block a live request holds that carries a hash carries the hash of the KV
    content of its request's blocks up to it (what a later request would reuse)."""
    bm, bs = core.block_manager, core.block_manager.block_size
    for request in core.scheduler.requests.values():
        parent = b""
        for i, block in enumerate(request.block_ids):
            content = executor.kv[block]
            if None in content:
                break
            digest = block_hash(parent, content)
            if bm.block_hashes[block] is not None:
                assert bm.block_hashes[block] == digest, \
                    f"block {block} of {request.request_id} is registered under another content's hash"
            parent = digest
    bm.check_invariants(core.scheduler.requests.values())


def test_async_scheduling_fuzz_matches_the_reference_with_prefix_caching_aborts_and_send_at_end():
    quiet = 0
    for seed in range(6):
        rng = random.Random(seed)
        cfg = rng.choice([dict(block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=8),
                          dict(block_size=2, num_blocks=40, max_num_batched_tokens=6, max_num_seqs=6),
                          dict(block_size=8, num_blocks=12, max_num_batched_tokens=64, max_num_seqs=16)])
        vocab = 50
        core, executor = _core(vocab=vocab, **cfg)
        shared = prompt(seed + 100, 24, vocab)
        requests, got, aborted = {}, {}, set()
        next_id, steps = 0, 0
        while next_id < 120 or core.has_unfinished:
            for _ in range(rng.choice([0, 0, 1, 1, 2])):
                if next_id >= 120:
                    break
                rid = f"r{next_id}"
                next_id += 1
                p = shared[:rng.randint(0, 24)] + prompt(rng.random(), rng.randint(1, 12), vocab)
                eos = frozenset({rng.randrange(vocab)}) if rng.random() < 0.3 else frozenset({vocab + 1})
                params = SamplingParams(max_tokens=rng.randint(1, 20) if rng.random() < 0.8 else rng.randint(33, 40),
                                        temperature=0)
                message = AddRequest(rid, p, params, eos)
                message.send_at_end = rng.random() < 0.5
                assert core.add_request(message) is None
                requests[rid] = (p, params, eos, message.send_at_end)
                got[rid] = ([], [], None)
            live = sorted(core.scheduler.requests)
            if live and rng.random() < 0.05:
                rid = rng.choice(live)
                core.abort([rid])
                aborted.add(rid)
            for update in core.step():
                tokens, n_updates, reason = got[update.request_id]
                assert reason is None, f"{update.request_id} got an update after it ended"
                n_updates.append(len(update.new_token_ids))
                got[update.request_id] = (tokens + update.new_token_ids, n_updates, update.finish_reason)
            _check_hashes(core, executor)
            steps += 1
            assert steps < 20_000
            assert core.scheduler.num_not_plain == 0
        for rid, (p, params, eos, send_at_end) in requests.items():
            expected, reason = reference_output(p, params.max_tokens, 256, vocab, eos)
            tokens, n_updates, got_reason = got[rid]
            if rid in aborted:
                assert tokens == expected[:len(tokens)]
                continue
            assert (tokens, got_reason) == (expected, reason), (seed, rid)
            if send_at_end:  # all its tokens in one update, at its end
                assert n_updates == [len(expected)]
                quiet += len(expected) > 1
    assert quiet > 0  # some send_at_end request ran past one token
