"""Rows as OpenAI requests and OpenAI responses as rows: shared by the engines that
reach a model through the OpenAI API shape (an HTTP server, a Ray Serve deployment)."""

from __future__ import annotations

import json

from gristmill.batch.rows import Generated, Pooled, RowRequest
from gristmill.errors import GenerationError, RequestError
from gristmill.openai_fields import sampling_body
from gristmill.pooling_tasks import POOLING_TASKS


def openai_request(request: RowRequest, model: str | None) -> tuple[str, dict]:
    """("chat" | "completions", the request body) for one row: its `model` the one the row
    names (a LoRA adapter: the server maps the name), else `model`."""
    params = request.sampling_params
    if request.messages is not None:
        method, body = "chat", {"messages": request.messages}
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = request.chat_template_kwargs
        body.update(request.tool_fields or {})  # (the server checks them and reads the calls)
    else:
        prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
        method, body = "completions", {"prompt": prompt}
    model = request.model or model
    if model is not None:
        body["model"] = model
    body.update(_sampling_body(params))
    return method, body


#: Where a pooling row goes on an OpenAI-compatible server (vLLM's and gristmill's), under its /v1.
POOLING_PATHS = {name: task.route.removeprefix("/v1") for name, task in POOLING_TASKS.items()}


def pooling_request(request: RowRequest, model: str | None) -> tuple[str, dict]:
    """(path, request body) of one pooling row: its PoolingParams as the endpoint's fields,
    those left at their defaults left out (OpenAI's /embeddings knows only `dimensions`)."""
    params = request.pooling_params
    prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
    if request.task == "score":
        body = {"text_1": prompt, "text_2": request.text_pair}
    else:
        body = {"input": prompt}
    fields = POOLING_TASKS[request.task].fields
    for name in ("dimensions", "normalize", "use_activation", "truncate_prompt_tokens"):
        value = getattr(params, name)
        if value is not None and name not in fields:
            raise RequestError(f"pooling_params.{name} does not apply to task {request.task!r}; leave it out",
                               param=name)
        if value is not None:
            body[name] = value
    model = request.model or model
    if model is not None:
        body["model"] = model
    return POOLING_PATHS[request.task], body


def pooled_of(task: str, data: dict, where: str) -> Pooled:
    """A pooling row's result from the response of its endpoint."""
    try:
        item = data["data"][0]
        value = {"embed": lambda: [float(v) for v in item["embedding"]],
                 "classify": lambda: [float(p) for p in item["probs"]],
                 "score": lambda: float(item["score"])}[task]()
        return Pooled(value, int((data.get("usage") or {}).get("prompt_tokens", 0)))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise GenerationError(f"the response of {where} is not a {task} response ({exc!r}): "
                              f"{str(data)[:200]}") from exc


def generated_of(data: dict, where: str, tools: bool = False) -> Generated:
    """A row's result from an OpenAI completions or chat response body; `tools`: the row
    sent tools, and gets its message's `tool_calls` (an empty list when none)."""
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        usage = data.get("usage") or {}
        token_ids = [int(t) for t in choice.get("token_ids") or []]  # where the server returns them
        message = choice.get("message") or {}
        # (a reasoning model's server: vLLM's and gristmill's reasoning_content, or the newer reasoning)
        reasoned = "reasoning_content" in message or "reasoning" in message
        return Generated(text or "", token_ids, int(usage.get("prompt_tokens", 0)),
                         int(usage.get("completion_tokens", 0)), choice.get("finish_reason") or "stop",
                         reasoning=message.get("reasoning_content", message.get("reasoning")), reasoned=reasoned,
                         tool_calls=[_call_of(call) for call in message.get("tool_calls") or ()] if tools else None)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise GenerationError(f"the response of {where} is not an OpenAI completion ({exc!r}): "
                              f"{str(data)[:200]}") from exc


def _call_of(call: dict) -> dict:
    """An OpenAI `tool_calls` entry as a row's call: its arguments parsed (text a server
    sent that is not JSON stays text)."""
    function = call["function"]
    arguments = function.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return {"name": function["name"], "arguments": arguments}


def _sampling_body(params) -> dict:
    """The request fields of SamplingParams (`openai_fields`), with the constraint and
    max_tokens (left out when None: the server's default, as OpenAI's chat runs to the context)."""
    body = sampling_body(params)
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    body.update(_constraint_body(params.structured_output))
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
