"""Turns user prompts into validated engine Requests, before anything is scheduled."""

from __future__ import annotations

from gristmill.engine import faults
from gristmill.engine.kv_blocks import blocks_needed
from gristmill.engine.request import Request
from gristmill.errors import GenerationError, PromptTooLongError, RequestError
from gristmill.sampling import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], vocab_size: int,
                 max_model_len: int, block_size: int, num_total_blocks: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_total_blocks = num_total_blocks

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt. Invalid input raises RequestError; a tokenizer failure
        raises GenerationError."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; send at least one token of text", param="prompt")
            try:
                faults.check("tokenize", prompt=prompt)
                return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except Exception as exc:  # noqa: BLE001 - a tokenizer failure ends only this request
                raise GenerationError(f"tokenizing the prompt failed: {exc}") from exc
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError(f"prompt must be a string or a list of token ids, got "
                               f"{type(prompt).__name__}", param="prompt")
        if not prompt:
            raise RequestError("prompt token list is empty; send at least one token", param="prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prompt: str | None = None) -> list[Request]:
        """One Request per completion (`params.n`); raises RequestError when invalid."""
        params.validate()
        self.check_fits(prompt_token_ids, params)
        if params.n == 1:
            return [Request(request_id, prompt_token_ids, params, self.eos_token_ids, prompt)]
        return [Request(child_request_id(request_id, i), prompt_token_ids,
                        params.clone(n=1, seed=_child_seed(params.seed, i)),
                        self.eos_token_ids, prompt)
                for i in range(params.n)]

    def check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num_prompt = len(prompt_token_ids)
        total = num_prompt + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens "
                f"to at most {max(self.max_model_len - num_prompt, 0)}",
                param="max_tokens" if num_prompt < self.max_model_len else "prompt",
                num_prompt_tokens=num_prompt, max_model_len=self.max_model_len)
        needed = blocks_needed(total, self.block_size)
        if needed > self.num_total_blocks:
            capacity = self.num_total_blocks * self.block_size
            raise PromptTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"needs more KV cache than the engine has ({capacity} tokens in "
                f"{self.num_total_blocks} blocks); shorten the request or give the engine a larger "
                f"KV cache (kv_cache_memory_gb / num_kv_blocks)",
                param="max_tokens", num_prompt_tokens=num_prompt, max_model_len=self.max_model_len)


def _child_seed(seed: int | None, index: int) -> int | None:
    # Completion i of a seeded request uses seed + i, wrapped to stay a valid seed.
    if seed is None:
        return None
    return seed + index if seed + index < 2**64 else (seed + index) % 2**64


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"
