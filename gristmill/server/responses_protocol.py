"""The request body of OpenAI's Responses API (`POST /v1/responses`), and its mapping
onto a chat completion request: the Responses API is served by the chat path (its
template, reasoning parser, tools and structured output), so this module only
translates. The server keeps no state, so nothing here refers to an earlier response.

Fields the server does not model are refused by name unless they change nothing here
(`NEUTRAL`), or are chat sampling fields that pass through as on chat (`PASS_THROUGH`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gristmill.errors import RequestError
from gristmill.openai_fields import SAMPLING_FIELDS
from gristmill.server.errors import validation_message, validation_param
from gristmill.server.protocol import ChatCompletionRequest, _no_booleans

RESPONSES_PATH = "/v1/responses"

#: Fields accepted and ignored, with the values that change nothing (None: any value).
NEUTRAL = {"metadata": None, "user": None, "safety_identifier": None, "prompt_cache_key": None,
           "prompt_cache_retention": None, "service_tier": None, "stream_options": None,
           "truncation": ("disabled",), "background": (False,), "include": ([],), "top_logprobs": (0,)}
#: Chat (and vLLM extra-body) fields a Responses body may carry too; they mean what they
#: mean on /v1/chat/completions.
PASS_THROUGH = (*(f.name for f in SAMPLING_FIELDS if f.name not in ("temperature", "top_p", "n",
                                                                      "prompt_logprobs")),
                "chat_template_kwargs")
#: Chat field -> the Responses field it came from, for error messages.
CHAT_TO_RESPONSES = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                     "messages": "input"}

_ROLES = ("user", "system", "developer", "assistant")
_ITEMS = "message, function_call, function_call_output or reasoning items"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    #: A user message's text, or a list of input items (`input_messages`).
    input: str | list[Any]
    #: A system message before the input.
    instructions: str | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    #: {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}.
    text: dict | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    #: {"effort", "summary"}: accepted only unset, as the model's reasoning is not steered.
    reasoning: dict | None = None
    #: None (left out) means false: the server keeps no responses (OpenAI's default is true).
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = False

    _numbers = field_validator("max_output_tokens", "temperature", "top_p", mode="before")(_no_booleans)

    def refused_field(self) -> None:
        """A RequestError for the first field that asks what a stateless server without
        them cannot do, or that would change the output and is not supported."""
        if self.store:
            raise RequestError("store: true asks the server to keep the response, and this server keeps none; "
                               "send store: false (or leave it out)", param="store")
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id refers to a stored response, and this server keeps none; "
                               "send the earlier turns (its output items and your function_call_output items) "
                               "in input instead", param="previous_response_id")
        for name in ("effort", "summary"):
            if (self.reasoning or {}).get(name) is not None:
                raise RequestError(f"reasoning.{name} is not supported: the model reasons as its chat template "
                                   f"has it (its reasoning comes back whole as a reasoning item); leave it out, and "
                                   f"bound the reasoning with max_reasoning_tokens", param=f"reasoning.{name}")
        for name, value in (self.model_extra or {}).items():
            if name in PASS_THROUGH or value is None:
                continue
            if name not in NEUTRAL:
                raise RequestError(f"{name} is not a field this server takes on {RESPONSES_PATH} (and may change "
                                   f"the output); leave it out", param=name)
            if NEUTRAL[name] is not None and value not in NEUTRAL[name]:
                raise RequestError(f"{name} {json.dumps(value)[:80]} is not supported; leave {name} out",
                                   param=name)


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that answers `body` (RequestError naming the
    Responses field when it cannot be one)."""
    body.refused_field()
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else [])
    messages += input_messages(body.input)
    if not messages:
        raise RequestError("input is empty; send a string or a list of input items", param="input")
    extra = {name: value for name, value in (body.model_extra or {}).items() if name in PASS_THROUGH}
    try:
        return ChatCompletionRequest(
            model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, stream=bool(body.stream),
            tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls, response_format=response_format(body.text), **extra)
    except ValidationError as exc:  # (a pass-through field's value)
        errors = exc.errors()
        raise RequestError(f"invalid request: {validation_message(errors)}",
                           param=validation_param(errors[0].get("loc", ()))) from None


def input_messages(items: str | list) -> list[dict]:
    """Input items as chat messages: function_call items become an assistant message's
    `tool_calls`, function_call_output items `tool` messages, a reasoning item the next
    assistant message's `reasoning_content`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    call_ids: set[str] = set()
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object ({_ITEMS}), got {json.dumps(item)[:80]}", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where)
            if reasoning is not None and message["role"] == "assistant":
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, where)
            call_ids.add(call["id"])
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or (last["content"] and not last.get("tool_calls")):
                last = {"role": "assistant", "content": None, "tool_calls": []}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, call_ids))
        elif kind == "reasoning":
            reasoning = "".join(_texts(item.get("content") or [], f"{where}.content", ("reasoning_text",)))
        else:
            raise RequestError(f"{where} has type {json.dumps(kind)[:60]}; this server takes {_ITEMS} (it keeps no "
                               f"stored items and reads text only)", param=f"{where}.type")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}, got {json.dumps(role)[:60]}",
                           param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of input_text parts",
                           param=f"{where}.content")
    return {"role": role, "content": "".join(_texts(content, f"{where}.content",
                                                     ("input_text", "output_text", "text")))}


def _texts(parts: list, where: str, kinds: tuple[str, ...]) -> list[str]:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            got = part.get("type") if isinstance(part, dict) else part
            raise RequestError(f"{where}[{j}] must be a {{\"type\": \"{kinds[0]}\", \"text\": ...}} part (this server "
                               f"reads text only), got {json.dumps(got)[:60]}", param=f"{where}[{j}]")
        texts.append(part["text"])
    return texts


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise RequestError(f"{where}.{key} must be a string (a function_call item has call_id, name and "
                               f"arguments, a JSON text)", param=f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(item: dict, where: str, call_ids: set[str]) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if call_id not in call_ids:
        raise RequestError(f"{where}.call_id {json.dumps(call_id)[:60]} is no earlier function_call item's; send "
                           f"the function_call item before its output", param=f"{where}.call_id")
    if isinstance(output, list):
        output = "".join(_texts(output, f"{where}.output", ("input_text", "output_text")))
    if not isinstance(output, str):
        raise RequestError(f"{where}.output must be a string (the function's result)", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def chat_tools(tools) -> list[dict] | None:
    """Responses' flat function tools as chat's {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {\"type\": \"function\", \"name\": ..., \"parameters\": {...}}",
                           param="tools")
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}] has type {json.dumps(kind)[:60]}; this server runs function tools "
                               f"only: send {{\"type\": \"function\", \"name\": ..., \"parameters\": {{...}}}}",
                               param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"tools[{i}].name must be the function's name", param=f"tools[{i}].name")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice):
    """{"type": "function", "name": ...} as chat's named choice; the strings as they are."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        if not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice as an object must be {\"type\": \"function\", \"name\": ...}",
                               param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        raise RequestError(f"tool_choice {json.dumps(choice)[:80]} is not supported; send \"none\", \"auto\", "
                           f"\"required\" or {{\"type\": \"function\", \"name\": ...}}", param="tool_choice")
    return choice


def response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format."""
    form = (text or {}).get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise RequestError("text.format.schema must be a JSON schema object", param="text.format.schema")
        spec = {key: form[key] for key in ("name", "schema", "strict", "description") if key in form}
        return {"type": "json_schema", "json_schema": {"name": "response", **spec}}
    raise RequestError(f"text.format must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                       f"{{\"type\": \"json_schema\", \"name\": ..., \"schema\": {{...}}}}, got "
                       f"{json.dumps(form)[:80]}", param="text.format")


def responses_error(exc: Exception) -> Exception:
    """A chat path's RequestError reworded to name the Responses field it came from."""
    if not isinstance(exc, RequestError) or getattr(exc, "param", None) not in CHAT_TO_RESPONSES:
        return exc
    message = exc.message
    for chat_name, name in CHAT_TO_RESPONSES.items():
        message = message.replace(chat_name, name)
    return type(exc)(message, **{**exc.fields, "param": CHAT_TO_RESPONSES[exc.param]})
