"""Rows as OpenAI requests and OpenAI responses as rows: shared by the engines that
reach a model through the OpenAI API shape (an HTTP server, a Ray Serve deployment)."""

from __future__ import annotations

import json

from gristmill.batch.rows import Generated, RowRequest
from gristmill.errors import GenerationError


def openai_request(request: RowRequest, model: str | None) -> tuple[str, dict]:
    """("chat" | "completions", the request body) for one row."""
    params = request.sampling_params
    if request.messages is not None:
        method, body = "chat", {"messages": request.messages}
    else:
        prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
        method, body = "completions", {"prompt": prompt}
    if model is not None:
        body["model"] = model
    body.update(_sampling_body(params))
    return method, body


def generated_of(data: dict, where: str) -> Generated:
    """A row's result from an OpenAI completions or chat response body."""
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        usage = data.get("usage") or {}
        token_ids = [int(t) for t in choice.get("token_ids") or []]  # where the server returns them
        return Generated(text or "", token_ids, int(usage.get("prompt_tokens", 0)),
                         int(usage.get("completion_tokens", 0)), choice.get("finish_reason") or "stop")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise GenerationError(f"the response of {where} is not an OpenAI completion ({exc!r}): "
                              f"{str(data)[:200]}") from exc


def _sampling_body(params) -> dict:
    """The request fields of SamplingParams; non-OpenAI ones only when set."""
    body = {"temperature": params.temperature, "top_p": params.top_p, "n": 1}
    if params.max_tokens is not None:  # else the server's default: OpenAI's chat runs to the context
        body["max_tokens"] = params.max_tokens
    body.update(_constraint_body(params.structured_output))
    if params.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    extras = {"top_k": (params.top_k, 0), "min_p": (params.min_p, 0.0),
              "stop_token_ids": (list(params.stop_token_ids), []), "ignore_eos": (params.ignore_eos, False),
              "presence_penalty": (params.presence_penalty, 0.0), "frequency_penalty": (params.frequency_penalty, 0.0),
              "repetition_penalty": (params.repetition_penalty, 1.0), "min_tokens": (params.min_tokens, 0),
              "bad_words": (list(params.bad_words), []), "skip_special_tokens": (params.skip_special_tokens, True)}
    body.update({name: value for name, (value, default) in extras.items() if value != default})
    return body


def _constraint_body(structured_output: dict | None) -> dict:
    """A constraint as OpenAI's `response_format` where it has one (JSON schema, JSON
    object), else as vLLM's (and gristmill's) `structured_outputs`: never dropped."""
    if structured_output is None:
        return {}
    (kind, spec), = structured_output.items()
    if kind == "json":
        schema = json.loads(spec) if isinstance(spec, str) else spec
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "row", "schema": schema}}}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {"structured_outputs": {kind: spec}}
