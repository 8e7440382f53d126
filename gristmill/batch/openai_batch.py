"""OpenAI Batch API files, as `vllm run-batch` reads them: each line a request
(`custom_id`, `method`, `url`, `body`) made into a processor row, and each output row made
into the line OpenAI's batch output holds. Lines to /v1/chat/completions and
/v1/completions make a generating job; lines to /v1/embeddings an embedding job, whose
output lines hold /v1/embeddings responses. A /v1/embeddings line with several inputs is
a row per input (`embedding_inputs`), whose results make its one output line again
(`job_rows.whole_lines`). In a job with LoRA adapters (or one sending its rows to a
server) a line's `body.model` names the model it runs with, as a row's `model` column."""

from __future__ import annotations

import base64
import json
import time
import uuid

from gristmill.batch.io import InputError
from gristmill.batch.rows import REASONING_COLUMN, TOOL_CALLS_COLUMN
from gristmill.chat.tool_calls import new_call_id
from gristmill.errors import GristmillError, RequestError
from gristmill.openai_fields import BODY_TO_PARAM
from gristmill.structured.grammars import check_constraint
from gristmill.structured.spec import openai_constraint

#: Rides with the rows of a line of several inputs: (the input's index, how many).
PARTS_COLUMN = "__gristmill_batch_part__"
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
# Embeddings body fields copied into pooling_params (vLLM's extras beside OpenAI's dimensions).
_EMBEDDING_PARAMS = ("dimensions", "normalize", "truncate_prompt_tokens")
_EMBEDDING_IGNORED = {"model", "input", "user", "encoding_format"}
_BATCH_KEYS = ("custom_id", "method", "url", "body")
# Body fields copied into sampling_params, by their SamplingParams name.
_BODY_PARAMS = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", **BODY_TO_PARAM}
# Body fields read apart (`model`: see batch_request_row) or that change nothing here.
# (a chat line's messages and chat_template_kwargs are read apart; a completion has no template)
_BODY_IGNORED = {"model", "messages", "prompt", "chat_template_kwargs", "user", "stream", "stream_options", "metadata",
                 "store"}
# Body fields that become sampling_params.structured_output.
_BODY_CONSTRAINTS = ("response_format", "structured_outputs")
# A chat line's fields that its row carries as they are (row_tools.TOOL_FIELDS).
_CHAT_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def is_batch_file(first_row: dict | None) -> bool:
    return isinstance(first_row, dict) and all(key in first_row for key in _BATCH_KEYS)


def check_batch_line(line: dict, where: str) -> None:
    missing = [key for key in ("custom_id", "url", "body") if key not in line]
    if missing or not isinstance(line["body"], dict):
        raise InputError(f"{where}: an OpenAI batch line needs 'custom_id', 'url' and 'body' (an object)"
                         f"{'; missing ' + ', '.join(missing) if missing else ''}")


def batch_task(first_line: dict) -> str:
    """The task of a job on a batch file, by its first line: "embed" for /v1/embeddings."""
    return "embed" if BATCH_URLS.get(first_line.get("url")) == "embeddings" else "generate"


def embedding_inputs(line: dict) -> list | None:
    """The inputs of a /v1/embeddings line that has several (texts, or lists of token
    ids), each a request of its own; None for a line of one input, or of no valid list."""
    body = line.get("body")
    if BATCH_URLS.get(line.get("url")) != "embeddings" or not isinstance(body, dict):
        return None
    given = body.get("input")
    if (isinstance(given, list) and len(given) > 1 and not all(isinstance(t, int) for t in given)
            and all(isinstance(each, str) or (isinstance(each, list) and each and all(isinstance(t, int) for t in each))
                    for each in given)):
        return given
    return None


def batch_request_row(line: dict, task: str = "generate", part: int | None = None,
                      named_models: bool = False) -> dict:
    """A batch line as a processor row of a job running `task` (`part`: the row of the
    line's input `part`, for a line of several, `embedding_inputs`); raises RequestError for
    a request this line cannot make (it becomes a 400 line of the output). `named_models`
    (a job with LoRA adapters, or one sending its rows to a server): the body's `model`
    names the model the line runs with, a LoRA adapter or the base (else any name does)."""
    row = _batch_request_row(line, task, part)
    model = line["body"].get("model")
    if named_models and model:
        row["model"] = model
    return row


def _batch_request_row(line: dict, task: str, part: int | None) -> dict:
    url, body = line["url"], line["body"]
    if url not in BATCH_URLS:
        raise RequestError(f"url {url!r} is not supported; use one of {sorted(BATCH_URLS)}", param="url")
    if str(line.get("method", "POST")).upper() != "POST":
        raise RequestError(f"method {line['method']!r} is not supported; use POST", param="method")
    wanted = "embed" if BATCH_URLS[url] == "embeddings" else "generate"
    if wanted != task:
        raise RequestError(f"url {url} needs a job of task {wanted!r} and this job runs task {task!r} (from --task "
                           f"or the file's first line); put the lines of each task in a file of their own",
                           param="url")
    if wanted == "embed":
        return _embedding_row(line["custom_id"], body if part is None else {**body, "input": body["input"][part]})
    known = {*_BODY_PARAMS, *_BODY_IGNORED, *_BODY_CONSTRAINTS,
             *(_CHAT_TOOL_FIELDS if BATCH_URLS[url] == "chat" else ())}
    unsupported = sorted(k for k, v in body.items() if k not in known and v)
    if unsupported:
        raise RequestError(f"body fields {unsupported} are not supported by gristmill batch; leave them out",
                           param=unsupported[0])
    params = {_BODY_PARAMS[k]: v for k, v in body.items() if k in _BODY_PARAMS and k != "max_tokens"}
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is not None:
        params["max_tokens"] = body["max_tokens"]
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    structured, field = openai_constraint(body.get("response_format"), body.get("structured_outputs"))
    check_constraint(structured, field)  # its error names the body's field, as the server's does
    if structured is None and (body.get("response_format") or {}).get("type") == "text":
        structured = False  # plain text asked for: the line opts out of a --json-schema default
    params["structured_output"] = structured
    row = {"custom_id": line["custom_id"], "sampling_params": {k: v for k, v in params.items() if v is not None}}
    if BATCH_URLS[url] == "chat":
        row["messages"] = body.get("messages")
        row["chat_template_kwargs"] = body.get("chat_template_kwargs")
        row.update({name: body[name] for name in _CHAT_TOOL_FIELDS if body.get(name) is not None})
        return row
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt (text or token ids) in a list: still one request
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"body.prompt holds {len(prompt)} prompts; a batch line makes one completion, so "
                           f"give each prompt a line (and a custom_id) of its own", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        row["tokenized_prompt"] = prompt
    else:
        row["prompt"] = prompt
    return row


def _embedding_row(custom_id, body: dict) -> dict:
    unsupported = sorted(k for k, v in body.items()
                         if k not in _EMBEDDING_PARAMS and k not in _EMBEDDING_IGNORED and v is not None)
    if unsupported:
        raise RequestError(f"body fields {unsupported} are not supported by /v1/embeddings lines; leave them out",
                           param=unsupported[0])
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise RequestError(f"encoding_format must be 'float' or 'base64', got {body['encoding_format']!r}",
                           param="encoding_format")
    given = body.get("input")
    if isinstance(given, list) and len(given) == 1 and isinstance(given[0], (str, list)):
        given = given[0]  # one input (text or token ids) in a list: still one request
    row = {"custom_id": custom_id, "pooling_params": {k: body[k] for k in _EMBEDDING_PARAMS if body.get(k) is not None}}
    if isinstance(given, list) and given and all(isinstance(t, int) for t in given):
        return {**row, "tokenized_prompt": given}
    if not isinstance(given, str):
        raise RequestError("body.input must be a string, a list of token ids, or a list of either (a string, or a "
                           "non-empty list of token ids, each)", param="input")
    return {**row, "prompt": given}


def batch_output_line(line: dict, out: dict, model: str) -> dict:
    """The OpenAI batch output line for one request, from its processor output row."""
    error = out.get("__inference_error__")
    model = line["body"].get("model") or model
    if error:
        status, body = _error_body(error)
    elif BATCH_URLS[line["url"]] == "embeddings":
        body, status = _embedding_body(out, model, line["body"].get("encoding_format") or "float"), 200
    else:
        body = _completion_body(BATCH_URLS[line["url"]], out, model)
        status = 200
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"],
            "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def batch_line_error(record: dict) -> str:
    """The `"<ErrorType>: <message>"` of a batch output line, or "" if it succeeded."""
    response = record.get("response") or {}
    if response.get("status_code") == 200:
        return ""
    error = (response.get("body") or {}).get("error") or {}
    return f"{error.get('code')}: {error.get('message')}"


def _completion_body(kind: str, out: dict, model: str) -> dict:
    text, reason = out["generated_text"], out["finish_reason"]
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
               "logprobs": None} if kind == "chat"
              else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
    if kind == "chat" and REASONING_COLUMN in out:  # a reasoning model: as the server answers
        choice["message"].update(reasoning_content=out[REASONING_COLUMN], reasoning=out[REASONING_COLUMN])
    if kind == "chat" and out.get(TOOL_CALLS_COLUMN):  # as the server answers: content null when all is calls
        choice["message"].update(content=text or None, tool_calls=[
            {"id": new_call_id(), "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
            for call in out[TOOL_CALLS_COLUMN]])
    prompt_tokens, completion_tokens = out["num_input_tokens"], out["num_generated_tokens"]
    return {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if kind == "chat" else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _embedding_body(out: dict, model: str, encoding_format: str) -> dict:
    """The /v1/embeddings response of a line's inputs (`out["embeddings"]`: one vector, or
    a list of them for a line of several; "base64": OpenAI's, the float32 values'
    little-endian bytes)."""
    vectors = out["embeddings"] if out.get(PARTS_COLUMN) else [out["embeddings"]]
    if encoding_format == "base64":
        import numpy as np
        vectors = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii") for v in vectors]
    tokens = out["num_input_tokens"]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _error_body(error: str) -> tuple[int, dict]:
    """(status, OpenAI error envelope) of an error row: 400 for the RequestError family,
    500 for the rest. `code` names the error type, so the row's error reads back whole."""
    type_name, _, message = error.partition(": ")
    known = {cls.__name__: cls for cls in _subclasses(GristmillError)}
    cls = known.get(type_name)
    status = 400 if cls is not None and issubclass(cls, RequestError) else 500
    error_type = cls.error_type if cls is not None else "internal_error"
    return status, {"error": {"message": message or error, "type": error_type, "param": None, "code": type_name}}


def _subclasses(cls) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_subclasses(sub))
    return found
