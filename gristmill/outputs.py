"""What a finished (or streaming) request gives back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one step, as vLLM's `Logprob`. Of the distribution
    the token was sampled from: the model's logits after logit_bias, penalties, bans and
    a structured-output mask, before temperature, top-k, top-p and min-p."""

    logprob: float
    #: Its place in that distribution, from 1 (the most likely token); the sampled
    #: token's true rank, also when it is not among the top-k.
    rank: int | None = None
    #: Its text, decoded alone (the engine's client fills it in).
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    #: "stop", "length", "abort" or "error" ("tool_calls" from `LLM.chat` with tools when it
    #: stopped after calling); None while still generating.
    finish_reason: str | None = None
    #: Per generated token, {token_id: Logprob} for the sampled token and the top-k.
    logprobs: list[dict[int, Logprob]] | None = None
    #: Text added since the previous streamed output.
    delta_text: str = ""
    #: "<ErrorType>: <message>" when finish_reason is "error".
    error: str | None = None
    #: As vLLM's: the stop string or `stop_token_ids` entry that ended it (None for EOS,
    #: a length limit, a complete grammar).
    stop_reason: str | int | None = None
    #: The sum of its tokens' logprobs, when it asked for logprobs.
    cumulative_logprob: float | None = None
    #: `LLM.chat` on a reasoning model: the reasoning (the text between `<think>` and
    #: `</think>`, stripped), while `text` holds only the answer; None when it had none.
    reasoning: str | None = None
    #: `LLM.chat` with tools: the calls read from the answer (ToolCall: `name`, `arguments`
    #: a dict; empty when it made none), while `text` holds the text around them; None
    #: without tools.
    tool_calls: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request's tokens reached its client (`time.monotonic()` seconds)."""

    arrival_time: float
    #: (time, tokens) for each engine step that brought the request tokens, so an output
    #: asked for only when it finishes still tells its latencies.
    token_arrivals: list[tuple[float, int]] = field(default_factory=list)

    @property
    def first_token_time(self) -> float | None:
        return self.token_arrivals[0][0] if self.token_arrivals else None


@dataclass
class RequestOutput:
    """A request's result. `text`, `token_ids`, ... are those of its first completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    #: Timings (AsyncEngine); updated until the request finishes. None offline (LLM).
    metrics: RequestMetrics | None = None
    #: With `SamplingParams.prompt_logprobs`, as vLLM's: per prompt token, {token_id:
    #: Logprob} of it after the tokens before it and the top-k others there; None for the
    #: first token (nothing comes before it). None when not asked for (or not yet known).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs

    @property
    def delta_text(self) -> str:
        return self.outputs[0].delta_text

    @property
    def error(self) -> str | None:
        return next((o.error for o in self.outputs if o.error), None)


# -- pooling engines (embed, classify, score) ---------------------------------------

@dataclass
class PoolingOutput:
    """What a pooling request computed: its vector, as the model's pooler and the
    request's PoolingParams made it (a float32 numpy array)."""

    data: object


@dataclass
class EmbeddingOutput:
    #: The embedding (normalized unless the request or the model says not to).
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    #: One probability per label (model's id2label order), or the raw logits when the
    #: request turned the activation off.
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    #: A cross-encoder's relevance (a probability, unless the activation is off), or the
    #: cosine of two embeddings.
    score: float


@dataclass
class PoolingRequestOutput:
    """A pooling request's result, as vLLM's: `outputs` is one object (`PoolingOutput`,
    or `EmbeddingOutput`, `ClassificationOutput`, `ScoringOutput` by the call that made
    it), None until it finishes and when it fails; then `error` says why."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: object = None
    #: "stop" (computed), "abort" or "error"; None while running.
    finish_reason: str | None = None
    #: "<ErrorType>: <message>" when finish_reason is "error".
    error: str | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`LLM.embed`'s: `outputs.embedding`."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """`LLM.classify`'s: `outputs.probs`."""


class ScoringRequestOutput(PoolingRequestOutput):
    """`LLM.score`'s: `outputs.score`."""


def pooled_output(kind: str, data) -> object:
    """The `outputs` of a pooling request whose caller asked for `kind` ("embed",
    "classify", "score" or "encode"), from the engine's vector (float32 numpy)."""
    if kind == "embed":
        return EmbeddingOutput(data.tolist())
    if kind == "classify":
        return ClassificationOutput(data.tolist())
    if kind == "score":
        return ScoringOutput(float(data[0]))
    return PoolingOutput(data)


#: The request output class of each kind of pooling call.
POOLING_OUTPUT_CLASSES = {"embed": EmbeddingRequestOutput, "classify": ClassificationRequestOutput,
                          "score": ScoringRequestOutput, "encode": PoolingRequestOutput}
