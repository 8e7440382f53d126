"""LoRA slots in the scheduler, over the fake executor (no model, no torch): a step never
holds more adapters than slots, each row's slot holds its adapter while it runs, requests
wait for a slot rather than overflow, and an adapter that fails to load ends only the
requests naming it."""

from __future__ import annotations

import random

from gristmill.config import EngineConfig
from gristmill.engine.core import EngineCore
from gristmill.engine.messages import AddRequest
from gristmill.errors import LoRAAdapterError
from gristmill.lora import LoRARequest
from gristmill.sampling import SamplingParams
from tests.engine.harness import FakeExecutor, reference_output

MAX_MODEL_LEN = 256


class LoRAExecutor(FakeExecutor):
    """The fake model, with slots: `load_lora` records what each slot holds (or raises for
    the adapters in `broken`), and every step checks each row's slot against its adapter."""

    def __init__(self, num_blocks: int, broken: frozenset[int] = frozenset()):
        super().__init__(num_blocks, 4, MAX_MODEL_LEN)
        self.slots: dict[int, LoRARequest] = {}
        self.broken = broken
        self.loads: list[str] = []
        self.most_adapters_in_a_step = 0

    def load_lora(self, slot: int, lora: LoRARequest) -> None:
        if lora.lora_int_id in self.broken:  # (the slot keeps what it held, as the runner's does)
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: broken on purpose", lora_name=lora.lora_name)
        self.slots[slot] = lora
        self.loads.append(lora.lora_name)

    def execute(self, out):
        used = set()
        for item in out.scheduled:
            lora = self.requests[item.request_id].lora
            if lora is None:
                assert item.lora_slot == -1
            else:
                assert self.slots[item.lora_slot] == lora, f"{item.request_id} runs on another adapter's slot"
                used.add(item.lora_slot)
        self.most_adapters_in_a_step = max(self.most_adapters_in_a_step, len(used))
        return super().execute(out)


def _core(num_slots: int, num_blocks: int = 256, broken=frozenset(), max_num_seqs: int = 8):
    executor = LoRAExecutor(num_blocks, broken)
    config = EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, enable_lora=True,
                          max_loras=num_slots)
    core = EngineCore(config, executor)
    executor.requests = core.scheduler.requests
    return core, executor


def _add(core, request_id: str, prompt: list[int], lora: LoRARequest | None, max_tokens: int = 6):
    refused = core.add_request(AddRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                                          frozenset(), lora=lora))
    assert refused is None, refused


def _run(core) -> dict:
    """Steps until every request ends; {request id: (tokens, finish reason, error)}. Checks
    each step that the running requests hold exactly the slots' users."""
    ended, tokens = {}, {}
    while core.has_unfinished:
        for update in core.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                ended[update.request_id] = (tokens[update.request_id], update.finish_reason, update.error)
        held = [0] * core.lora_slots.num_slots
        for request in core.scheduler.running:
            if request.lora is not None:
                held[request.lora_slot] += 1
        assert held == core.lora_slots.users
    return ended


def _adapters(count: int) -> list[LoRARequest]:
    return [LoRARequest(f"adapter-{i}", i, f"/adapters/{i}") for i in range(1, count + 1)]


def test_a_step_never_holds_more_adapters_than_slots_and_every_request_ends_as_alone():
    rng = random.Random(0)
    core, executor = _core(num_slots=2)
    adapters = _adapters(5)
    prompts = {}
    for i in range(24):
        lora = rng.choice([None, *adapters])
        prompts[f"r{i}"] = [rng.randrange(1000) for _ in range(rng.randrange(3, 20))]
        _add(core, f"r{i}", prompts[f"r{i}"], lora)
    ended = _run(core)
    assert executor.most_adapters_in_a_step == 2
    assert len(executor.loads) > len(adapters)  # evicted and loaded again
    for request_id, prompt in prompts.items():
        assert ended[request_id][:2] == reference_output(prompt, 6, MAX_MODEL_LEN)
    assert core.lora_slots.users == [0, 0]
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_requests_of_a_busy_adapter_wait_and_those_behind_them_go_first():
    core, executor = _core(num_slots=1)
    first, second = _adapters(2)
    _add(core, "a", [1, 2, 3], first, max_tokens=4)
    _add(core, "b", [4, 5, 6], second)  # its adapter needs the one slot, which "a" holds
    _add(core, "base", [7, 8, 9], None)
    _add(core, "a2", [1, 2, 7], first)
    core.step()
    running = [r.request_id for r in core.scheduler.running]
    assert running == ["a", "base", "a2"] and [r.request_id for r in core.scheduler.waiting] == ["b"]
    ended = _run(core)
    assert set(ended) == {"a", "b", "base", "a2"} and all(reason == "length" for _, reason, _ in ended.values())
    assert executor.loads == ["adapter-1", "adapter-2"]


def test_preempted_requests_give_their_slot_back_and_take_one_again():
    rng = random.Random(1)
    core, executor = _core(num_slots=2, num_blocks=12)
    adapters = _adapters(3)
    prompts = {}
    for i in range(10):
        prompts[f"r{i}"] = [rng.randrange(1000) for _ in range(rng.randrange(5, 12))]
        _add(core, f"r{i}", prompts[f"r{i}"], adapters[i % 3], max_tokens=10)
    ended = _run(core)
    assert core.scheduler.num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert ended[request_id][:2] == reference_output(prompt, 10, MAX_MODEL_LEN)
    assert core.lora_slots.users == [0, 0]


def test_an_adapter_that_fails_to_load_ends_only_the_requests_naming_it():
    core, executor = _core(num_slots=1, broken=frozenset({2}))
    good, bad = _adapters(2)
    for request_id, lora in [("g1", good), ("b1", bad), ("base", None), ("b2", bad), ("g2", good)]:
        _add(core, request_id, [1, 2, 3, len(request_id)], lora)
    ended = _run(core)
    for request_id in ("b1", "b2"):
        tokens, reason, error = ended[request_id]
        assert (tokens, reason) == ([], "error") and error == "LoRAAdapterError: LoRA adapter 'adapter-2': broken on purpose"
    assert all(ended[r][1] == "length" for r in ("g1", "g2", "base"))
    assert core.lora_slots.users == [0] and core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
    assert core.stats()["lora_adapters"] == ["adapter-1"]


def test_a_lora_request_to_an_engine_without_lora_is_refused():
    executor = FakeExecutor(16, 4, MAX_MODEL_LEN)
    core = EngineCore(EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16), executor)
    refused = core.add_request(AddRequest("x", [1, 2], SamplingParams(max_tokens=2), frozenset(),
                                          lora=_adapters(1)[0]))
    assert refused.param == "lora_request" and "enable_lora=True" in str(refused)
    assert not core.has_unfinished
