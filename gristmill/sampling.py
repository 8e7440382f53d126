"""SamplingParams: how tokens are chosen and when a request stops."""

from __future__ import annotations

import copy
import json
import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path

from gristmill.errors import RequestError
from gristmill.structured.spec import ToolCallGrammar, given_kinds, parse_constraint, short

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 100


#: A temperature below this samples greedily (vLLM's threshold): dividing logits by a
#: smaller one would overflow float32, and the distribution is all but an argmax anyway.
GREEDY_BELOW = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and stops. Invalid values raise `RequestError`."""

    #: Most tokens to generate (the prompt is not counted). None: as many as the context
    #: and the KV cache leave room for after the prompt (filled in where it is tokenized).
    max_tokens: int | None = 16
    #: 0 picks the most likely token (greedy), as does any value below GREEDY_BELOW (as
    #: vLLM); higher flattens the distribution.
    temperature: float = 1.0
    #: Keep the smallest set of tokens whose probability adds up to top_p (1 = all).
    top_p: float = 1.0
    #: Keep the k most likely tokens (0 or -1 = all).
    top_k: int = 0
    #: Drop tokens less likely than min_p times the most likely one (0 = off).
    min_p: float = 0.0
    #: Seed of this request's own random stream: same seed, same output, whatever
    #: else is in the batch. None draws from the engine's stream.
    seed: int | None = None
    #: Strings that end generation; the returned text never contains them (unless
    #: include_stop_str_in_output).
    stop: list[str] = field(default_factory=list)
    #: Token ids that end generation (in addition to the model's end-of-sequence ids).
    stop_token_ids: list[int] = field(default_factory=list)
    #: Keep going past end-of-sequence tokens until max_tokens.
    ignore_eos: bool = False
    #: Return the top-k log-probabilities of each sampled token (None = off).
    logprobs: int | None = None
    #: Completions to generate for each prompt.
    n: int = 1
    #: Leave special tokens out of the returned text.
    skip_special_tokens: bool = True
    #: Constrain the output, with exactly one of: {"json": JSON schema (dict or text)},
    #: {"json_object": True} (any JSON object), {"regex": "..."}, {"choice": ["a", ...]},
    #: {"grammar": EBNF / GBNF text}. None = free text.
    structured_output: dict | ToolCallGrammar | None = None
    #: {token id: bias in [-100, 100]} added to that token's logit before sampling (OpenAI's
    #: logit_bias; +100 all but forces a token, -100 all but bans it). None = off.
    logit_bias: dict[int, float] | None = None
    #: OpenAI's presence_penalty, in [-2, 2]: subtracted once from the logit of every token
    #: the completion already contains (> 0 favours new tokens). 0 = off.
    presence_penalty: float = 0.0
    #: OpenAI's frequency_penalty, in [-2, 2]: subtracted from a token's logit once for each
    #: time the completion already contains it. 0 = off.
    frequency_penalty: float = 0.0
    #: vLLM's and transformers' repetition_penalty, in [0.01, 100]: the logit of every token of the
    #: prompt or the completion is divided by it when positive and multiplied by it when
    #: negative (> 1 discourages repeats). 1 = off.
    repetition_penalty: float = 1.0
    #: Tokens to generate before an end-of-sequence token, stop_token_ids or a stop string
    #: may end the completion.
    min_tokens: int = 0
    #: Words the completion must not contain: each is tokenized (alone and after a space),
    #: and the last token of each form is banned wherever the completion ends with the rest.
    bad_words: list[str] = field(default_factory=list)
    #: vLLM's: the text ends with the stop string that ended it.
    include_stop_str_in_output: bool = False
    #: vLLM's: the log-probability of each prompt token after the ones before it, with the
    #: top-k others at that place (`RequestOutput.prompt_logprobs`; None for the first
    #: token), as evaluation harnesses score text by its likelihood. None = off.
    prompt_logprobs: int | None = None
    #: A chat on a reasoning model: most tokens its reasoning may take; once spent, the
    #: reasoning's end marker (`</think>`) is forced, so the answer (under
    #: `structured_output`, if given) always follows. None = no limit. Refused on an engine
    #: without a reasoning parser and on prompts that are not chats (nothing to limit).
    max_reasoning_tokens: int | None = None
    #: `validate()` passed and no field was assigned since: the engine's client does not
    #: check it again (a list or dict changed in place is not seen; the core checks
    #: every request it receives anyway).
    _valid: bool = field(default=False, init=False, repr=False, compare=False)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name != "_valid":
            object.__setattr__(self, "_valid", False)

    def __getstate__(self) -> dict:
        # Without `_valid`: a receiver (the engine core) checks what it is sent.
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "_valid"}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_valid", False)

    def __post_init__(self):
        self.structured_output = given_kinds(self.structured_output)
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str):
            if not ok:
                raise RequestError(message, param=param)

        # Lists however given, also assigned after construction: one string is one entry, None none.
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            value = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
            check(value is None or isinstance(value, (list, tuple)), name,
                  f"{name} must be a list (or None), got {short(value)}")
            object.__setattr__(self, name, list(value or []))
        check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
              f"include_stop_str_in_output must be true or false, got {self.include_stop_str_in_output!r}")

        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              f"max_tokens must be an integer >= 1 (or None: the room left after the prompt), "
              f"got {self.max_tokens!r}")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
              f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
              f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
              f"top_k must be an integer >= 0 (0 or -1 = all tokens), got {self.top_k!r}")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
              f"min_p must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed",
              f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              f"stop must be a list of non-empty strings, got {self.stop!r}")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                               and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
              "prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got "
                                 f"{self.prompt_logprobs!r}")
        check(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
                  f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries, "
                  f"got {short(self.logit_bias)}")
            try:
                self.logit_bias = {_token_id(k): _bias(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                check(False, "logit_bias", f"logit_bias keys must be token ids and values numbers, got "
                                           f"{short(self.logit_bias)}")
            check(all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()), "logit_bias",
                  f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {short(self.logit_bias)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_number(value) and -2 <= value <= 2, name, f"{name} must be a number in [-2, 2], got {value!r}")
        # (a logit divided by a far smaller penalty would overflow float32 to infinity)
        check(_is_number(self.repetition_penalty) and REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty
              <= REPETITION_PENALTY_RANGE[1], "repetition_penalty",
              f"repetition_penalty must be a number in [{REPETITION_PENALTY_RANGE[0]}, "
              f"{REPETITION_PENALTY_RANGE[1]}] (1 = off), got {self.repetition_penalty!r}")
        check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens",
              f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        check(self.max_reasoning_tokens is None or (_is_int(self.max_reasoning_tokens)
                                                    and self.max_reasoning_tokens >= 0),
              "max_reasoning_tokens", f"max_reasoning_tokens must be an integer >= 0 (or None: no limit), "
                                      f"got {self.max_reasoning_tokens!r}")
        check(len(self.bad_words) <= MAX_BAD_WORDS and all(isinstance(w, str) and w.strip() for w in self.bad_words),
              "bad_words", f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings, "
                           f"got {short(self.bad_words)}")
        constraint = parse_constraint(self.structured_output)
        if constraint is not None:  # its schema, regex or grammar parses (the engine compiles it for its tokenizer)
            from gristmill.structured.grammars import check
            check(constraint)
        object.__setattr__(self, "_valid", True)

    def ensure_valid(self) -> None:
        """`validate()` unless it passed and nothing was assigned since."""
        if not self._valid:
            self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """It asks for a presence, frequency or repetition penalty."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def derived(self, **changes) -> "SamplingParams":
        """A copy with `changes` the caller knows keep it valid (one completion of n, its
        seed, the room left as max_tokens): not validated again."""
        new = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        object.__setattr__(new, "_valid", self._valid)
        return new


#: The generation_config.json fields a model's default SamplingParams take (vLLM's
#: `get_default_sampling_params`): HF's name -> ours.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_defaults(model_dir: Path) -> dict:
    """The SamplingParams fields the model's generation_config.json sets (of
    GENERATION_CONFIG_FIELDS; null values are left out); {} without the file. As in vLLM,
    `do_sample` is not read: a temperature there samples even with do_sample false."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RequestError(f"{path} could not be read as JSON ({exc}); fix the file or pass SamplingParams",
                           param="sampling_params") from None
    if not isinstance(config, dict):
        raise RequestError(f"{path} must hold a JSON object; fix the file or pass SamplingParams",
                           param="sampling_params")
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
            if config.get(theirs) is not None}


def _token_id(key) -> int:
    """A logit_bias key as a token id: an int, or its decimal text (JSON object keys, as
    OpenAI sends them, are strings); never a float or a bool cut down to one."""
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):  # numpy's integers too
        return int(key)
    if isinstance(key, str) and key.strip().lstrip("-").isdigit() and key.isascii():
        return int(key)
    raise ValueError(f"not a token id: {key!r}")


def _bias(value) -> float:
    """A logit_bias value: a number, never a bool or a numeric string."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

