"""The types both sides of a boundary need, and nothing else.

- What a step did per request (`RequestUpdate`), the engine core's output.
- The wire between an engine client and the engine-core process: small typed structs,
  pickled one per frame (`wire.py`) over a pipe. The client sends `AddRequest` (never a
  scheduler `Request`: the core builds its own) or `AddRequests` (a request's n
  completions), `Abort`, `StatsQuery` and `Shutdown`; the core answers with
  `Ready` (or `CoreFailed`), `StepOutputs`, `Rejected` and `StatsReply`.

The step contract between the scheduler and the model runner is gristmill/step.py. This
module imports neither side (no scheduler, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from gristmill.config import EngineConfig
from gristmill.lora import LoRARequest
from gristmill.outputs import Logprob
from gristmill.pooling_params import PoolerInfo, PoolingParams
from gristmill.sampling import SamplingParams
from gristmill.structured.reasoning_gate import ReasoningGate


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request (the engine core's output per request)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    #: "<ErrorType>: <message>" when finish_reason is "error".
    error: str | None = None
    #: A `send_at_end` request's last update, when its client asked for them
    #: (`AddRequest.token_times`): when each of its output tokens became known in the
    #: core (`time.monotonic()`, one per token).
    token_times: list[float] | None = None
    #: A pooling request's result (a float32 numpy array), in its last update.
    pooled: object | None = None
    #: With `SamplingParams.prompt_logprobs`: an entry per prompt token from the second
    #: ({token_id: Logprob}: the token's, then the top-k), in its first update.
    prompt_logprobs: list[dict[int, Logprob]] | None = None


# -- client -> core ----------------------------------------------------------------

@dataclass(slots=True)
class Start:
    """The first message to a core: what to build."""

    config: EngineConfig



@dataclass(slots=True)
class AddRequest:
    """One sequence to generate. The core validates it and builds its own Request."""

    request_id: str
    prompt_token_ids: list[int]
    #: How it samples; None for a pooling request (`pooling`).
    sampling_params: SamplingParams | None
    #: Token ids that end the request unless `sampling_params.ignore_eos`.
    eos_token_ids: frozenset[int]
    #: The prompt text, sent only while fault injection is on (its triggers match it).
    fault_tag: str | None = None
    #: `sampling_params.bad_words` as token id sequences (the client tokenizes them).
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    #: The client reads nothing of it before it ends (no stop strings, no logprobs, no
    #: stream): the core sends one update, at its end, with every token, instead of one a
    #: step (`Request.send_at_end`).
    send_at_end: bool = False
    #: With `send_at_end`: the core notes when each token becomes known and sends those
    #: times with the tokens (`RequestUpdate.token_times`), for the client's latency
    #: metrics (time to first token, between tokens).
    token_times: bool = False
    #: A pooling engine's request (embed, classify, score): computed in one step, no
    #: sampling (`sampling_params` is None); its result is `RequestUpdate.pooled`.
    pooling: PoolingParams | None = None
    #: A text pair's token types (0: the first text, 1: the second), for the models
    #: that read them (BERT); None: all 0.
    token_type_ids: list[int] | None = None
    #: A chat on a reasoning model whose constraint applies after the reasoning, or
    #: whose reasoning has a budget (`sampling_params.max_reasoning_tokens`); None: the
    #: constraint, if any, applies from the first token.
    reasoning: ReasoningGate | None = None
    #: The LoRA adapter it runs with (an engine started with enable_lora), or None: the base model.
    lora: LoRARequest | None = None


@dataclass(slots=True)
class AddRequests:
    """The completions of one request (n > 1), sent together so that the core schedules
    them in the same step."""

    requests: list[AddRequest]


def request_ids_of(message) -> list[str]:
    """The ids of the requests a client -> core message adds (none for the others)."""
    if isinstance(message, AddRequests):
        return [getattr(r, "request_id", "") for r in message.requests]
    request_id = getattr(message, "request_id", None)
    return [request_id] if isinstance(request_id, str) else []


@dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclass(slots=True)
class StatsQuery:
    token: int


@dataclass(slots=True)
class Shutdown:
    pass


# -- core -> client ----------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class Capacity:
    """What an engine can hold; the client validates requests against it."""

    max_model_len: int
    num_total_blocks: int
    block_size: int
    vocab_size: int
    #: The step limits the core runs with: the config's, or its device's defaults.
    max_num_seqs: int
    max_num_batched_tokens: int
    #: "generate", or the pooling task it runs.
    task: str = "generate"
    #: A pooling engine's model: its output size, labels, defaults.
    pooler: PoolerInfo | None = None

    @property
    def max_tokens_per_request(self) -> int:
        """Most tokens (prompt + output) one request can ever have."""
        return min(self.max_model_len, self.num_total_blocks * self.block_size)


@dataclass(slots=True)
class Ready:
    capacity: Capacity
    #: A CPU engine's memory figures as its load checked them (model.memory.MemoryNeed):
    #: what its client says of them if the kernel's OOM killer ends the core later.
    memory_need: object = None


@dataclass(slots=True)
class CoreFailed:
    """The core cannot go on; `message` is the original error."""

    message: str


@dataclass(slots=True)
class StepOutputs:
    step: int
    updates: list[RequestUpdate]


@dataclass(slots=True)
class Rejected:
    """The core refused an AddRequest (malformed, invalid or a duplicate id); only that
    request ends, with `error` ("<ErrorType>: <message>")."""

    request_id: str
    error: str
    #: The request field the error names (`RequestError.param`), when it names one.
    param: str | None = None


@dataclass(slots=True)
class StatsReply:
    token: int
    stats: dict
