"""Async scheduling on a real runner (tiny model, CPU): plain greedy steps and
controlled ones alternate as requests with penalties join and leave while a step is in
flight, rows change identity between steps (requests end, join, are aborted); async
scheduling must give what the synchronous core gives."""

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


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny_gemma_review")
    model.save_pretrained(path)
    return path


def _prompt(i, length):
    return [(i * 13 + 5 * j + 1) % VOCAB for j in range(length)]


def _run(path, async_scheduling, schedule):
    """`schedule`: {step number: [("add", id, prompt, params, final_only) | ("abort", id)]}."""
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", quantization=None, block_size=4,
                          max_model_len=96, async_scheduling=async_scheduling, num_kv_blocks=64,
                          max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore(config, ModelRunner(config))
    got, step = {}, 0
    plain_steps = []
    while step <= max(schedule) or core.has_unfinished:
        for action in schedule.get(step, []):
            if action[0] == "add":
                _, rid, prompt, params, final_only = action
                message = AddRequest(rid, prompt, params, frozenset())
                message.final_only = final_only
                assert core.add_request(message) is None
                got[rid] = []
            elif core.scheduler.requests.get(action[1]) is not None:
                core.abort([action[1]])
                got[action[1]] = "aborted"  # (async hears of one token less by then)
        plain_steps.append(core.scheduler.num_fancy == 0)
        for update in core.step():
            if isinstance(got[update.request_id], list):
                got[update.request_id] += update.new_token_ids
        step += 1
        assert step < 500
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
    return got, plain_steps


def test_plain_and_controlled_steps_alternating_with_changing_rows_match_synchronous(tiny_gemma):
    greedy = SamplingParams(max_tokens=14, temperature=0)
    schedule = {
        0: [("add", f"g{i}", _prompt(i, 3 + i), greedy, i % 2 == 0) for i in range(4)],
        3: [("add", "pen", _prompt(9, 5), greedy.clone(repetition_penalty=1.7, frequency_penalty=0.8), False)],
        5: [("abort", "g1"), ("add", "g5", _prompt(5, 1), greedy, True)],
        7: [("add", "pen2", _prompt(11, 2), greedy.clone(presence_penalty=1.5, max_tokens=4), False)],
        9: [("add", "g6", _prompt(6, 4), greedy, False)],
        14: [("add", "late", _prompt(12, 6), greedy.clone(max_tokens=6), True)],
    }
    sync, _ = _run(tiny_gemma, False, schedule)
    got, plain_steps = _run(tiny_gemma, True, schedule)
    assert any(plain_steps) and not all(plain_steps)
    assert got == sync
