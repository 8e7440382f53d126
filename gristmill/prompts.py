"""Prompts as the Python faces take them (LLM.generate, AsyncEngine): text, token ids (a
list, a tuple, a 1-D numpy array of integers), or vLLM's prompt dicts {"prompt": text} /
{"prompt_token_ids": ids}."""

from __future__ import annotations

import numbers

from gristmill.errors import RequestError


def is_token_id(t) -> bool:
    # numpy and other integer types count (vLLM users pass them), bools do not.
    return type(t) is int or (isinstance(t, numbers.Integral) and not isinstance(t, bool)
                              and type(t).__name__ != "bool_")


def is_token_ids(prompt) -> bool:
    if type(prompt).__name__ == "ndarray":  # (numpy is not imported here for this)
        return prompt.ndim == 1 and prompt.size > 0 and is_token_id(prompt.reshape(-1)[0])
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(is_token_id(t) for t in prompt)


_DICT_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_item(prompt) -> tuple[object, RequestError | None]:
    """(the prompt as a str or a list of int token ids, None), or (None, why it is invalid)."""
    if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
        given = [k for k in _DICT_PROMPT_KEYS if k in prompt]
        other = sorted(map(str, set(prompt) - set(_DICT_PROMPT_KEYS)))
        if len(given) != 1 or other:
            return None, RequestError(
                f"a prompt dict must have exactly one of the keys 'prompt' (text) or 'prompt_token_ids' "
                f"(token ids), got keys {sorted(map(str, prompt))}"
                + (f"; {other} are not supported" if other else ""), param="prompt")
        prompt = prompt[given[0]]
    if isinstance(prompt, bytes):
        return None, RequestError("prompt is bytes; pass text (decode it, e.g. prompt.decode('utf-8')) or a list "
                                  "of token ids", param="prompt")
    if not isinstance(prompt, str) and is_token_ids(prompt):
        return (prompt if type(prompt) is list and all(type(t) is int for t in prompt)
                else [int(t) for t in prompt]), None
    return prompt, None


def score_pairs(firsts: list, seconds: list, names: tuple[str, str]) -> tuple[list, list]:
    """The pairs a score request scores, as two lists: one first text against each second,
    or the i-th with the i-th; `names` are the two fields, for the error."""
    if not firsts or not seconds:
        raise RequestError(f"{names[0]} and {names[1]} must each hold at least one text", param=names[1])
    if len(firsts) == 1:
        return firsts * len(seconds), seconds
    if len(firsts) != len(seconds):
        raise RequestError(f"{names[0]} has {len(firsts)} texts and {names[1]} {len(seconds)}; give one text as "
                           f"{names[0]} (scored against each of {names[1]}) or as many as {names[1]} (scored "
                           f"pairwise)", param=names[1])
    return firsts, seconds
