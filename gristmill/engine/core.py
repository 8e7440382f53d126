"""EngineCore: the step loop. schedule -> execute -> update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gristmill.config import EngineConfig
from gristmill import faults
from gristmill.engine.kv_blocks import BlockManager
from gristmill.engine.lora_slots import LoRASlots
from gristmill.engine.messages import AddRequest, Capacity, RequestUpdate
from gristmill.engine.processor import check_add_request
from gristmill.engine.request import Request
from gristmill.engine.scheduler import Scheduler
from gristmill.errors import RequestError
from gristmill.step import SchedulerOutput, StepTokens
from gristmill.structured.reasoning_gate import GatedMatcher, ReasoningGate
from gristmill.structured.spec import parse_constraint
from gristmill.tasks import is_pooling


class Executor(Protocol):
    """What the core needs from the model side (gristmill.model.runner.ModelRunner). For
    async scheduling an executor also has `launch(out) -> LaunchedStep`, which starts a
    step and gives its tokens later, and `prefers_async`: whether that pays on it (a GPU
    does the work; the host is free)."""

    num_blocks: int
    max_model_len: int
    vocab_size: int

    def execute(self, out: SchedulerOutput) -> StepTokens: ...

    def make_device_error(self) -> None:
        """The `device_error` fault: make the device fail for real (see docs/faults.md)."""


class LaunchedStep(Protocol):
    def result(self) -> StepTokens: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 grammars: Callable[[frozenset[int]], object] | None = None):
        """`grammars(eos_token_ids)`: builds the structured-output grammar engine
        (gristmill.structured.grammars.Grammars) when a first request asks for one, with
        the end-of-sequence ids its client sent."""
        # (the limits the config leaves None, as the executor set them for its device)
        self.config = config = config.for_device(getattr(getattr(executor, "device", None), "type", "cpu"))
        self.executor = executor
        self._make_grammars = grammars
        self._grammars = None
        #: "generate", or the pooling task (embed, classify, score) every request runs.
        self.task = getattr(executor, "task", "generate")
        # (a pooling request needs the hidden state of every prompt token: none is skipped)
        self.block_manager = BlockManager(executor.num_blocks, config.block_size,
                                          config.enable_prefix_caching and not is_pooling(self.task))
        #: Which adapter each LoRA slot of the executor holds (enable_lora), or None.
        self.lora_slots = LoRASlots(config.max_loras, executor.load_lora) if config.enable_lora else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, executor.max_model_len, config.fast_forward,
                                   self.lora_slots)
        self.capacity = Capacity(executor.max_model_len, executor.num_blocks, config.block_size,
                                 executor.vocab_size, config.max_num_seqs,
                                 config.max_num_batched_tokens, self.task,
                                 getattr(executor, "pooler_info", None))
        self.num_steps = 0
        choice = config.async_scheduling
        self.async_scheduling = hasattr(executor, "launch") and (
            choice if choice is not None else getattr(executor, "prefers_async", False))
        #: Async scheduling: the step launched last and not yet resolved.
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        #: Set by the engine-core process to carry out the core_exit / core_hang faults of
        #: a scheduled request (they end or stall the process; an in-process core has none).
        self.process_fault: Callable[[str], None] | None = None

    def step(self) -> list[RequestUpdate]:
        self.num_steps += 1
        # A constrained request's token mask needs its last token (so do bad words of
        # several tokens): while one runs, steps are synchronous (the step in flight, if
        # any, is resolved first).
        synchronous = not self.async_scheduling or self.scheduler.num_constrained > 0
        resolved = self._resolve_in_flight() if synchronous else []
        out = self.scheduler.schedule()
        failed = self.scheduler.take_failed()  # (requests whose adapter failed to load)
        if faults.ACTIVE:
            self._inject_faults(out)
        if synchronous:
            return resolved + failed + self.scheduler.update(out, self.executor.execute(out))
        # Async scheduling: this step goes to the device before the last one's tokens
        # come back (its inputs read them there), so the host's work on those tokens
        # (stop checks, outputs, detokenizing, the next schedule) overlaps the device's.
        launched = self.executor.launch(out)
        updates = self._resolve_in_flight()
        self.scheduler.advance(out)
        self._in_flight = (out, launched)
        return updates + failed

    def _resolve_in_flight(self) -> list[RequestUpdate]:
        if self._in_flight is None:
            return []
        out, launched = self._in_flight
        self._in_flight = None
        return self.scheduler.resolve(out, launched.result())

    def _inject_faults(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            prompt = self.scheduler.requests[item.request_id].prompt
            if self.process_fault is not None and prompt is not None:
                for point in ("core_exit", "core_hang"):
                    if faults.fires(point, prompt=prompt):
                        self.process_fault(point)
            faults.check("forward", prompt=prompt, step=self.num_steps)
            if faults.fires("device_error", prompt=prompt, step=self.num_steps):
                self.executor.make_device_error()

    def add_request(self, message: AddRequest) -> RequestError | None:
        """Build and queue a Request from a wire message. Returns None, or the error that
        refused it; the core goes on either way.

        A message whose id is already in the engine ends that request too: the client
        and the core disagree about it, so neither can be trusted to finish."""
        try:
            check_add_request(message, self.capacity)
        except RequestError as exc:
            return exc
        request_id = message.request_id
        if message.lora is not None and self.lora_slots is None:
            return RequestError(f"the request names LoRA adapter {message.lora.lora_name!r}, but this engine was "
                                f"started without LoRA; start it with enable_lora=True", param="lora_request")
        if request_id in self.scheduler.requests:
            self.scheduler.finish_request(request_id, "error")
            return RequestError(f"request id {request_id!r} was sent while a request with that id was in the "
                                f"engine; both were ended, send each request under its own id", param="request_id")
        if message.pooling is not None:
            request = Request(request_id, list(message.prompt_token_ids), None, frozenset(),
                              message.fault_tag, pooling=message.pooling,
                              token_type_ids=message.token_type_ids, send_at_end=True, lora=message.lora)
            self.scheduler.add_request(request)
            return None
        try:
            matcher = self._matcher(message.sampling_params, message.eos_token_ids, message.reasoning)
        except RequestError as exc:
            return exc
        request = Request(request_id, list(message.prompt_token_ids), message.sampling_params,
                          frozenset(message.eos_token_ids), message.fault_tag, matcher=matcher,
                          bad_words_ids=tuple(tuple(word) for word in message.bad_words_ids),
                          send_at_end=message.send_at_end,
                          token_times=[] if message.send_at_end and message.token_times else None,
                          lora=message.lora)
        self.scheduler.add_request(request)
        return None

    def _matcher(self, params, eos_token_ids: frozenset[int], reasoning: ReasoningGate | None = None):
        """The structured-output matcher of a request, or None; a constraint the grammar
        engine cannot compile is a RequestError, before the request takes anything. With
        `reasoning`, the constraint (or none) applies after the reasoning."""
        constraint = parse_constraint(params.structured_output)
        matcher = None
        if constraint is not None:
            if self._grammars is None:
                if self._make_grammars is None:
                    raise RequestError("this engine has no grammar engine for structured_output",
                                       param="structured_output")
                self._grammars = self._make_grammars(frozenset(eos_token_ids))
            matcher = self._grammars.matcher(constraint)
        if reasoning is not None:
            return GatedMatcher(matcher, reasoning, frozenset(eos_token_ids))
        return matcher

    def abort(self, request_ids, reason: str = "abort") -> None:
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, reason)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False (nothing changed) while requests run."""
        return not self.scheduler.num_unfinished and self.block_manager.reset_prefix_cache()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "num_free_blocks": bm.num_free_blocks,
                "num_total_blocks": bm.num_total_blocks,
                "num_cached_blocks": bm.num_cached_blocks,
                "num_preemptions": self.scheduler.num_preemptions,
                # Since the engine started, in tokens: asked of the prefix cache, and found.
                "prefix_cache_queries": bm.num_query_tokens,
                "prefix_cache_hits": bm.num_hit_tokens,
                "prefix_cache_hit_rate": bm.num_hit_tokens / bm.num_query_tokens if bm.num_query_tokens else 0.0,
                # The threads its CPU work runs on (EngineConfig.cpu_threads), where the executor says.
                **({"cpu_threads": self.executor.cpu_threads} if hasattr(self.executor, "cpu_threads") else {}),
                **self._lora_stats()}

    def _lora_stats(self) -> dict:
        if self.lora_slots is None:
            return {}
        # The adapters in slots (least recently used first), and loads since the start.
        return {"lora_adapters": self.lora_slots.loaded, "num_lora_loads": self.lora_slots.num_loads}
