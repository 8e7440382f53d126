"""EngineCore: the step loop. schedule -> execute -> update."""

from __future__ import annotations

from typing import Protocol

from gristmill.config import EngineConfig
from gristmill.engine import faults
from gristmill.engine.kv_blocks import BlockManager
from gristmill.engine.request import Request
from gristmill.engine.scheduler import RequestUpdate, SampledToken, Scheduler, SchedulerOutput


class Executor(Protocol):
    """What the core needs from the model side (gristmill.model.runner.ModelRunner)."""

    num_blocks: int
    max_model_len: int

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor):
        self.config = config
        self.executor = executor
        self.block_manager = BlockManager(executor.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, executor.max_model_len)
        self.num_steps = 0

    def step(self) -> list[RequestUpdate]:
        self.num_steps += 1
        out = self.scheduler.schedule()
        if faults.ACTIVE:
            for item in out.scheduled:
                faults.check("forward", prompt=item.request.prompt, step=self.num_steps)
        sampled = self.executor.execute(out)
        return self.scheduler.update(out, sampled)

    def add_request(self, request: Request) -> None:
        # Ids are unique among live requests: clients check, and queue the abort of an
        # ended request before anything that could reuse its id.
        self.scheduler.add_request(request)

    def abort(self, request_ids, reason: str = "abort") -> None:
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, reason)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> dict:
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "num_free_blocks": self.block_manager.num_free_blocks,
                "num_total_blocks": self.block_manager.num_total_blocks}
