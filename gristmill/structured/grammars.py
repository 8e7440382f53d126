"""Grammar engines: compile constraints for one tokenizer and hand out matchers.

llguidance (1.9.x) is the default; xgrammar (0.2.x) fits behind the same interface
(`EngineConfig.structured_output_backend`). `benchmarks/structured_output.py` measured
both end to end on Gemma 3's 262k-token vocabulary: llguidance gave the higher
throughput under a realistic schema and compiles one in milliseconds where xgrammar took
over half a second (docs/structured_output.md). Everything the engine needs goes through
a `Grammars`-like object (`matcher(constraint)`), `Matcher` (accept, finished, error,
fill_mask, allows) and `fill_masks`; a constraint that applies after a reasoning wraps its
matcher in `reasoning_gate.GatedMatcher`, of the same interface; the sampler applies the masks (gristmill.model.masking).

Compiled grammars are cached per constraint for the life of the engine (one tokenizer).
Checking a constraint (`check`, where SamplingParams are built) imports no torch.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from gristmill.errors import RequestError
from gristmill.structured.spec import PARAM, Constraint, named_for, parse_constraint

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class Matcher:
    """One request's place in its grammar (xgrammar's GrammarMatcher): which tokens may
    come next, and the tokens so far."""

    __slots__ = ("_matcher", "constraint")

    def __init__(self, matcher, constraint: Constraint):
        self._matcher = matcher
        #: What it matches: two matchers of one constraint fed the same tokens are in the
        #: same state (and allow the same tokens).
        self.constraint = constraint

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete and has taken its end-of-sequence token."""
        return self._matcher.is_terminated()

    @property
    def error(self) -> str | None:
        """Why the engine gave up on this request's grammar, when it says."""
        return None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w
        = token 32 * w + i)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar surely allows `token_id` next, without advancing; False
        when the engine cannot tell cheaply (xgrammar): the caller then fills the mask."""
        return False

    def forced_tokens(self) -> list[int]:
        """Tokens that spell text the grammar allows no alternative to from here (none
        where the engine cannot tell: xgrammar). The engine appends them without sampling
        (`EngineConfig.fast_forward`), then `accept`s each."""
        return []

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is constrained at all (False: any token may come, and
        the sampler skips this row's mask: a lazy grammar before its trigger)."""
        return True

    def grammar_for_mask(self) -> Matcher | None:
        """The matcher whose grammar mask this one's mask starts from (itself; a matcher
        that gates a grammar, gristmill.structured.reasoning_gate, may give its inner one
        or none), so `fill_masks` fills every grammar's mask in one call."""
        return self

    def adjust_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Make `bitmask[row]` this matcher's mask once `grammar_for_mask()`'s is in it."""


class _LLGuidanceMatcher(Matcher):
    """The same operations over an llguidance LLMatcher."""

    __slots__ = ()

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return _reason(self._matcher.get_error()) if self._matcher.is_error() else None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        _check_bitmask(words)
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def allows(self, token_id: int) -> bool:
        return self._matcher.validate_tokens([token_id]) == 1

    def forced_tokens(self) -> list[int]:
        # (llguidance tokenizes the forced bytes and leaves out a last token that the
        # text after them could merge into a longer one)
        return self._matcher.compute_ff_tokens()

    def restart(self, token_ids: list[int]) -> bool:
        """Back to the grammar's start, then take `token_ids`; False (and back at the start)
        when the grammar does not allow them."""
        self._matcher.reset()
        if self._matcher.consume_tokens(token_ids):
            return True
        self._matcher.reset()
        return False

    @property
    def accepting(self) -> bool:
        """The grammar is complete here (it may allow more)."""
        return self._matcher.is_accepting()


class LLGuidanceGrammars:
    """`Constraint`s compiled by llguidance (1.9.x, the default engine) for one model's
    tokenizer; the same interface as `Grammars` (xgrammar)."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids,
                 tokenizer_file: Path | None = None):
        """`load_tokenizer()` gives the HF tokenizer; it is not called when
        `tokenizer_file` (the model's tokenizer.json) has no padding or truncation:
        llguidance then reads that file itself, and the engine core never loads an HF
        tokenizer (a second of holding the GIL for Gemma 3's 262k vocabulary)."""
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise RequestError("structured_output_backend='llguidance' needs the llguidance package: "
                               "pip install 'llguidance>=1.9,<2'", param="structured_output") from None
        start = time.perf_counter()
        self._llguidance = llguidance
        eos = sorted(eos_token_ids)
        if tokenizer_file is not None and _plain_tokenizer_file(tokenizer_file):
            self.tokenizer = llguidance.LLTokenizer(str(tokenizer_file), n_vocab=vocab_size, eos_token=eos)
        else:
            tokenizer = load_tokenizer()
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is not None and backend.padding is None and backend.truncation is None:
                # What llguidance.hf.from_tokenizer does, without the copy it makes to turn
                # padding and truncation off (a second of a 262k vocabulary's set-up).
                self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
            else:
                self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.compile = lru_cache(maxsize=256)(self._compile)
        # The first mask ever computed for a tokenizer builds llguidance's tables for it
        # (seconds for a 262k vocabulary): here, with the rest of the set-up, rather than
        # inside the first constrained step.
        warm = self.matcher(Constraint("choice", '["a"]'))
        fill_masks([warm], torch_bitmask(1, vocab_size))
        logger.info("grammar engine (llguidance) ready for a %d-token vocabulary in %.1f s", vocab_size,
                    time.perf_counter() - start)

    def matcher(self, constraint: Constraint) -> Matcher:
        matcher = self._llguidance.LLMatcher(self.tokenizer, self.compile(constraint))
        if matcher.is_error():
            raise RequestError(f"{PARAM}.{constraint.kind} is not valid: {matcher.get_error()}", param=PARAM)
        matcher = _LLGuidanceMatcher(matcher, constraint)
        if constraint.kind == "tool_calls":
            from gristmill.structured.lazy_grammar import lazy_matcher
            return lazy_matcher(matcher, json.loads(constraint.source), self.tokenizer)
        return matcher

    def _compile(self, constraint: Constraint) -> str:
        return _llguidance_grammar(constraint, self.tokenizer)


class Grammars:
    """`Constraint`s compiled by xgrammar for one model's tokenizer (set up once, ~1-5 s)."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids,
                 tokenizer_file: Path | None = None):
        import xgrammar

        start = time.perf_counter()
        self._xgrammar = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(), vocab_size=vocab_size,
                                                            stop_token_ids=sorted(eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2)
        self.compile = lru_cache(maxsize=256)(self._compile)
        logger.info("grammar engine ready for a %d-token vocabulary in %.1f s", vocab_size,
                    time.perf_counter() - start)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for `constraint`; an invalid schema, regex or grammar is a
        RequestError naming what is wrong."""
        return Matcher(self._xgrammar.GrammarMatcher(self.compile(constraint)), constraint)

    def _compile(self, constraint: Constraint):
        compiler = self.compiler
        with _engine_errors(constraint):
            if constraint.kind == "tool_calls":
                raise RequestError("tool-call grammars need the llguidance grammar engine; start the engine with "
                                   "structured_output_backend='llguidance' (the default)", param=PARAM)
            if constraint.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_grammar(_grammar(constraint))


def _plain_tokenizer_file(path: Path) -> bool:
    """A tokenizers JSON file whose first keys say it pads and truncates nothing (as
    tokenizers writes them: version, truncation, padding)."""
    try:
        with open(path, "rb") as file:
            head = file.read(512)
    except OSError:
        return False
    return re.match(rb'\{\s*"version"\s*:\s*"[^"]*"\s*,\s*"truncation"\s*:\s*null\s*,\s*"padding"\s*:\s*null\s*,',
                    head) is not None


def check_constraint(value, field: str | None) -> None:
    """`value` (a `structured_output`) parses, or a RequestError naming `field`, the
    request field it came from."""
    try:
        constraint = parse_constraint(value)
        if constraint is not None:
            check(constraint)
    except RequestError as exc:
        raise named_for(exc, field) from None


def check(constraint: Constraint) -> None:
    """Parse `constraint`'s schema, regex or grammar with the default engine (no tokenizer
    needed): a RequestError naming what is wrong, where the request is built."""
    _llguidance_grammar(constraint, None)


def _llguidance_grammar(constraint: Constraint, tokenizer) -> str:
    """`constraint` as an llguidance grammar, checked (against `tokenizer` when given)."""
    import llguidance

    kind, source = constraint.kind, constraint.source
    with _engine_errors(constraint):
        if kind == "tool_calls":
            grammar = llguidance.grammar_from("lark", tool_calls_lark(json.loads(source), tokenizer))
        elif kind in ("json", "json_object"):
            schema = closed_objects(source) if kind == "json" else '{"type": "object"}'
            # One space after ',' and ':', none elsewhere (as xgrammar writes JSON): a model
            # cannot pad a document forever.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
        else:
            grammar = llguidance.grammar_from({"regex": "regex", "choice": "choice", "grammar": "grammar"}[kind],
                                              source)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise RequestError(f"{PARAM}.{kind} is not valid: {_reason(error)}", param=PARAM)
    return grammar


def tool_calls_lark(spec: dict, tokenizer) -> str:
    """A tool-call grammar's Lark text (`spec.Constraint` "tool_calls") with its `marker_K`
    rules: the marker's special token where `tokenizer` (an LLTokenizer) has it as one
    token, so the model writes the token it was trained on; else the marker's text."""
    rules = [spec["grammar"]]
    for k, marker in enumerate(spec["markers"]):
        ids = tokenizer.tokenize_str(marker) if tokenizer is not None else []
        special = len(ids) == 1 and tokenizer.is_special_token(ids[0])
        rules.append(f"marker_{k}: " + (f"<[{ids[0]}]>" if special else json.dumps(marker)))
    return "\n".join(rules) + "\n"


_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed_objects(schema: str) -> str:
    """`schema` with `"additionalProperties": false` in every object schema that lists
    `properties` and does not say: the output has the keys the schema names and no
    others, as xgrammar's strict mode (vLLM's default) and OpenAI's strict schemas have
    it. Without it a small model invents keys until max_tokens cuts the document off."""
    def close(node):
        if isinstance(node, dict):
            node = {key: close(value) for key, value in node.items()}
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node \
                    and "unevaluatedProperties" not in node:
                node["additionalProperties"] = False
            return node
        if isinstance(node, list):
            return [close(item) for item in node]
        return node
    return json.dumps(close(json.loads(schema)), separators=(",", ":"))


def _reason(text: str) -> str:
    """llguidance's message in one line: where, and the cause (a later "error:" line when
    the first only says where; the lines between point at the source)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return text
    cause = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0].rstrip(':')}: {cause[len('error:'):].strip()}" if cause else lines[0]


def _grammar(constraint: Constraint):
    import xgrammar

    kind, source = constraint.kind, constraint.source
    if kind == "json":
        return xgrammar.Grammar.from_json_schema(source, any_whitespace=False)
    if kind == "regex":
        return xgrammar.Grammar.from_regex(source)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(source))
        return xgrammar.Grammar.from_ebnf(f"root ::= {alternatives}")
    return xgrammar.Grammar.from_ebnf(source)


class _engine_errors:
    """Turns the grammar engine's errors about a constraint into a RequestError."""

    def __init__(self, constraint: Constraint):
        self.kind = constraint.kind

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, RequestError) or not isinstance(exc, Exception):
            return False
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        # without the engine's "[time] file.cc:line: " prefix
        reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", lines[-1]) if lines else type(exc).__name__
        raise RequestError(f"{PARAM}.{self.kind} is not valid: {reason}", param=PARAM) from None


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def torch_bitmask(rows: int, vocab_size: int, pin_memory: bool = False):
    """An all-allowed (rows, words) int32 bitmask on the host."""
    import torch
    return torch.full((rows, mask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


_executor = None


def fill_masks(matchers: list[Matcher], bitmask: torch.Tensor) -> None:
    """Row k of `bitmask` (int32, on the host) = the mask of `matchers[k]`; llguidance
    matchers fill theirs on the engine's own threads, all at once."""
    global _executor
    grammars = [(k, grammar) for k, grammar in enumerate(m.grammar_for_mask() for m in matchers)
                if grammar is not None]
    if grammars and all(isinstance(g, _LLGuidanceMatcher) for _, g in grammars):
        import llguidance
        if _executor is None:
            _executor = llguidance.LLExecutor()
        _check_bitmask(bitmask)
        _executor.unsafe_compute_mask_ptr([(g._matcher, k) for k, g in grammars], bitmask.data_ptr(),
                                          bitmask.shape[1] * 4, bitmask.shape[0])
    else:
        for k, grammar in grammars:
            grammar.fill_mask(bitmask, k)
    for k, matcher in enumerate(matchers):
        matcher.adjust_mask(bitmask, k)


def _check_bitmask(bitmask: torch.Tensor) -> None:
    """What llguidance writes its masks into by address (as its llguidance.torch helpers
    do; importing those costs 3 s: a torch.compile decorator that imports torch._dynamo)."""
    import torch
    if not (bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()):
        raise ValueError("a token bitmask must be a contiguous int32 tensor on the host")


BACKENDS = {"xgrammar": Grammars, "llguidance": LLGuidanceGrammars}
