"""The step contract between the scheduler (engine/) and the model runner (model/).

Each step the scheduler hands the runner a `SchedulerOutput`: one `ScheduledRequest` per
request it gives tokens to, a record of what the runner needs of that request, never the
scheduler's own `Request`. The runner answers with `StepTokens`: a token for each request
whose sequence end the step reached.

This module imports neither side (no scheduler, no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gristmill.outputs import Logprob
from gristmill.pooling_params import PoolingParams
from gristmill.sampling import SamplingParams

#: Stands in a request's token ids for a token sampled by a step still running on the
#: device (async scheduling); the runner reads the real id from that step's output.
PLACEHOLDER = -1


@dataclass(slots=True, repr=False)
class ScheduledRequest:
    """One request's part of a step, as the runner sees it; built when the step is
    scheduled.

    `new_token_ids` is a copy of the tokens the step computes (a decode's one token, a
    prefill chunk). `token_ids` and `block_ids` are the scheduler's own lists, shared
    rather than copied: a copy would cost O(sequence length) per request and step.
    Invariant: the runner reads them only while it launches the step, before the
    scheduler moves the request on (`Scheduler.advance` runs after `launch` returns), and
    never writes them. So when a row samples, `token_ids` ends with this step's last
    token: `len(token_ids) == num_computed_tokens + num_new_tokens`.
    """

    request_id: str
    #: The tokens this step computes: token_ids[num_computed_tokens : +num_new_tokens].
    #: The last is a PLACEHOLDER when `pending`.
    new_token_ids: list[int]
    #: Tokens already in the KV cache: the position of the first new token.
    num_computed_tokens: int
    #: KV blocks of the sequence, enough for this step's tokens (shared; see above).
    block_ids: Sequence[int]
    #: True when this step reaches the end of the sequence, so a token is sampled.
    samples: bool
    #: The last token is a PLACEHOLDER: sampled by the step before, not on the host yet.
    pending: bool
    #: The prompt followed by every sampled token (shared; see above): what penalties,
    #: bad words and the structured-output state read.
    token_ids: Sequence[int]
    num_prompt_tokens: int
    #: None for a pooling request (`pooling`).
    sampling_params: SamplingParams | None
    #: Token ids that end the request unless `sampling_params.ignore_eos`.
    eos_token_ids: frozenset[int]
    #: `sampling_params.bad_words` as token id sequences.
    bad_words_ids: tuple[tuple[int, ...], ...]
    #: Its structured-output matcher (gristmill.structured.grammars.Matcher), or None.
    matcher: object | None
    #: It asks for a logits control (model/logits.py): a bias, a ban or a penalty.
    controlled: bool
    #: A pooling request's params (its whole prompt is in this step; nothing is
    #: sampled: the runner pools its hidden states), else None.
    pooling: PoolingParams | None = None
    #: A pooling request's token types (a text pair's), or None (all 0).
    token_type_ids: Sequence[int] | None = None
    #: The LoRA adapter slot its rows use (the runner's slots, filled by the scheduler
    #: before the step), or -1: the base model.
    lora_slot: int = -1

    def __repr__(self) -> str:
        return (f"ScheduledRequest({self.request_id!r}, num_computed_tokens={self.num_computed_tokens}, "
                f"num_new_tokens={self.num_new_tokens}, samples={self.samples}, pending={self.pending})")

    @property
    def num_new_tokens(self) -> int:
        return len(self.new_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, a pending one included."""
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner computes in one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    #: Requests that ended since the previous step; the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    #: Every request it samples is `Request.plain` (greedy, no logprobs, no logits
    #: control, no constraint): its tokens are the argmax of the logits. False: look.
    plain: bool = False
    #: Its rows that sample (`ScheduledRequest.samples`), counted once it is launched
    #: (`Scheduler.advance`): the executor must give back a token for each.
    num_sampled: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class StepTokens:
    """A step's sampled tokens as the runner gives them: three lists in the order of its
    sampled rows, no object per row."""

    request_ids: list[str]
    token_ids: list[int]
    #: Per row: {token_id: Logprob} of the sampled token and the top-k, or None.
    logprobs: list[dict[int, Logprob] | None]
    #: A pooling step's results (a float32 numpy array per row; `token_ids` and
    #: `logprobs` are then empty: a pooling request samples no token), else None.
    pooled: list | None = None
    #: request id -> the prompt logprobs this step computed for it (one entry per prompt
    #: token of its chunk that has a next prompt token), for requests that ask for them
    #: (`SamplingParams.prompt_logprobs`), sampled this step or not.
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] | None = None
