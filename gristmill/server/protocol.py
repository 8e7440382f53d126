"""Request bodies of the OpenAI API, as pydantic models (responses are built as dicts).

Unknown fields are accepted and ignored, as OpenAI clients send some (e.g. `user`), except
those that would change the output here (`UNSUPPORTED`): a request with one set gets a
400 naming it, never an answer that quietly ignored it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator, model_validator

COMPLETIONS_PATH, CHAT_PATH = "/v1/completions", "/v1/chat/completions"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (an option it does not know would be ignored)

    include_usage: bool = False
    #: vLLM's: every chunk carries the usage so far (include_usage: the last one too).
    continuous_usage_stats: bool = False


def _no_booleans(value):
    """A JSON true / false where a number (or a list of them) goes is a client's mistake,
    not 1 / 0 (pydantic's lax mode would take it so)."""
    if isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value)):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


#: Fields whose explicit null means their default (OpenAI documents them "or null", and
#: some clients send every field).
_NULL_MEANS_DEFAULT = ("n", "stream", "ignore_eos", "skip_special_tokens", "echo", "logprobs",
                       "add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_ids")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_MEANS_DEFAULT
                                                          and k in cls.model_fields)}
        return data

    _sampling_numbers = field_validator("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "n",
                               "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                               "prompt_logprobs", "max_reasoning_tokens", mode="before")(_no_booleans)

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1)  # at most the engine's max_num_seqs (limits.py)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    #: OpenAI: {"token id": bias in [-100, 100]}.
    logit_bias: dict[str, StrictInt | StrictFloat] | None = None  # (not "5" or true)
    #: OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}.
    response_format: dict | None = None
    #: vLLM's extra-body field: exactly one of json, json_object, regex, choice, grammar.
    structured_outputs: dict | None = None
    #: vLLM's extra-body fields (SamplingParams of the same names).
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100)
    min_tokens: int | None = Field(default=None, ge=0)
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    #: vLLM's extra-body field: the text ends with the stop string that ended it.
    include_stop_str_in_output: bool = False
    #: vLLM's extra-body field: each choice also carries its `token_ids` (and the prompt's
    #: `prompt_token_ids`: on each choice of a completion, on a chat response).
    return_token_ids: bool = False
    #: vLLM's extra-body field: each prompt token's logprob and the top-k at its place
    #: (`prompt_logprobs` on each choice of a completion, on a chat response).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    #: gristmill's extra-body field: a chat's reasoning takes at most this many tokens
    #: before `</think>` is forced (SamplingParams.max_reasoning_tokens; on a completion,
    #: or a model without a reasoning parser, a 400).
    max_reasoning_tokens: int | None = Field(default=None, ge=0)

    def unsupported_field(self) -> str | None:
        """The first field of the body, not modelled here, that would change the output."""
        extra = self.model_extra or {}
        return next((name for name, neutral in UNSUPPORTED.items()
                     if extra.get(name) is not None and extra[name] not in _neutral(neutral)), None)


def _neutral(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


#: Fields other OpenAI-compatible servers take that would change the output, with the
#: value (or a tuple of the values) that changes nothing: any other value is refused.
UNSUPPORTED = {"best_of": 1, "suffix": "", "tools": [], "functions": [], "use_beam_search": False,
               "length_penalty": 1.0, "allowed_token_ids": [], "logits_processors": [],
               "truncate_prompt_tokens": 0, "typical_p": 1.0,
               "prediction": {}, "audio": {}, "spaces_between_special_tokens": True,
               "guided_json": {}, "guided_regex": "", "guided_choice": [], "guided_grammar": "",
               "guided_whitespace_pattern": "", "prompt_embeds": ("", []),
               "return_tokens_as_token_ids": False, "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
               "reasoning_effort": (), "chat_template": "", "documents": [], "echo": False, "modalities": (["text"],),
               # the openai client's keyword, sent as a field (curl): its fields belong at the top level
               "extra_body": {},
               # chat's name for max_tokens: on /v1/completions, not taken (never ignored)
               "max_completion_tokens": ()}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    #: None: 16, as OpenAI; 0 (with echo): the prompt alone, scored with logprobs.
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    #: vLLM's extra-body field: the tokenizer's special tokens (BOS) open the prompt.
    add_special_tokens: bool = True

    _completion_numbers = field_validator("max_tokens", mode="before")(_no_booleans)

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_are_not_booleans(cls, value):
        if isinstance(value, list):
            for item in value:
                _no_booleans(item)
        return _no_booleans(value)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_off(cls, value):
        """`logprobs: false` (chat's way to say none) means none here too; true is not a count."""
        return None if value is False else _no_booleans(value)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    @model_validator(mode="after")
    def _no_function_call(self):
        """OpenAI's deprecated `function_call` turn would be part of the prompt; its
        successor `tool_calls` is taken (and rendered by the chat template)."""
        if (self.model_extra or {}).get("function_call"):
            raise ValueError("function_call in a message is not supported; send the call as tool_calls")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    #: vLLM's extra-body fields for the chat template: the assistant's turn is opened
    #: after the messages; the last (assistant) message is continued instead, unclosed;
    #: more variables for the template; the template's text gets the tokenizer's
    #: special tokens too (it usually has them already).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = False
    #: OpenAI's function tools, checked in gristmill.chat.tool_choice (each error names its field).
    tools: Any = None
    #: "none", "auto" (the default with tools), "required", or {"type": "function", "function": {"name": ...}}.
    tool_choice: Any = None
    #: false: a forced answer is exactly one call (true, the default: one or more).
    parallel_tool_calls: Any = None

    _chat_numbers = field_validator("max_tokens", "max_completion_tokens", "top_logprobs",
                                    mode="before")(_no_booleans)
