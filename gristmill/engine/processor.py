"""Turns user prompts into validated engine requests, before anything is scheduled.

The client checks everything here so that errors reach the caller before any output;
the core checks each `AddRequest` it receives again (`check_add_request`), so a
malformed message fails only its request, never the core.
"""

from __future__ import annotations

import numbers

from gristmill import faults
from gristmill.engine.kv_blocks import blocks_needed
from gristmill.engine.messages import AddRequest, Capacity
from gristmill.errors import GenerationError, PromptTooLongError, RequestError
from gristmill.sampling import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], capacity: Capacity):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt. Invalid input raises RequestError; a tokenizer failure
        raises GenerationError."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; send at least one token of text", param="prompt")
            check_text(prompt, "prompt")
            try:
                faults.check("tokenize", prompt=prompt)
                return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except Exception as exc:  # noqa: BLE001 - a tokenizer failure ends only this request
                raise GenerationError(f"tokenizing the prompt failed: {exc}") from exc
        if isinstance(prompt, (list, tuple)) and not all(type(t) is int for t in prompt) and all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            prompt = [int(t) for t in prompt]  # numpy's integers too
        check_token_ids(prompt, self.capacity.vocab_size)
        return list(prompt)

    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prompt: str | None = None, send_at_end: bool = False,
                      token_times: bool = False) -> list[AddRequest]:
        """One AddRequest per completion (`params.n`); raises RequestError when invalid.
        `params.max_tokens=None` becomes the room left after this prompt. `send_at_end`:
        the caller reads nothing of the request before its end, so the core sends its
        tokens once, then (`AddRequest.send_at_end`), unless the client needs them as they
        come: to look for stop strings, or for their logprobs. `token_times`: with them,
        the core sends when each token became known (`AddRequest.token_times`)."""
        params.ensure_valid()
        if params.max_tokens is None:
            room = max(1, self.max_new_tokens(len(prompt_token_ids)))
            if params.min_tokens > room:
                raise RequestError(f"min_tokens ({params.min_tokens}) is more than the {room} tokens the context "
                                   f"leaves after this {len(prompt_token_ids)}-token prompt; lower min_tokens",
                                   param="min_tokens")
            params = params.derived(max_tokens=room)
        check_fits(len(prompt_token_ids), params.max_tokens, self.capacity)
        outside = sorted(t for t in params.logit_bias or {} if t >= self.capacity.vocab_size)
        if outside:
            raise RequestError(f"logit_bias has token ids {outside[:5]} outside the vocabulary "
                               f"[0, {self.capacity.vocab_size})", param="logit_bias")
        fault_tag = prompt if faults.ACTIVE else None
        bad_words = self.bad_words_ids(params.bad_words)
        send_at_end = send_at_end and not params.stop and params.logprobs is None
        token_times = send_at_end and token_times
        if params.n == 1:
            return [AddRequest(request_id, prompt_token_ids, params, self.eos_token_ids, fault_tag, bad_words,
                               send_at_end, token_times)]
        return [AddRequest(child_request_id(request_id, i), prompt_token_ids,
                           params.derived(n=1, seed=_child_seed(params.seed, i)), self.eos_token_ids, fault_tag,
                           bad_words, send_at_end, token_times)
                for i in range(params.n)]

    def bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the token ids it has alone and after a space (as it reads at
        the start of a text and inside one), without duplicates."""
        forms: dict[tuple[int, ...], None] = {}
        for word in words:
            check_text(word, "bad_words")
            for text in (word.strip(), " " + word.strip()):
                try:
                    ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                except Exception as exc:  # noqa: BLE001 - a tokenizer failure ends only this request
                    raise GenerationError(f"tokenizing bad_words failed: {exc}") from exc
                if ids:
                    forms[ids] = None
        return tuple(forms)

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """Most tokens a request with a prompt this long can generate."""
        return max(0, self.capacity.max_tokens_per_request - num_prompt_tokens)

    def num_prompt_tokens(self, prompt: str | list[int] | int) -> int:
        """Tokens in a prompt given as text, token ids or a count."""
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            if prompt < 0:
                raise RequestError(f"a prompt's number of tokens must be >= 0, got {prompt}", param="prompt")
            return prompt
        return len(self.tokenize(prompt))


def check_text(text: str, param: str) -> None:
    """RequestError unless `text` can be encoded as UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{param} is not valid Unicode: {exc.object[exc.start:exc.end]!r} at character "
                           f"{exc.start} is a lone surrogate, which has no UTF-8 form; send UTF-8 text",
                           param=param) from None


def check_token_ids(token_ids, vocab_size: int) -> None:
    if not isinstance(token_ids, (list, tuple)):
        raise RequestError(f"prompt must be a string or a list of token ids, got "
                           f"{type(token_ids).__name__}", param="prompt")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)][:1]
    if bad:
        bad = bad[0]
        raise RequestError(f"prompt must be a string or a list of token ids (Python ints), got a "
                           f"{type(token_ids).__name__} holding {type(bad).__name__} {short_repr(bad)}",
                           param="prompt")
    if not token_ids:
        raise RequestError("prompt token list is empty; send at least one token", param="prompt")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                           param="prompt")


def short_repr(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_fits(num_prompt: int, max_tokens: int, capacity: Capacity) -> None:
    """Raise PromptTooLongError unless prompt + max_tokens fit the context and the KV cache."""
    total = num_prompt + max_tokens
    max_model_len = capacity.max_model_len
    if num_prompt >= max_model_len:  # (whatever max_tokens, given or not)
        raise PromptTooLongError(
            f"prompt ({num_prompt} tokens) + at least one generated token exceeds max_model_len "
            f"({max_model_len}); shorten the prompt to at most {max_model_len - 1} tokens",
            param="prompt", num_prompt_tokens=num_prompt, max_model_len=max_model_len)
    if total > max_model_len:
        raise PromptTooLongError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens "
            f"exceeds max_model_len ({max_model_len}); shorten the prompt or lower max_tokens "
            f"to at most {max_model_len - num_prompt}",
            param="max_tokens",
            num_prompt_tokens=num_prompt, max_model_len=max_model_len)
    if blocks_needed(total, capacity.block_size) > capacity.num_total_blocks:
        tokens = capacity.num_total_blocks * capacity.block_size
        raise PromptTooLongError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens "
            f"needs more KV cache than the engine has ({tokens} tokens in "
            f"{capacity.num_total_blocks} blocks); shorten the request or give the engine a larger "
            f"KV cache (kv_cache_memory_gb / num_kv_blocks)",
            param="max_tokens", num_prompt_tokens=num_prompt, max_model_len=max_model_len)


def check_add_request(message: AddRequest, capacity: Capacity) -> None:
    """Raise RequestError unless `message` is a well-formed request the engine can hold."""
    if not isinstance(message.request_id, str) or not message.request_id:
        raise RequestError(f"request_id must be a non-empty string, got {message.request_id!r}",
                           param="request_id")
    params = message.sampling_params
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}",
                           param="sampling_params")
    params.ensure_valid()  # a message off the wire always (unpickled params are unchecked)
    if params.n != 1:
        raise RequestError(f"the engine core takes one completion per request, got n={params.n}", param="n")
    check_token_ids(message.prompt_token_ids, capacity.vocab_size)
    check_fits(len(message.prompt_token_ids), params.max_tokens, capacity)
    if not isinstance(message.eos_token_ids, (set, frozenset)) or not all(
            isinstance(t, int) for t in message.eos_token_ids):
        raise RequestError("eos_token_ids must be a set of token ids", param="eos_token_ids")
    words = message.bad_words_ids
    if not isinstance(words, (list, tuple)) or not all(
            isinstance(word, (list, tuple)) and word and all(_in_vocab(t, capacity.vocab_size) for t in word)
            for word in words):
        raise RequestError("bad_words_ids must be non-empty sequences of token ids in the vocabulary",
                           param="bad_words")


def _in_vocab(token, vocab_size: int) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size


def _child_seed(seed: int | None, index: int) -> int | None:
    # Completion i of a seeded request uses seed + i, wrapped to stay a valid seed.
    if seed is None:
        return None
    return seed + index if seed + index < 2**64 else (seed + index) % 2**64


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"
