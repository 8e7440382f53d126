"""Request bodies of the OpenAI API, as pydantic models (responses are built as dicts).

Unknown fields are accepted and ignored, as OpenAI clients send some (e.g. `user`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=16)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    #: OpenAI: {"token id": bias in [-100, 100]}.
    logit_bias: dict[str, float] | None = None
    #: OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}.
    response_format: dict | None = None
    #: vLLM's extra-body field: exactly one of json, json_object, regex, choice, grammar.
    structured_outputs: dict | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)  # None: 16, as OpenAI
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
