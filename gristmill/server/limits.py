"""Bounds on what one request may ask of the server, checked before anything is
tokenized or allocated; each broken bound is a 400 naming the field and the limit."""

from __future__ import annotations

from dataclasses import dataclass

from gristmill.engine.processor import check_text
from gristmill.errors import RequestError

MiB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    #: Bytes of one request body (also when it is sent without a Content-Length).
    max_request_bytes: int = 8 * MiB
    #: Levels of nesting of a request body's JSON.
    max_json_depth: int = 64
    #: Characters of one prompt (completions), or of all messages' text (chat).
    max_prompt_chars: int = 1_000_000
    #: Prompts in one completions request.
    max_prompts: int = 256
    #: Inputs of one embeddings or classify request, texts of one score or rerank request.
    max_inputs: int = 2048
    #: Messages in one chat request.
    max_messages: int = 1024
    #: Stop strings in one request, and characters of each.
    max_stop: int = 16
    max_stop_chars: int = 512
    #: Entries of logit_bias.
    max_logit_bias: int = 300
    #: Entries of stop_token_ids and of bad_words.
    max_token_list: int = 256
    #: Outputs of one stream waiting unread (a slow reader); past it the request is aborted.
    max_stream_buffer: int = 1024

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"ServerLimits.{name} must be a positive integer, got {value!r}", param=name)


def at_most(count: int, limit: int, field: str, what: str, flag: str | None = None) -> None:
    """RequestError unless count <= limit."""
    if count > limit:
        how = f" (the server's --{flag})" if flag else ""
        raise RequestError(f"{field} has {count} {what}; at most {limit} are allowed{how}", param=field)


def check_common(body, limits: ServerLimits, max_num_seqs: int, max_model_len: int) -> None:
    """The bounds both endpoints share."""
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    if body.n > max_num_seqs:
        raise RequestError(f"n is {body.n}; at most {max_num_seqs} (the engine's max_num_seqs) completions "
                           f"of one prompt can run together", param="n")
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, field, None)
        if value is not None and value > max_model_len:
            raise RequestError(f"{field} is {value}; at most {max_model_len} (the model's max_model_len) "
                               f"tokens fit in a context", param=field)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    at_most(len(stop), limits.max_stop, "stop", "strings")
    for text in stop:
        at_most(len(text), limits.max_stop_chars, "stop", "characters in one string")
    at_most(len(body.logit_bias or {}), limits.max_logit_bias, "logit_bias", "entries")
    at_most(len(body.stop_token_ids or []), limits.max_token_list, "stop_token_ids", "entries")
    at_most(len(body.bad_words or []), limits.max_token_list, "bad_words", "entries")


def check_completion(body, limits: ServerLimits) -> None:
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    at_most(len(prompts), limits.max_prompts, "prompt", "prompts")
    for prompt in prompts:
        if isinstance(prompt, str):
            at_most(len(prompt), limits.max_prompt_chars, "prompt", "characters", "max-prompt-chars")


def check_chat(body, limits: ServerLimits) -> None:
    at_most(len(body.messages), limits.max_messages, "messages", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    chars = 0
    for message in body.messages:
        content = message.content
        texts = [content] if isinstance(content, str) else [
            part["text"] for part in content or [] if isinstance(part, dict) and isinstance(part.get("text"), str)]
        for text in texts:
            check_text(text, "messages")
            chars += len(text)
    at_most(chars, limits.max_prompt_chars, "messages", "characters of text", "max-prompt-chars")
