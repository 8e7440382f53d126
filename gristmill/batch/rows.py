"""The batch row contract: what a row brings, what it gets back, what an error row holds.

A row of a generating processor (task "generate") brings `prompt` (text), `messages` (a
chat) or `tokenized_prompt` (token ids), and optionally `sampling_params` (a dict of
SamplingParams fields). A row of a pooling processor brings `prompt` or `tokenized_prompt`
(task "embed", "classify") or the pair `text_1`, `text_2` (task "score"), and optionally
`pooling_params` (a dict of PoolingParams fields). Any row may name the LoRA adapter it
runs with in `lora` or `model` (adapters.py). Each gets back its task's
`output_columns`: Ray Data LLM's names. An error row gets empty values of the same types
(so a Parquet file never has an all-null column) and
`__inference_error__ = "<ErrorType>: <message>"`; a row that succeeded has
`__inference_error__ = ""`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from gristmill.errors import RequestError, error_string
from gristmill.pooling_params import PoolingParams
from gristmill.pooling_tasks import POOLING_TASKS
from gristmill.sampling import SamplingParams
from gristmill.structured.spec import given_kinds

if TYPE_CHECKING:
    from gristmill.chat.tool_choice import ToolRequest

ERROR_COLUMN = "__inference_error__"
#: Set by a chat-template stage that ran before the engine stage (on Ray: a task):
#: `prompt` holds the rendered chat, tokenized without special tokens ...
TEMPLATED_COLUMN = "__gristmill_templated__"
#: ... or the rendering failed, and this holds "<ErrorType>: <message>".
TEMPLATE_ERROR_COLUMN = "__gristmill_template_error__"
OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens",
                  "finish_reason", "time_taken_llm", ERROR_COLUMN)
#: A generating row that asks for `sampling_params.prompt_logprobs` also gets this column:
#: each prompt token's logprob after the ones before it, the first null (scoring text by
#: its likelihood); `gristmill batch --prompt-logprobs` gives it to every row.
PROMPT_LOGPROBS_COLUMN = "prompt_logprobs"
#: A chat row on a reasoning model also gets this column: its reasoning (None when it had
#: none), while `generated_text` holds only the answer.
REASONING_COLUMN = "reasoning"
#: A chat row with `tools` also gets this column: its answer's calls, a list of
#: {"name": ..., "arguments": {...}} (empty when it made none), while `generated_text`
#: holds the text around them.
TOOL_CALLS_COLUMN = "tool_calls"
#: The column a pooling task's result goes in: `embeddings` and `probs` a list of float32,
#: `score` a float.
POOLED_COLUMNS = {name: task.column for name, task in POOLING_TASKS.items()}
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.init)
_POOLING_FIELDS = tuple(f.name for f in fields(PoolingParams))


def output_columns(task: str) -> tuple[str, ...]:
    """The columns a row of a processor running `task` gets back."""
    if task == "generate":
        return OUTPUT_COLUMNS
    return (POOLED_COLUMNS[task], "num_input_tokens", "time_taken_llm", ERROR_COLUMN)


@dataclass
class RowRequest:
    """One row, ready for an engine."""

    #: The row's id (its input position unless the processor names an id column).
    row_id: object
    #: Text to complete: the row's prompt, or its messages after the chat template.
    prompt: str | None
    #: The chat, for an engine that applies the template itself (an HTTP chat endpoint).
    messages: list[dict] | None
    #: Token ids to complete; when set, the engine does not tokenize.
    prompt_token_ids: list[int] | None
    #: None for a pooling row.
    sampling_params: SamplingParams | None
    #: Add the tokenizer's special tokens (BOS) when tokenizing: not after a chat template.
    add_special_tokens: bool = True
    #: "generate", or the pooling task the row is for ("embed", "classify", "score").
    task: str = "generate"
    #: A pooling row's params (None for a generating row).
    pooling_params: PoolingParams | None = None
    #: A score row's second text (its first is `prompt`).
    text_pair: str | None = None
    #: More variables for the chat template (the processor's, merged with the row's own).
    chat_template_kwargs: dict | None = None
    #: `prompt` is a rendered chat: on a reasoning model its output's reasoning is split off.
    chat: bool = False
    #: A chat row's `tools`, `tool_choice` and `parallel_tool_calls` as it gives them, for
    #: an engine that reads them itself (a server); None once resolved (`tools`), or none.
    tool_fields: dict | None = None
    #: The row's tools, checked against the engine's tool-call parser (row_tools.with_tools).
    tools: ToolRequest | None = None
    #: The model the row names in its `lora` or `model` column (a LoRA adapter, or the base
    #: model: adapters.py); None: the processor's.
    model: str | None = None


@dataclass
class Generated:
    """What an engine made of one row."""

    text: str
    token_ids: list[int]
    num_input_tokens: int
    num_generated_tokens: int
    finish_reason: str
    #: With `sampling_params.prompt_logprobs`: each prompt token's logprob after the ones
    #: before it (None for the first); else None.
    prompt_logprobs: list[float | None] | None = None
    #: A chat on a reasoning model: its reasoning (None when it had none), `text` being
    #: only the answer; `reasoned` says the split was made (the row gets the column).
    reasoning: str | None = None
    reasoned: bool = False
    #: A row with tools: its answer's calls ({"name", "arguments"}; empty when none), `text`
    #: being the text around them; None: the row has no tools (and no column).
    tool_calls: list[dict] | None = None


@dataclass
class Pooled:
    """What a pooling engine made of one row."""

    #: The embedding or the label probabilities (a list of floats), or the score (a float).
    value: list[float] | float
    num_input_tokens: int


def chat_template_kwargs_of(row: dict, defaults: dict | None) -> dict | None:
    """The variables a row's chat template gets: the processor's, with the row's own
    `chat_template_kwargs` merged over them (a row's value wins, key by key; a null is a
    missing value, as Arrow gives rows each other's keys)."""
    given = row.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        raise RequestError(f"chat_template_kwargs must be a dict of chat template variables, got "
                           f"{type(given).__name__}", param="chat_template_kwargs")
    merged = {**(defaults or {}), **{k: v for k, v in (given or {}).items() if v is not None}}
    return merged or None


def pooling_params_of(row: dict, defaults: dict) -> PoolingParams:
    """The row's PoolingParams: the processor's defaults, overridden by the row's own."""
    given = row.get("pooling_params")
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise RequestError(f"pooling_params must be a dict of PoolingParams fields ({', '.join(_POOLING_FIELDS)}), "
                           f"got {type(given).__name__}", param="pooling_params")
    # A null is a missing value (Parquet and CSV rows have every column): the default stays.
    merged = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    unknown = sorted(set(merged) - set(_POOLING_FIELDS))
    if unknown:
        raise RequestError(f"unknown pooling_params {unknown}; valid: {list(_POOLING_FIELDS)}",
                           param="pooling_params")
    return PoolingParams(**merged)


def has_values(params) -> bool:
    """Whether a row's `sampling_params` / `pooling_params` cell asks for anything: not None,
    nor a struct of nulls (the shape Arrow gives a row that has none beside rows that do)."""
    if isinstance(params, dict):
        return any(value is not None for value in params.values())
    return params is not None


def sampling_params_of(row: dict, defaults: dict) -> SamplingParams:
    """The row's SamplingParams: the processor's defaults, overridden by the row's own
    (`"structured_output": false` drops a default constraint for the row)."""
    given = row.get("sampling_params")
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise RequestError(f"sampling_params must be a dict of SamplingParams fields, got "
                           f"{type(given).__name__}", param="sampling_params")
    # A null is a missing value (Parquet and CSV rows have every column): the default stays.
    merged = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    if given.get("structured_output") is False:  # this row opts out of a default constraint
        merged["structured_output"] = None
    elif (own := _own_schema(given.get("structured_output"))) is not None:
        merged["structured_output"] = own
    else:  # a struct of nulls (Arrow) gives no constraint: the default stays
        merged["structured_output"] = defaults.get("structured_output")
    bias = merged.get("logit_bias")
    if isinstance(bias, dict):  # rows read as one Arrow struct carry each other's keys, as nulls
        merged["logit_bias"] = {token: value for token, value in bias.items() if value is not None} or None
    unknown = sorted(set(merged) - _SAMPLING_FIELDS)
    if unknown:
        raise RequestError(f"unknown sampling_params {unknown}; valid: {sorted(_SAMPLING_FIELDS - {'logprobs'})}",
                           param="sampling_params")
    # Fields whose output a row has no column for: refused, never computed and dropped.
    if merged.get("n", 1) != 1:
        raise RequestError(f"a batch row makes one completion; sampling_params.n must be 1, got {merged['n']}"
                           f" (repeat the row for more)", param="n")
    if merged.get("logprobs") is not None:
        raise RequestError("sampling_params.logprobs: a batch row has no logprobs column; leave it out (the "
                           "server and LLM.generate return logprobs)", param="logprobs")
    try:
        return SamplingParams(**merged)
    except TypeError as exc:
        raise RequestError(f"invalid sampling_params: {exc}", param="sampling_params") from exc


def _own_schema(structured_output):
    """A row's constraint as it was before Arrow merged the struct types of its rows
    (Parquet, a pyarrow Table, Ray Data): a JSON schema given as an object gets every key
    the other rows' schemas use, as nulls (`"properties": null` in a string schema), so
    null values of a schema's objects are dropped (`"const": null` too: write
    `{"type": "null"}`, or give the schema as JSON text, which Arrow leaves alone)."""
    kinds = given_kinds(structured_output)
    if not isinstance(kinds, dict) or not isinstance(kinds.get("json"), dict):
        return kinds
    return {**kinds, "json": without_nulls(kinds["json"])}


def without_nulls(value):
    """`value` without the nulls of its objects (keys Arrow gives a struct from other rows')."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def result_columns(generated: Generated, time_taken: float, detokenize: bool = True) -> dict:
    # An engine that gives no token ids (OpenAI's API) gives the text, detokenize or not.
    return {"generated_text": generated.text if detokenize or not generated.token_ids else "",
            "generated_tokens": list(generated.token_ids),
            "num_input_tokens": generated.num_input_tokens,
            "num_generated_tokens": generated.num_generated_tokens,
            "finish_reason": generated.finish_reason,
            "time_taken_llm": time_taken,
            ERROR_COLUMN: "",
            **({REASONING_COLUMN: generated.reasoning} if generated.reasoned else {}),
            **({TOOL_CALLS_COLUMN: generated.tool_calls} if generated.tool_calls is not None else {}),
            **({PROMPT_LOGPROBS_COLUMN: generated.prompt_logprobs} if generated.prompt_logprobs is not None else {})}


def pooled_columns(task: str, pooled: Pooled, time_taken: float) -> dict:
    value = pooled.value if task == "score" else list(pooled.value)
    return {POOLED_COLUMNS[task]: value, "num_input_tokens": pooled.num_input_tokens, "time_taken_llm": time_taken,
            ERROR_COLUMN: ""}


def error_columns(exc: BaseException | str, task: str = "generate") -> dict:
    """The output columns of a failed row of a processor running `task` (`exc`, or its
    "<ErrorType>: <message>"): empty values of each column's type."""
    error = exc if isinstance(exc, str) else error_string(exc)
    if task != "generate":
        return {POOLED_COLUMNS[task]: 0.0 if task == "score" else [], "num_input_tokens": 0, "time_taken_llm": 0.0,
                ERROR_COLUMN: error}
    return {"generated_text": "", "generated_tokens": [], "num_input_tokens": 0, "num_generated_tokens": 0,
            "finish_reason": "error", "time_taken_llm": 0.0, ERROR_COLUMN: error}


def is_error_row(row: dict) -> bool:
    return bool(row.get(ERROR_COLUMN))
