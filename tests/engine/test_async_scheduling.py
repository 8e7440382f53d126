"""Async scheduling: each step is launched before the last one's tokens reach the host,
its placeholder tokens read on the device. It is on by default on CUDA only (on a CPU the
host does the compute, nothing overlaps), but its bookkeeping is the same on any device:
here a real engine core over a tiny model on CPU must give exactly what the synchronous
core gives, for the same requests, through EOS and stop tokens, length limits, seeded
sampling with logprobs, preemption and prefix caching; and every block comes back.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gristmill import SamplingParams  # noqa: E402
from gristmill.config import EngineConfig  # noqa: E402
from gristmill.engine.core import EngineCore  # noqa: E402
from gristmill.engine.messages import AddRequest  # noqa: E402
from gristmill.model.runner import ModelRunner  # noqa: E402

VOCAB = 96
# On a GPU machine the same checks run on CUDA too, decode steps replayed from CUDA graphs.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # weights big enough that the greedy tokens vary
        for p in model.parameters():
            p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny_gemma")
    model.save_pretrained(path)
    return path


def _core(path, async_scheduling: bool, device: str = "cpu", **options) -> EngineCore:
    config = EngineConfig(model=str(path), device=device, dtype="float32", quantization=None, block_size=4,
                          max_model_len=96, async_scheduling=async_scheduling,
                          **{"num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64, **options})
    return EngineCore(config, ModelRunner(config))


def _prompt(i: int, length: int, shared: int = 0) -> list[int]:
    """A prompt whose first `shared` tokens are the same in every prompt."""
    return [(7 * j) % VOCAB for j in range(shared)] + [(i * 13 + 5 * j + 1) % VOCAB for j in range(length - shared)]


def _run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams, frozenset]]):
    """Every request to its end: {id: (token ids, logprobs, finish reason)}, and the
    number of preemptions."""
    for request_id, prompt, params, eos in requests:
        assert core.add_request(AddRequest(request_id, prompt, params, eos)) is None
    tracked = list(core.scheduler.requests.values())
    results = {request_id: ([], [], None) for request_id, *_ in requests}
    steps = 0
    while core.has_unfinished:
        steps += 1
        assert steps < 1000, "the engine does not finish"
        for update in core.step():
            tokens, logprobs, reason = results[update.request_id]
            assert reason is None, f"{update.request_id} got a token after it finished"
            tokens += update.new_token_ids
            logprobs += update.new_logprobs or []
            results[update.request_id] = (tokens, logprobs, update.finish_reason)
    # Nothing is left behind: every block free, no request holding one.
    bm = core.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks
    return results, sum(r.num_preemptions for r in tracked)


def _both(path, requests, device, **options):
    sync, sync_preempted = _run(_core(path, False, device, **options), requests)
    async_core = _core(path, True, device, **options)
    assert async_core.async_scheduling
    got, async_preempted = _run(async_core, requests)
    assert got == sync
    return sync, sync_preempted, async_preempted


def test_greedy_with_eos_stop_tokens_and_lengths_is_the_same_as_synchronous(tiny_gemma, device):
    free = [(f"r{i}", _prompt(i, 3 + 4 * i), SamplingParams(max_tokens=5 + 3 * i, temperature=0), frozenset())
            for i in range(6)]
    base, _ = _run(_core(tiny_gemma, False, device), free)
    # End some requests mid-way on a token they really produce: as EOS, and as a stop token.
    eos_at = base["r1"][0][2]
    stop_at = base["r3"][0][4]
    requests = list(free)
    requests[1] = ("r1", free[1][1], free[1][2], frozenset([eos_at]))
    requests[3] = ("r3", free[3][1], SamplingParams(max_tokens=free[3][2].max_tokens, temperature=0,
                                                    stop_token_ids=[stop_at]), frozenset())
    results, _, _ = _both(tiny_gemma, requests, device)
    assert results["r1"][2] == "stop" and results["r1"][0][-1] == eos_at and len(results["r1"][0]) <= 3
    assert results["r3"][2] == "stop" and results["r3"][0][-1] == stop_at
    assert results["r5"] == base["r5"] and results["r5"][2] == "length" and len(results["r5"][0]) == 20


def test_seeded_sampling_with_logprobs_is_the_same_as_synchronous(tiny_gemma, device):
    requests = [(f"s{i}", _prompt(i, 6 + i), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9,
                                                              seed=100 + i, logprobs=2), frozenset())
                for i in range(4)]
    results, _, _ = _both(tiny_gemma, requests, device)
    for tokens, logprobs, reason in results.values():
        assert len(tokens) == len(logprobs) == 12 and reason == "length"
        assert all(token in entry for token, entry in zip(tokens, logprobs))


def test_preemption_and_prefix_caching_are_the_same_as_synchronous(tiny_gemma, device):
    # 16 blocks of 4 tokens for 8 requests that grow to ~30 tokens each: requests are
    # preempted and recomputed, partly from the blocks their shared prefix left cached.
    requests = [(f"p{i}", _prompt(i, 12, shared=8), SamplingParams(max_tokens=18, temperature=0), frozenset())
                for i in range(8)]
    results, sync_preempted, async_preempted = _both(tiny_gemma, requests, device, num_kv_blocks=16)
    assert sync_preempted > 0 and async_preempted > 0
    assert all(len(tokens) == 18 and reason == "length" for tokens, _, reason in results.values())


def test_a_request_aborted_while_its_step_runs_ends_and_the_next_run_is_clean(tiny_gemma, device):
    core = _core(tiny_gemma, True, device)
    params = SamplingParams(max_tokens=30, temperature=0)
    for i in range(3):
        core.add_request(AddRequest(f"a{i}", _prompt(i, 5), params, frozenset()))
    for _ in range(4):
        core.step()
    assert core._in_flight is not None  # a step is launched and not resolved
    core.abort(["a0", "a1", "a2"])
    assert not core.has_unfinished
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
    # The aborted requests' last step is dropped; new requests run as on a fresh engine.
    requests = [(f"b{i}", _prompt(i, 5), SamplingParams(max_tokens=6, temperature=0), frozenset()) for i in range(2)]
    results, _ = _run(core, requests)
    fresh, _ = _run(_core(tiny_gemma, False, device), requests)
    assert results == fresh


def _run_schedule(core: EngineCore, schedule: dict) -> tuple[dict, list[bool]]:
    """`schedule`: {step number: [("add", id, prompt, params, send_at_end) | ("abort", id)]}.
    Returns each request's tokens ("aborted" for one aborted) and, per step, whether it
    was all plain greedy rows."""
    got, plain_steps, step = {}, [], 0
    while step <= max(schedule) or core.has_unfinished:
        for action in schedule.get(step, []):
            if action[0] == "add":
                _, request_id, prompt, params, send_at_end = action
                message = AddRequest(request_id, prompt, params, frozenset())
                message.send_at_end = send_at_end
                assert core.add_request(message) is None
                got[request_id] = []
            elif core.scheduler.requests.get(action[1]) is not None:
                core.abort([action[1]])
                got[action[1]] = "aborted"  # (async hears of one token less by then)
        plain_steps.append(core.scheduler.num_not_plain == 0)
        for update in core.step():
            if isinstance(got[update.request_id], list):
                got[update.request_id] += update.new_token_ids
        step += 1
        assert step < 500
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
    return got, plain_steps


def test_plain_and_controlled_steps_alternating_with_changing_rows_are_the_same_as_synchronous(tiny_gemma, device):
    # Plain greedy steps (the forward's argmax, no pass over the rows) and steps with
    # penalties (which read the last step's pending tokens by row) alternate, while rows
    # change between steps: requests end, join mid-flight and are aborted.
    greedy = SamplingParams(max_tokens=14, temperature=0)
    schedule = {
        0: [("add", f"g{i}", _prompt(i, 3 + i), greedy, i % 2 == 0) for i in range(4)],
        3: [("add", "pen", _prompt(9, 5), greedy.clone(repetition_penalty=1.7, frequency_penalty=0.8), False)],
        5: [("abort", "g1"), ("add", "g5", _prompt(5, 1), greedy, True)],
        7: [("add", "pen2", _prompt(11, 2), greedy.clone(presence_penalty=1.5, max_tokens=4), False)],
        9: [("add", "g6", _prompt(6, 4), greedy, False)],
        14: [("add", "late", _prompt(12, 6), greedy.clone(max_tokens=6), True)],
    }
    sync, _ = _run_schedule(_core(tiny_gemma, False, device), schedule)
    got, plain_steps = _run_schedule(_core(tiny_gemma, True, device), schedule)
    assert any(plain_steps) and not all(plain_steps)
    assert got == sync
