"""The two ways a projection's LoRA update runs (gristmill/model/lora.py): the C++ kernel
(CPU, float32: every adapter row of a step in one call) against the torch update, on
fused and plain projections, ranks that are and are not a multiple of the kernel's
widths, adapters that update only some parts, rows of several slots interleaved with
base rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gristmill.model.lora import LoRAModel, Site, _cpu_kernels, kernel_update, torch_update

ops = _cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ kernels are not built here")
NUM_SLOTS = 5


class _Projection(nn.Module):
    """What a Site needs of a layer: its sizes (and a fused one's parts)."""

    def __init__(self, in_features: int, split_sizes: list[int]):
        super().__init__()
        self.in_features, self.out_features = in_features, sum(split_sizes)
        if len(split_sizes) > 1:
            self.split_sizes = split_sizes


def _site(in_features: int, split_sizes: list[int], rank: int) -> Site:
    """Slots of random adapters; slot s updates part p unless (s + p) % 4 == 3; odd slots
    have a smaller rank than the slots hold."""
    generator = torch.Generator().manual_seed(rank)
    site = Site(_Projection(in_features, split_sizes), tuple(range(len(split_sizes))), NUM_SLOTS, rank,
                torch.float32, torch.device("cpu"), update=None)
    for slot in range(NUM_SLOTS):
        r = rank - (slot % 2) * 3
        for part, (start, end) in enumerate(site.bounds):
            if (slot + part) % 4 != 3:
                site.put(slot, part, torch.randn(r, in_features, generator=generator),
                         torch.randn(end - start, r, generator=generator))
    return site


def _step(slots: list[int]):
    """The LoRAStep of a step of one token per sequence, sequence i in slots[i] (-1: the base)."""
    model = LoRAModel.__new__(LoRAModel)
    model.device = torch.device("cpu")
    return LoRAModel.step_of(model, slots, np.arange(len(slots) + 1))


@pytest.mark.parametrize("in_features,split_sizes,rank", [(64, [96, 32, 32], 16), (100, [40, 27], 8),
                                                          (48, [77], 21), (256, [512, 512], 32)],
                         ids=["qkv-r16", "gate_up-r8", "plain-r21", "wide-r32"])
def test_the_kernel_updates_each_row_as_torch_does_and_as_alone(in_features, split_sizes, rank):
    site = _site(in_features, split_sizes, rank)
    slots = [-1 if i % 5 == 0 else i % 4 for i in range(19)]  # (interleaved, base rows among them)
    x = torch.randn(len(slots), in_features)
    y = torch.randn(len(slots), site.out_features)
    by_torch, by_kernel = y.clone(), y.clone()
    torch_update(site, x, by_torch, _step(slots))
    kernel_update(ops)(site, x, by_kernel, _step(slots))
    torch.testing.assert_close(by_kernel, by_torch, rtol=1e-5, atol=1e-4)
    assert torch.equal(by_kernel[::5], y[::5])  # base rows untouched
    for i, slot in enumerate(slots):
        if slot >= 0:  # the same bits alone as among other adapters' rows
            alone = y[i:i + 1].clone()
            kernel_update(ops)(site, x[i:i + 1], alone, _step([slot]))
            assert torch.equal(alone, by_kernel[i:i + 1])
        for part, (start, end) in enumerate(site.bounds):
            if slot >= 0 and not site.parts_used[slot, part]:  # a part the adapter does not update
                assert torch.equal(by_kernel[i, start:end], y[i, start:end])


def test_the_kernel_refuses_what_does_not_fit():
    site = _site(64, [96, 32, 32], 16)
    step = _step([0, 1])
    with pytest.raises(RuntimeError, match="do not fit"):
        kernel_update(ops)(site, torch.randn(2, 63), torch.zeros(2, 160), step)
    with pytest.raises(RuntimeError, match="row out of range"):
        kernel_update(ops)(site, torch.randn(1, 64), torch.zeros(1, 160), step)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_decode_stack_with_adapter_rows_equals_the_layers_and_their_hooks(quantization):
    """A decode step with adapter rows runs in the decode stack (csrc/decode_stack.cpp),
    which makes each linear's LoRA update itself: its hidden states are bit-identical to
    the layers run one by one, their forward hooks making the update, at every such step
    (rows of two adapters and of the base, decoding from prompts of different lengths)."""
    from gristmill.config import EngineConfig
    from gristmill.engine.kv_blocks import BlockManager
    from gristmill.engine.lora_slots import LoRASlots
    from gristmill.engine.request import Request
    from gristmill.engine.scheduler import Scheduler
    from gristmill.lora import LoRARequest
    from gristmill.model.runner import ModelRunner
    from gristmill.sampling import SamplingParams
    from tests.model.decode_stack_check import run_comparing_stack_and_layers
    from tests.lora_models import make_adapter, tiny_base

    base = tiny_base("llama")
    runner = ModelRunner(EngineConfig(
        model=str(base), device="cpu", dtype="float32", quantization=quantization, block_size=4,
        num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
        enable_lora=True, max_loras=2, max_lora_rank=8))
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_adapter(base, f"a{i}", seed=i))) for i in range(2)]
    sched = Scheduler(BlockManager(runner.num_blocks, 4, True), 4, 64, runner.max_model_len,
                      lora_slots=LoRASlots(2, runner.load_lora))
    for rid, n, lora in (("a", 3, adapters[0]), ("b", 9, None), ("c", 6, adapters[1]), ("d", 5, adapters[0])):
        sched.add_request(Request(rid, [(7 * i + n) % 100 + 1 for i in range(n)],
                                  SamplingParams(max_tokens=8, temperature=0), lora=lora))
    stacked_steps, with_lora = run_comparing_stack_and_layers(runner, sched)
    assert stacked_steps == with_lora >= 5  # (every one with adapter rows, in the stack)
