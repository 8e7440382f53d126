"""The decode stack (gristmill/model/cpu/decode_stack.py) against the layers run one by one,
step by step: what the parity, GGUF and LoRA tests each check on their own models."""

from __future__ import annotations

import torch

from gristmill.model.backends.reference import Backend
from gristmill.model.context import forward_context
from gristmill.model.cpu.decode_stack import DecodeStack
from tests.engine.harness import step_tokens


def run_comparing_stack_and_layers(runner, sched) -> tuple[int, int]:
    """Run `sched`'s requests to their end on `runner`, greedy. At every decode-only step,
    assert that the decode stack's hidden states are bit-identical to the layers run one by
    one through the plain layer loop (forward hooks, such as LoRA's, included). Returns
    (steps run in the stack, those of them with LoRA adapter rows)."""
    model, backend = runner.model.model, runner.backend
    layers, stacked, with_lora = model.layers, 0, 0
    while sched.num_unfinished:
        out = sched.schedule()
        host, items = runner.host_step(out)
        input_ids, positions, md, sample_indices = backend.upload(host)  # as the eager forward takes them
        md.lora = runner._lora_step(out, host)
        with forward_context(md, backend):
            x = model.embed_tokens(input_ids)
            if hasattr(model, "embed_scale"):  # (Gemma)
                x = x * torch.tensor(model.embed_scale)
            stack = DecodeStack.of(layers) if md.num_decodes == md.num_seqs else None
            one_by_one = Backend.run_layers(backend, layers, positions, x)
            if stack is not None:
                stacked += 1
                with_lora += md.lora is not None and stack.runs_lora
                assert torch.equal(stack(positions, x, md), one_by_one), f"step {stacked}"
        logits = runner.model.compute_logits(model.norm(one_by_one)[sample_indices])
        sched.update(out, step_tokens({item.request_id: int(logits[row].argmax()) for row, item in enumerate(items)}))
    return stacked, with_lora
