"""The OpenAI request fields that are sampling params, in one table: each body field's
name, the `SamplingParams` field it sets and the value a body that leaves it out means.
The server (completions, chat, Responses, Messages), OpenAI batch files and the engines
that send rows to an OpenAI-compatible server all map bodies through it, so a sampling
field is added here (and to `SamplingParams`, and to the server's body model) once.

The fields that are not plain copies are each face's own: `max_tokens` (chat's
`max_completion_tokens`, Responses' `max_output_tokens`), `logprobs` (a count on
completions, a switch with `top_logprobs` on chat), `response_format` and
`structured_outputs` (the constraint, `structured.spec.openai_constraint`), and on chat the
tool fields.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingField:
    """`name` in a request body sets SamplingParams' `param`; `default`: what leaving it
    out (or null) means; `openai`: a field of OpenAI's own API (sent to any server),
    else an extra field vLLM and gristmill take (sent only when it is not the default)."""

    name: str
    param: str
    default: object
    openai: bool = False


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", "temperature", 1.0, openai=True),
    SamplingField("top_p", "top_p", 1.0, openai=True),
    SamplingField("seed", "seed", None, openai=True),
    SamplingField("stop", "stop", (), openai=True),
    SamplingField("n", "n", 1, openai=True),
    SamplingField("logit_bias", "logit_bias", None, openai=True),
    SamplingField("presence_penalty", "presence_penalty", 0.0, openai=True),
    SamplingField("frequency_penalty", "frequency_penalty", 0.0, openai=True),
    SamplingField("top_k", "top_k", 0),
    SamplingField("min_p", "min_p", 0.0),
    SamplingField("stop_token_ids", "stop_token_ids", ()),
    SamplingField("ignore_eos", "ignore_eos", False),
    SamplingField("repetition_penalty", "repetition_penalty", 1.0),
    SamplingField("min_tokens", "min_tokens", 0),
    SamplingField("bad_words", "bad_words", ()),
    SamplingField("skip_special_tokens", "skip_special_tokens", True),
    SamplingField("include_stop_str_in_output", "include_stop_str_in_output", False),
    SamplingField("prompt_logprobs", "prompt_logprobs", None),
    SamplingField("max_reasoning_tokens", "max_reasoning_tokens", None),
)
#: Body field name -> SamplingParams field name.
BODY_TO_PARAM = {f.name: f.param for f in SAMPLING_FIELDS}


def sampling_kwargs(fields) -> dict:
    """SamplingParams keyword arguments of the table's fields in `fields` (a body as a dict,
    or a request model with them as attributes): a field left out or null is its default;
    `stop` given as one string is a list of it."""
    get = fields.get if isinstance(fields, dict) else (lambda name: getattr(fields, name, None))
    kwargs = {}
    for field in SAMPLING_FIELDS:
        value = get(field.name)
        if value is None:
            value = list(field.default) if isinstance(field.default, tuple) else field.default
        elif field.name == "stop" and isinstance(value, str):
            value = [value]
        elif field.name == "logit_bias":
            value = value or None  # (SamplingParams reads its keys as token ids)
        kwargs[field.param] = value
    return kwargs


def sampling_body(params) -> dict:
    """The body fields of SamplingParams `params`: OpenAI's own fields always (but `seed`,
    `stop` and `logit_bias` only when set, and `n` as 1: a row is one completion), the
    extra fields only when they are not the default (another server may not know them)."""
    body = {}
    for field in SAMPLING_FIELDS:
        value = getattr(params, field.param)
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        if field.name == "n":
            value = 1
        elif field.name == "logit_bias" and value:
            value = {str(token): bias for token, bias in value.items()}
        if isinstance(value, tuple):
            value = list(value)
        always = field.openai and field.default not in (None, ())
        if always or value != default:
            body[field.name] = value
    return body
