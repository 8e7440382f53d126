"""Scheduler: continuous batching over a token budget, chunked prefill, preemption.

Tokens are scheduled, not phases: each request has `num_computed_tokens` and
`num_tokens`, and a step gives each scheduled request some of the difference. A
prefill that does not fit the budget is split over steps (chunked prefill). When KV
blocks run out, the most recently admitted running request is preempted: its blocks
are freed and it goes back to the front of the waiting queue to be recomputed.

With prefix caching, a waiting request is admitted with the cached blocks that match
the start of its sequence (`BlockManager.cached_prefix`) and starts at their end:
`num_computed_tokens` is their token count, so only the rest is scheduled. A preempted
request comes back the same way and reuses whatever of its own blocks is still cached.

A request with a LoRA adapter is admitted only with a slot for it (`LoRASlots`: loaded
on demand, least recently used out); while every slot is held by running requests it
waits, and requests behind it that need no new slot go first. An adapter that fails to
load ends every waiting request naming it, with the error; nothing else.
"""

from __future__ import annotations

import time
from collections import deque

from gristmill import faults
from gristmill.engine.kv_blocks import BlockManager
from gristmill.engine.lora_slots import LoRASlots
from gristmill.engine.messages import RequestUpdate
from gristmill.engine.request import PLACEHOLDER, Request, RequestStatus
from gristmill.errors import LoRAAdapterError, error_string
from gristmill.step import SchedulerOutput, StepTokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, fast_forward: bool = False,
                 lora_slots: LoRASlots | None = None):
        self.block_manager = block_manager
        #: The LoRA adapter slots (an engine with enable_lora), or None.
        self.lora_slots = lora_slots
        #: Updates of requests that ended while a step was scheduled (an adapter that
        #: failed to load), for the engine core to send (`take_failed`).
        self._failed: list[RequestUpdate] = []
        #: Append the tokens a request's grammar forces (`EngineConfig.fast_forward`).
        self.fast_forward = fast_forward
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        #: Unfinished requests whose next token needs all their tokens on the host
        #: (`Request.needs_known_tokens`: structured output, bad words of several tokens).
        self.num_constrained = 0
        #: Unfinished requests that are not `Request.plain`: while there are none, every
        #: step is all plain greedy rows (`SchedulerOutput.plain`).
        self.num_not_plain = 0
        #: Requests preempted since the engine started (their blocks freed, recomputed later).
        self.num_preemptions = 0

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.limit_length(self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_constrained += request.needs_known_tokens
        self.num_not_plain += not request.plain

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """End a request now (abort, error, stop string): free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request, reason)
        return request

    def _release(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.num_constrained -= request.needs_known_tokens
        self.num_not_plain -= not request.plain
        self.block_manager.free(request)
        self._release_lora_slot(request)
        self._finished_ids.append(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids, plain=self.num_not_plain == 0)
        self._finished_ids = []
        budget = self.max_num_batched_tokens

        # Running requests first, oldest first; preempt the newest when blocks run out.
        bs = self.block_manager.block_size
        scheduled, running = out.scheduled, self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.last_pending:  # its last token is still being sampled
                i += 1
                continue
            computed = request.num_computed_tokens
            token_ids = request.token_ids
            within = computed % bs
            if (len(token_ids) == computed + 1 and within and (within < bs - 1 or request.pending)
                    and computed < len(request.block_ids) * bs):
                # Most decodes: the token lands in a block the request holds, and fills no
                # block whose hash the block manager would register now (a placeholder's
                # block is named at the next step, once its last token is known).
                scheduled.append(request.scheduled_decode())
                budget -= 1
                i += 1
                continue
            num_new = min(len(token_ids) - computed, budget)
            total = computed + num_new
            while not self.block_manager.can_allocate(request, total):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self.block_manager.allocate(request, total)
            out.scheduled.append(request.scheduled(num_new))
            budget -= num_new
            i += 1

        # Then admit waiting requests while there is room, unless this step preempted.
        waiting, skipped = self.waiting, 0
        while (len(waiting) > skipped and not out.preempted_request_ids and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = waiting[skipped]
            if request.lora is not None and not self._take_lora_slot(request):
                if not request.is_finished:  # every slot is held: it waits, those behind it may go
                    skipped += 1
                    if skipped > _LORA_LOOKAHEAD:
                        break
                continue
            # (its prompt logprobs need every prompt token computed: no cached prefix)
            computed = self.block_manager.cached_prefix(request) if request.prompt_logprobs is None else []
            num_computed = len(computed) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if request.pooling is not None and num_new < request.num_tokens:
                self._release_lora_slot(request)
                break  # a pooling prompt is never split: it waits for a step with room
            total = num_computed + num_new
            if not self.block_manager.can_allocate(request, total, computed):
                self._release_lora_slot(request)
                break
            if skipped:
                del waiting[skipped]
            else:
                waiting.popleft()
            request.num_computed_tokens = num_computed
            self.block_manager.allocate(request, total, computed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(request.scheduled(num_new))
            budget -= num_new
        return out

    def _take_lora_slot(self, request: Request) -> bool:
        """Give a waiting request a slot holding its adapter (loaded now if needed). False
        when every slot is held by running requests, or when its adapter failed to load:
        then it, and every waiting request naming that adapter, ended with the error."""
        if self.lora_slots is None:  # (the engine core refuses such a request at once)
            raise RuntimeError("a request with a LoRA adapter reached a scheduler without LoRA slots")
        try:
            slot = self.lora_slots.acquire(request.lora)
        except LoRAAdapterError as exc:
            for other in [r for r in self.waiting if r.lora is not None and r.lora.same_adapter(request.lora)]:
                self.finish_request(other.request_id, "error")
                self._failed.append(RequestUpdate(other.request_id, other.output_token_ids if other.send_at_end
                                                  else [], None, "error", error_string(exc), other.token_times))
            return False
        request.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _release_lora_slot(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1

    def take_failed(self) -> list[RequestUpdate]:
        """The updates of requests ended while steps were scheduled since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def _preempt(self, request: Request) -> None:
        if request.prompt_logprobs is not None and len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
            request.prompt_logprobs.clear()  # (its prompt is computed again, from the start)
        self.block_manager.free(request)
        self._release_lora_slot(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: StepTokens) -> list[RequestUpdate]:
        """Apply a step's results: advance progress, append tokens, end finished requests."""
        self.advance(out)
        return self.resolve(out, sampled)

    def advance(self, out: SchedulerOutput) -> None:
        """A step was launched: its tokens count as computed, and each request it samples
        gets a PLACEHOLDER token, so the next step can be scheduled before this one ends
        (async scheduling). A request whose next token is its last either way is `final`."""
        requests, num_sampled = self.requests, 0
        for item in out.scheduled:
            request = requests.get(item.request_id)
            if request is None:  # ended (aborted) before the step was launched
                num_sampled += item.samples
                continue
            request.num_computed_tokens += len(item.new_token_ids)
            if item.samples and request.pooling is not None:
                num_sampled += 1  # (pooled, not sampled: no token follows its prompt)
                request.last_pending = True
            elif item.samples:
                num_sampled += 1
                token_ids = request.token_ids
                token_ids.append(PLACEHOLDER)
                request.pending = True
                request.last_pending = len(token_ids) >= request.length_limit
        out.num_sampled = num_sampled

    def resolve(self, out: SchedulerOutput, sampled: StepTokens) -> list[RequestUpdate]:
        """A step's sampled tokens are known: put them in place of the placeholders, end
        the requests they finish. `sampled` holds a token for each request of `out` that
        samples. A request that ended since has left `requests`; one added since under
        the same id is not pending yet (a step is advanced after the one before it is
        resolved), so neither is touched."""
        updates, requests, now = [], self.requests, time.monotonic()
        if sampled.pooled is not None:
            return self._resolve_pooled(out, sampled)
        if not len(sampled.request_ids) == len(sampled.token_ids) == len(sampled.logprobs) == out.num_sampled:
            # (else a row without its token would stay pending, and its placeholder be fed on)
            raise RuntimeError(f"the executor returned {len(sampled.request_ids)} request ids, "
                               f"{len(sampled.token_ids)} tokens and {len(sampled.logprobs)} logprobs "
                               f"for a step that samples {out.num_sampled} rows")
        if sampled.prompt_logprobs:
            for request_id, entries in sampled.prompt_logprobs.items():
                request = requests.get(request_id)
                # (a prompt computed again after a preemption: its entries are had already)
                if request is not None and request.prompt_logprobs is not None and \
                        len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
                    request.prompt_logprobs.extend(entries)
        for request_id, token_id, logprobs in zip(sampled.request_ids, sampled.token_ids, sampled.logprobs):
            request = requests.get(request_id)
            if request is None or not request.pending:  # ended while the step ran
                continue
            request.token_ids[-1] = token_id
            request.pending = False
            if request.token_times is not None:
                request.token_times.append(now)
            logprobs = None if logprobs is None else [logprobs]
            new_token_ids, reason, error = [token_id], None, None
            if token_id in request.stop_ids or request.last_pending or request.matcher is not None:
                reason = request.stop_reason_after(token_id, request.last_pending)
                request.last_pending = False
                if request.matcher is not None:
                    reason, error = _constrained(request, token_id, reason)
            if reason is None and self.fast_forward and request.may_fast_forward:
                forced = self._fast_forward(request)
                if forced:
                    new_token_ids += forced
                    if request.token_times is not None:
                        request.token_times.extend([now] * len(forced))
                    if request.matcher.finished:  # (the forced text completed the grammar)
                        reason = "stop"
            if reason is not None:
                self.finish_request(request_id, reason)
                updates.append(RequestUpdate(request_id, request.output_token_ids if request.send_at_end
                                             else new_token_ids, logprobs, reason, error, request.token_times,
                                             prompt_logprobs=_prompt_logprobs(request)))
            elif not request.send_at_end:  # (a send_at_end request is heard of only at its end)
                updates.append(RequestUpdate(request_id, new_token_ids, logprobs, None,
                                             prompt_logprobs=_prompt_logprobs(request)))
        return updates

    @staticmethod
    def _fast_forward(request: Request) -> list[int]:
        """Append the tokens the request's grammar forces next (its matcher takes each),
        leaving room for a sampled token before its length limit; they are computed with
        the token before them in its next step, which samples after them. A stop token
        is left to be sampled, so it ends the request as usual."""
        matcher, forced = request.matcher, []
        room = request.length_limit - len(request.token_ids) - 1
        while len(forced) < room:
            more = matcher.forced_tokens()[:room - len(forced)]
            taken = 0
            for token_id in more:
                if token_id in request.stop_ids or not matcher.accept(token_id):
                    break  # (a refused token leaves the matcher in error: the next step says so)
                taken += 1
            forced += more[:taken]
            if not more or taken < len(more):
                break
        request.token_ids.extend(forced)
        return forced


    def _resolve_pooled(self, out: SchedulerOutput, sampled: StepTokens) -> list[RequestUpdate]:
        """A pooling step's results: each request ends with its vector, no token."""
        if not len(sampled.request_ids) == len(sampled.pooled) == out.num_sampled:
            raise RuntimeError(f"the executor returned {len(sampled.request_ids)} request ids and "
                               f"{len(sampled.pooled)} pooled results for a step of {out.num_sampled} rows")
        updates = []
        for request_id, pooled in zip(sampled.request_ids, sampled.pooled):
            request = self.requests.get(request_id)
            if request is None or not request.last_pending:  # ended while the step ran
                continue
            request.last_pending = False
            self.finish_request(request_id, "stop")
            updates.append(RequestUpdate(request_id, [], None, "stop", pooled=pooled))
        return updates


#: Most waiting requests passed over for one that waits for a LoRA slot, per step (the
#: scan of the queue stays bounded when many wait for adapters).
_LORA_LOOKAHEAD = 256


def _prompt_logprobs(request: Request) -> list | None:
    """A request's prompt logprobs, sent once: with its first output token (or, sent at
    its end, with all of them)."""
    if request.prompt_logprobs is None or (request.num_output_tokens > 1 and not request.send_at_end):
        return None
    return request.prompt_logprobs


def _constrained(request: Request, token_id: int, reason: str | None) -> tuple[str | None, str | None]:
    """(finish reason, error) once a constrained request sampled `token_id`: its matcher
    takes the token; a token the grammar does not allow (the sampler allows only those
    it does, so: no token was allowed) or an engine error ends the request with an
    error; a complete grammar ends it with "stop"."""
    try:
        if faults.ACTIVE:
            faults.check("grammar", prompt=request.prompt)
        accepted = request.matcher.accept(token_id)
        finished = accepted and request.matcher.finished
        why = request.matcher.error  # the engine gave up (it may still have allowed only EOS)
    except Exception as exc:  # noqa: BLE001 - this request fails, not the engine
        return "error", f"GenerationError: the grammar engine failed on token {token_id}: {exc}"
    if not accepted or why:
        return "error", (f"GenerationError: the structured output constraint allows no token after "
                         f"{request.num_output_tokens - 1} generated tokens; it cannot be satisfied from here"
                         + (f" (grammar engine: {why})" if why else f" (token {token_id} was not allowed)"))
    if finished and reason is None and request.num_output_tokens < request.sampling_params.min_tokens:
        return "error", (f"GenerationError: the structured output constraint is complete after "
                         f"{request.num_output_tokens} generated tokens, before min_tokens "
                         f"({request.sampling_params.min_tokens}); lower min_tokens or leave it out")
    return ("stop" if finished and reason is None else reason), None
