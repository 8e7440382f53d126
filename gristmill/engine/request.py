"""Request: the state of one sequence inside the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gristmill.lora import LoRARequest
from gristmill.pooling_params import PoolingParams
from gristmill.sampling import SamplingParams
from gristmill.step import PLACEHOLDER, ScheduledRequest

__all__ = ["PLACEHOLDER", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token ids and progress of one sequence.

    Invariant: `token_ids` is the prompt followed by every sampled token, and the KV
    cache holds the first `num_computed_tokens` of them in the blocks `block_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    #: How it samples; None for a pooling request (`pooling`), which samples nothing.
    sampling_params: SamplingParams | None
    #: Token ids that end the request unless `ignore_eos` (the model's EOS ids).
    eos_token_ids: frozenset[int] = frozenset()
    #: The prompt text, when there is one (fault-injection triggers match on it).
    prompt: str | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    #: Hashes of its first full blocks (`kv_blocks.block_hash` chained), filled in by the
    #: block manager as it needs them; tokens are only appended, so they stay valid.
    block_hashes: list[bytes] = field(default_factory=list)
    #: Its last token is a PLACEHOLDER: a step that samples it was launched, not yet resolved.
    pending: bool = False
    #: The pending token is its last whatever it is (max_tokens or max_model_len is
    #: reached): it is not scheduled again.
    last_pending: bool = False
    #: Its structured-output matcher (gristmill.structured.grammars.Matcher), or None.
    matcher: object | None = None
    #: Its bad_words as token id sequences (`InputProcessor.bad_words_ids`).
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    #: Its client wants only the end (`AddRequest.send_at_end`): no update until it ends,
    #: then one with every output token.
    send_at_end: bool = False
    #: With `send_at_end`, when the client wants them (`AddRequest.token_times`): when
    #: each output token became known (`time.monotonic()`); else None.
    token_times: list[float] | None = None
    #: A pooling request's params (`AddRequest.pooling`): its prompt is computed in one
    #: step and pooled, and it ends there. None: it generates.
    pooling: PoolingParams | None = None
    #: A pooling request's token types (`AddRequest.token_type_ids`), or None.
    token_type_ids: list[int] | None = None
    #: The LoRA adapter it runs with (`AddRequest.lora`), or None: the base model.
    lora: LoRARequest | None = None
    #: The adapter slot it holds while it runs (engine/lora_slots.py), else -1.
    lora_slot: int = -1

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.pooling is not None:
            self._pooling_post_init()
            return
        params = self.sampling_params
        #: It asks for a logits control (model/logits.py): a bias, a ban or a penalty.
        self.controlled = bool(params.logit_bias or params.min_tokens or self.bad_words_ids or params.penalized)
        #: Its next token is the argmax of the logits as they are: greedy, no logprobs, no
        #: control, no constraint (a step of such rows only needs the forward's argmax).
        self.plain = (params.greedy and params.logprobs is None and not self.controlled
                      and self.matcher is None and params.prompt_logprobs is None)
        #: The tokens its grammar forces may be appended unsampled (`EngineConfig.fast_forward`):
        #: no logprobs or logits control would have seen each of them sampled.
        self.may_fast_forward = self.matcher is not None and params.logprobs is None and not self.controlled
        #: With `prompt_logprobs`: each prompt token's entry (from its second), gathered
        #: over its prefill chunks and sent with its first output token; None: not asked.
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
        #: The token ids that end it once `min_tokens` are out: EOS (unless ignore_eos)
        #: and stop_token_ids.
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        #: `num_tokens` at which it ends on length: max_tokens, and the context once the
        #: scheduler says how long that is (`limit_length`).
        self.length_limit = self.num_prompt_tokens + params.max_tokens if params.max_tokens is not None else 1 << 62
        #: What its first block's prefix-cache hash chains from: an adapter's key, so two
        #: adapters (or an adapter and the base) never share KV blocks.
        self.hash_seed = self.lora.cache_key if self.lora is not None else b""

    def _pooling_post_init(self) -> None:
        """A pooling request's state: its prompt, computed in one step, and no token
        after it (it ends with that step, `Scheduler.advance` / `resolve`)."""
        self.controlled, self.plain, self.may_fast_forward = False, True, False
        self.prompt_logprobs, self.stop_ids = None, frozenset()
        self.length_limit = self.num_prompt_tokens
        self.hash_seed = self.lora.cache_key if self.lora is not None else b""

    def limit_length(self, max_model_len: int) -> None:
        """It also ends when its sequence reaches `max_model_len` tokens."""
        self.length_limit = min(self.length_limit, max_model_len)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def scheduled(self, num_new_tokens: int) -> ScheduledRequest:
        """Its part of a step that computes its next `num_new_tokens` tokens, as the runner
        sees it. Shares `token_ids` and `block_ids` (see ScheduledRequest): no copy of them."""
        computed, token_ids = self.num_computed_tokens, self.token_ids
        end = computed + num_new_tokens
        return ScheduledRequest(self.request_id, token_ids[computed:end], computed, self.block_ids,
                                end == len(token_ids), self.pending, token_ids, self.num_prompt_tokens,
                                self.sampling_params, self.eos_token_ids, self.bad_words_ids, self.matcher,
                                self.controlled, self.pooling, self.token_type_ids, self.lora_slot)

    def scheduled_decode(self) -> ScheduledRequest:
        """`scheduled(1)` for a request whose one new token is its last (a decode)."""
        return ScheduledRequest(self.request_id, self.token_ids[-1:], self.num_computed_tokens, self.block_ids,
                                True, self.pending, self.token_ids, self.num_prompt_tokens,
                                self.sampling_params, self.eos_token_ids, self.bad_words_ids, self.matcher,
                                self.controlled, None, None, self.lora_slot)

    @property
    def needs_known_tokens(self) -> bool:
        """Choosing its next token needs every token before it on the host (a grammar
        matcher, a bad word of several tokens): its steps cannot run ahead (async
        scheduling). Fixed once it is in the scheduler."""
        return self.matcher is not None or any(len(word) > 1 for word in self.bad_words_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known: all but a pending placeholder."""
        return len(self.token_ids) - self.pending

    def stop_reason_after(self, token_id: int, reaches_length: bool) -> str | None:
        """The finish reason once `token_id` was appended, or None to go on.
        `reaches_length`: whether the sequence has `length_limit` tokens with it."""
        if token_id in self.stop_ids and self.num_output_tokens > self.sampling_params.min_tokens:
            return "stop"  # (before min_tokens the sampler allowed no stop token)
        return "length" if reaches_length else None
