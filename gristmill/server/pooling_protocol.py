"""Request bodies of the pooling endpoints, as pydantic models: OpenAI's /v1/embeddings,
the Jina / Cohere-style /v1/rerank and /v2/rerank, and vLLM's /v1/score and
/v1/classify. Unknown fields are accepted and ignored (clients send `user`), except
those that would change the output (`UNSUPPORTED_POOLING`): a 400 names them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

EMBEDDINGS_PATH, CLASSIFY_PATH, SCORE_PATH = "/v1/embeddings", "/v1/classify", "/v1/score"
RERANK_PATHS = ("/v1/rerank", "/v2/rerank")
POOLING_PATHS = frozenset({EMBEDDINGS_PATH, CLASSIFY_PATH, SCORE_PATH, *RERANK_PATHS})

#: Fields other servers take on these endpoints that would change the output here, with
#: the value that changes nothing.
UNSUPPORTED_POOLING = {"priority": 0, "mm_processor_kwargs": {}, "chat_template": "", "messages": [],
                       "softmax": True, "activation": True, "max_chunks_per_doc": ()}

#: Fields of one pooling endpoint that another would have to ignore (refused there).
OTHER_ENDPOINTS_FIELDS = ("dimensions", "normalize", "encoding_format", "use_activation", "top_n",
                          "return_documents")

#: One input: a text, or token ids.
Input = str | list[StrictInt]


def _no_booleans(value):
    if isinstance(value, bool) or (isinstance(value, list) and any(
            isinstance(v, bool) or (isinstance(v, list) and any(isinstance(x, bool) for x in v)) for v in value)):
        raise ValueError(f"expected a text, token ids or a list of them, got {str(value).lower()}")
    return value


class _PoolingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    #: vLLM's: cut a longer input to this many tokens (-1: to what the engine takes).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    #: vLLM's: the tokenizer's special tokens ([CLS], [SEP], BOS) around each input.
    add_special_tokens: bool = True

    @field_validator("truncate_prompt_tokens", mode="before")
    @classmethod
    def _numbers(cls, value):
        return _no_booleans(value)

    @model_validator(mode="after")
    def _truncate_not_zero(self):
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be a positive number of tokens or -1 (as many as the "
                             "engine takes)")
        return self

    def unsupported_field(self) -> str | None:
        extra = self.model_extra or {}
        return next((name for name, neutral in UNSUPPORTED_POOLING.items()
                     if extra.get(name) is not None and extra[name] != neutral), None)

    def misplaced_field(self) -> str | None:
        """A field of another pooling endpoint, which would mean nothing here."""
        extra = self.model_extra or {}
        return next((name for name in OTHER_ENDPOINTS_FIELDS if extra.get(name) is not None), None)


class EmbeddingRequest(_PoolingFields):
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    #: Matryoshka models: keep the first `dimensions` values (others refuse it).
    dimensions: int | None = Field(default=None, ge=1)
    #: vLLM's: scale to unit length (None: the model's default).
    normalize: bool | None = None

    _inputs = field_validator("input", "dimensions", mode="before")(_no_booleans)

    @field_validator("encoding_format", mode="before")
    @classmethod
    def _null_format(cls, value):
        return "float" if value is None else value


class ClassificationRequest(_PoolingFields):
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    #: False: the raw logits instead of probabilities.
    use_activation: bool | None = None

    _inputs = field_validator("input", mode="before")(_no_booleans)


class ScoreRequest(_PoolingFields):
    """vLLM's: `text_1` (one text, or a list as long as `text_2`) against `text_2`; also
    under the names `queries` / `documents`."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    use_activation: bool | None = None

    @model_validator(mode="after")
    def _one_name_each(self):
        for first, second in (("text_1", "queries"), ("text_2", "documents")):
            if getattr(self, first) is not None and getattr(self, second) is not None:
                raise ValueError(f"send {first} or {second}, not both")
            if getattr(self, first) is None and getattr(self, second) is None:
                raise ValueError(f"{first} (or {second}) is required")
        return self

    @property
    def firsts(self) -> str | list[str]:
        return self.text_1 if self.text_1 is not None else self.queries

    @property
    def seconds(self) -> str | list[str]:
        return self.text_2 if self.text_2 is not None else self.documents


class RerankRequest(_PoolingFields):
    """Jina's and Cohere's: `documents` ranked by relevance to `query`."""

    query: str
    documents: list[str | dict] = Field(min_length=1)
    #: Return the best `top_n` (None or 0: all of them).
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    use_activation: bool | None = None

    @field_validator("top_n", mode="before")
    @classmethod
    def _count(cls, value):
        return _no_booleans(value)

    @field_validator("documents")
    @classmethod
    def _texts(cls, documents):
        for i, document in enumerate(documents):
            if isinstance(document, dict) and not isinstance(document.get("text"), str):
                raise ValueError(f"document {i} must be a text or an object with a 'text' field")
        return documents

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d["text"] for d in self.documents]
