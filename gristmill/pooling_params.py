"""PoolingParams: how one request of a pooling engine (embed, classify, score) is computed.

A pooling request runs the model over its prompt once, with no sampling: the hidden
states of its tokens become one vector (mean, CLS or last token, as the model's
sentence-transformers files say), an embedding or a classifier's logits. What a request
may change of that is here; everything else is the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gristmill.errors import RequestError

#: What an engine does with its model (`EngineConfig.task`): generate text, or pool.
POOLING_TASKS = ("embed", "classify", "score")
TASKS = ("generate", *POOLING_TASKS)


@dataclass(slots=True)
class PoolingParams:
    """Invalid values raise `RequestError` naming the field."""

    #: Keep the first `dimensions` values of the embedding (before it is normalized): only
    #: for models trained for it (Matryoshka); others refuse it. None: all of them.
    dimensions: int | None = None
    #: Scale the embedding to unit length. None: the model's default (its
    #: sentence-transformers Normalize module; True for a model without those files).
    normalize: bool | None = None
    #: Classification and scoring: turn the logits into probabilities (softmax, or a
    #: sigmoid for one label). None: yes; False: the raw logits.
    use_activation: bool | None = None
    #: Cut a prompt longer than this many tokens to this many (a text by its tokenizer,
    #: which keeps its special tokens; token ids to their last ones); -1: to what the
    #: engine can take. None: a longer prompt is refused (PromptTooLongError).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str):
            if not ok:
                raise RequestError(message, param=param)

        check(self.dimensions is None or (_is_int(self.dimensions) and self.dimensions > 0), "dimensions",
              f"dimensions must be a positive integer or None, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            check(value in (None, True, False), name, f"{name} must be True, False or None, got {value!r}")
        check(self.truncate_prompt_tokens is None or (
            _is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens > 0
                                                      or self.truncate_prompt_tokens == -1)),
              "truncate_prompt_tokens", f"truncate_prompt_tokens must be a positive integer, -1 (as many as the "
                                        f"engine takes) or None, got {self.truncate_prompt_tokens!r}")

    def clone(self, **changes) -> "PoolingParams":
        return replace(self, **changes)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class PoolerInfo:
    """What a pooling engine's model gives, as the client validates requests against it
    and the server describes it (`Capacity.pooler`)."""

    #: What the pooler gives: "embed" (embeddings) or "classify" (a classifier's logits).
    head: str
    #: Values in an embedding, or labels of a classifier.
    dimensions: int
    #: The sizes a Matryoshka model was trained to be cut to; None: it cannot be cut.
    matryoshka_dimensions: tuple[int, ...] | None = None
    #: Embeddings are normalized unless a request says (the model's Normalize module).
    default_normalize: bool = True
    #: A classifier's label names (id2label, in order); None when the model names none.
    labels: tuple[str, ...] | None = None
