"""The request body of Anthropic's Messages API (`POST /v1/messages`, and
`/v1/messages/count_tokens`), and its mapping onto a chat completion request: the Messages
API is served by the chat path (its template, reasoning parser, tools and sampling
fields), so this module only translates, and the errors it raises name the Messages field.

Fields the server does not model are refused by name unless they change nothing here
(`NEUTRAL`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gristmill.errors import RequestError
from gristmill.server.errors import validation_message, validation_param
from gristmill.server.protocol import ChatCompletionRequest, _no_booleans

MESSAGES_PATH, COUNT_TOKENS_PATH = "/v1/messages", "/v1/messages/count_tokens"

#: Fields accepted and ignored, with the values that change nothing (None: any value).
NEUTRAL = {"metadata": None, "service_tier": None, "cache_control": None, "inference_geo": None, "speed": None,
           "diagnostics": None, "user_profile_id": None, "workspace_id": None, "container": (None,),
           "mcp_servers": ([],)}
#: Chat field -> the Messages field it came from, for error messages.
CHAT_TO_MESSAGES = {"max_tokens": "max_tokens", "response_format": "output_config.format", "stop": "stop_sequences", "max_reasoning_tokens": "thinking",
                    "messages": "messages", "tool_choice": "tool_choice", "tools": "tools",
                    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    #: A system prompt: text, or a list of text blocks.
    system: str | list[Any] | None = None
    #: Required on /v1/messages (not on count_tokens).
    max_tokens: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: dict | None = None
    #: {"type": "enabled", "budget_tokens": N} (the reasoning's bound), {"type": "disabled"},
    #: or {"type": "adaptive"} (the model's own way: as when left out).
    thinking: dict | None = None
    #: {"format": {"type": "json_schema", "schema": {...}}}: the answer follows the schema.
    output_config: dict | None = None
    stream: bool | None = False

    _numbers = field_validator("max_tokens", "temperature", "top_p", "top_k", mode="before")(_no_booleans)

    def refused_field(self) -> None:
        """A RequestError for the first field this server does not take that may change the output."""
        for name, value in (self.model_extra or {}).items():
            if value is None:
                continue
            if name not in NEUTRAL:
                raise RequestError(f"{name} is not a field this server takes on {MESSAGES_PATH} (and may change "
                                   f"the output); leave it out", param=name)
            if NEUTRAL[name] is not None and value not in NEUTRAL[name]:
                raise RequestError(f"{name} {json.dumps(value)[:80]} is not supported; leave {name} out", param=name)


def to_chat_request(body: MessagesRequest, reasoning_model: bool, template_tools: bool,
                    count_only: bool = False) -> ChatCompletionRequest:
    """The chat completion request that answers `body` (RequestError naming the Messages
    field when it cannot be one). `reasoning_model`: the engine has a reasoning parser
    (`thinking` bounds its reasoning, or turns it off); `template_tools`: the chat template
    writes tool calls and results (else they go into the turns as text, as the model wrote
    its calls: `tool_calls.JSON_CALLS`); `count_only`: for count_tokens, where max_tokens
    is not needed."""
    body.refused_field()
    if body.max_tokens is None and not count_only:
        raise RequestError("max_tokens is required: the most tokens to generate, e.g. 1024", param="max_tokens")
    messages = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages.{i}", template_tools)
    tools, choice, parallel = chat_tools(body.tools), None, None
    if body.tool_choice is not None:
        choice, parallel = chat_tool_choice(body.tool_choice)
    if count_only and tools:  # (the tools are in the prompt whatever the choice; none reads no calls)
        choice = "none"
    extra: dict = {}
    thinking = body.thinking or {}
    if thinking.get("type") == "enabled" and not reasoning_model:
        raise RequestError("thinking enabled bounds a reasoning model's thinking, and this model does not reason (its "
                           "chat template writes no <think>, and the server has no --reasoning-parser); leave "
                           "thinking out or send {\"type\": \"disabled\"}", param="thinking")
    if thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise RequestError("thinking.budget_tokens must be a whole number of tokens, e.g. 1024",
                               param="thinking.budget_tokens")
        extra["max_reasoning_tokens"] = budget
    elif thinking.get("type") == "disabled":
        if reasoning_model:  # (Qwen3's hybrid templates close the reasoning; others ignore it)
            extra["chat_template_kwargs"] = {"enable_thinking": False}
    elif body.thinking is not None and thinking.get("type") not in ("adaptive", "between_tools"):
        raise RequestError(f"thinking must be {{\"type\": \"enabled\", \"budget_tokens\": N}}, "
                           f"{{\"type\": \"disabled\"}} or {{\"type\": \"adaptive\"}}, got "
                           f"{json.dumps(body.thinking)[:80]}", param="thinking")
    extra["response_format"] = response_format(body.output_config)
    try:
        return ChatCompletionRequest(
            model=body.model, messages=messages, max_tokens=body.max_tokens or 1, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences, stream=bool(body.stream), tools=tools,
            tool_choice=choice, parallel_tool_calls=parallel, **extra)
    except ValidationError as exc:
        errors = exc.errors()
        raise RequestError(f"invalid request: {validation_message(errors)}",
                           param=validation_param(errors[0].get("loc", ()))) from None


def response_format(config: dict | None) -> dict | None:
    """The chat response_format of a Messages output_config ({"format": {"type": "json_schema",
    "schema": {...}}}); an `effort` is refused, as the model's reasoning is not steered."""
    if not config:
        return None
    if config.get("effort") is not None:
        raise RequestError("output_config.effort is not supported: the model reasons as its chat template has it; "
                           "leave it out, and bound the reasoning with thinking.budget_tokens",
                           param="output_config.effort")
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise RequestError(f"output_config.format must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}, "
                           f"got {json.dumps(form)[:80]}", param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}


def _chat_messages(message, where: str, template_tools: bool = True) -> list[dict]:
    """One Messages message as chat messages: a user's `tool_result` blocks become `tool`
    messages (before its text), an assistant's `tool_use` blocks its `tool_calls` and its
    `thinking` blocks its `reasoning_content`. Without `template_tools` the calls are the
    assistant's text in the JSON form and the results the user's text."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where} must be {{\"role\": \"user\" or \"assistant\", \"content\": ...}}, got "
                           f"{str(message)[:80]}", param=where)
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
    texts, calls, results, thinking = [], [], [], []
    allowed = ("text", "tool_result") if role == "user" else ("text", "tool_use", "thinking", "redacted_thinking")
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise RequestError(f"{at} is a {kind!r} block; a {role} message here takes {', '.join(allowed)} blocks "
                               "(images and documents are not supported)", param=at)
        if kind == "text":
            texts.append(_string(block.get("text"), f"{at}.text"))
        elif kind == "thinking":
            thinking.append(_string(block.get("thinking"), f"{at}.thinking"))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise RequestError(f"{at} must have an \"id\", a \"name\" and an \"input\" object", param=at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestError(f"{at} needs the \"tool_use_id\" of the call it answers", param=at)
            text = _text(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
    if not template_tools:
        texts = [*(f"Result of call {r['tool_call_id']}: {r['content']}" for r in results), *texts]
        results = []
        if calls:
            texts.append(json.dumps([{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                                     for c in calls]))
            calls = []
    if role == "user":
        return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts or not results else [])
    turn: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "\n\n".join(thinking)
    return [turn]


def _text(value, where: str) -> str:
    """Text given as a string or a list of text blocks."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "\n\n".join(_string(b.get("text"), f"{where}.text") for b in value)
    raise RequestError(f"{where} must be a string or a list of {{\"type\": \"text\", \"text\": ...}} blocks",
                       param=where)


def _string(value, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string", param=where)
    return value


def chat_tools(tools) -> list[dict] | None:
    """Messages tools ({"name", "description", "input_schema"}) as chat function tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                tool.get("type", "custom") != "custom" or not isinstance(tool.get("input_schema"), dict):
            raise RequestError(f"tools.{i} must be {{\"name\": ..., \"description\": ..., \"input_schema\": "
                               f"{{...}}}} (server tools are not supported), got {str(tool)[:80]}", param=f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict) -> tuple[str | dict, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of a Messages tool_choice."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise RequestError(f"tool_choice must be {{\"type\": \"auto\"}}, {{\"type\": \"any\"}}, {{\"type\": \"none\"}} "
                       f"or {{\"type\": \"tool\", \"name\": ...}}, got {json.dumps(choice)[:80]}", param="tool_choice")


def messages_error(exc: Exception) -> Exception:
    """A chat path's RequestError reworded to name the Messages field it came from."""
    if not isinstance(exc, RequestError) or getattr(exc, "param", None) not in CHAT_TO_MESSAGES:
        return exc
    param = CHAT_TO_MESSAGES[exc.param]
    message = exc.message
    if exc.param != param:
        message = message.replace(exc.param, param)
    return type(exc)(message, **{**exc.fields, "param": param})
