"""Grammar engine: compiles constraints for one tokenizer and hands out matchers.

xgrammar (0.2.x) does the work; `benchmarks/structured_backends.py` measured it against
llguidance (1.9.x) on Gemma 3's 262k-token vocabulary: a third of the set-up time, half
the compile time of a nested schema, and 8x less time per step for a batch of 64 masks
(see docs/structured_output.md). Everything the engine needs goes through `Grammars` and
`Matcher`, so another engine fits behind the same two classes.

Compiled grammars are cached per constraint for the life of the engine (one tokenizer).
"""

from __future__ import annotations

import json
import logging
import re
import time
from functools import lru_cache

import torch

from gristmill.errors import RequestError
from gristmill.structured.spec import PARAM, Constraint

logger = logging.getLogger(__name__)


class Matcher:
    """One request's place in its grammar: which tokens may come next, and the tokens so far."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete and has taken its end-of-sequence token."""
        return self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w
        = token 32 * w + i)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles `Constraint`s for one model's tokenizer (set up once, ~1 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import xgrammar

        start = time.perf_counter()
        self._xgrammar = xgrammar
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                            stop_token_ids=sorted(eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2)
        self.compile = lru_cache(maxsize=256)(self._compile)
        logger.info("grammar engine ready for a %d-token vocabulary in %.1f s", vocab_size,
                    time.perf_counter() - start)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for `constraint`; an invalid schema, regex or grammar is a
        RequestError naming what is wrong."""
        return Matcher(self._xgrammar.GrammarMatcher(self.compile(constraint)))

    def _compile(self, constraint: Constraint):
        compiler = self.compiler
        with _engine_errors(constraint):
            if constraint.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_grammar(_grammar(constraint))


def check(constraint: Constraint) -> None:
    """Parse `constraint`'s schema, regex or grammar (no tokenizer needed): a RequestError
    naming what is wrong, where the request is built."""
    if constraint.kind != "json_object":
        with _engine_errors(constraint):
            _grammar(constraint)


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


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask -> (rows, vocab_size) bool, on the bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
