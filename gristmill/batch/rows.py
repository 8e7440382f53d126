"""The batch row contract: what a row brings, what it gets back, what an error row holds.

A row brings `prompt` (text), `messages` (a chat) or `tokenized_prompt` (token ids), and
optionally `sampling_params` (a dict of SamplingParams fields). It gets back the
`OUTPUT_COLUMNS`. An error row gets empty values of the same types (so a Parquet file
never has an all-null column) and `__inference_error__ = "<ErrorType>: <message>"`;
a row that succeeded has `__inference_error__ = ""`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gristmill.errors import RequestError, error_string
from gristmill.sampling import SamplingParams
from gristmill.structured.spec import given_kinds

ERROR_COLUMN = "__inference_error__"
#: Set by a chat-template stage that ran before the engine stage (on Ray: a task):
#: `prompt` holds the rendered chat, tokenized without special tokens ...
TEMPLATED_COLUMN = "__gristmill_templated__"
#: ... or the rendering failed, and this holds "<ErrorType>: <message>".
TEMPLATE_ERROR_COLUMN = "__gristmill_template_error__"
OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens",
                  "finish_reason", "time_taken_llm", ERROR_COLUMN)
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.init)


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
    sampling_params: SamplingParams
    #: Add the tokenizer's special tokens (BOS) when tokenizing: not after a chat template.
    add_special_tokens: bool = True


@dataclass
class Generated:
    """What an engine made of one row."""

    text: str
    token_ids: list[int]
    num_input_tokens: int
    num_generated_tokens: int
    finish_reason: str


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
    return {**kinds, "json": _without_nulls(kinds["json"])}


def _without_nulls(value):
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def result_columns(generated: Generated, time_taken: float, detokenize: bool = True) -> dict:
    # An engine that gives no token ids (OpenAI's API) gives the text, detokenize or not.
    return {"generated_text": generated.text if detokenize or not generated.token_ids else "",
            "generated_tokens": list(generated.token_ids),
            "num_input_tokens": generated.num_input_tokens,
            "num_generated_tokens": generated.num_generated_tokens,
            "finish_reason": generated.finish_reason,
            "time_taken_llm": time_taken,
            ERROR_COLUMN: ""}


def error_columns(exc: BaseException | str) -> dict:
    """The output columns of a failed row (`exc`, or its "<ErrorType>: <message>")."""
    return {"generated_text": "", "generated_tokens": [], "num_input_tokens": 0, "num_generated_tokens": 0,
            "finish_reason": "error", "time_taken_llm": 0.0,
            ERROR_COLUMN: exc if isinstance(exc, str) else error_string(exc)}


def is_error_row(row: dict) -> bool:
    return bool(row.get(ERROR_COLUMN))
