"""Structured output after a reasoning model's reasoning: a matcher that lets the reasoning
run free (all but end-of-sequence: an answer must follow it) and hands every token after
its end marker (`</think>`) to the constraint's own matcher.

The gate works on token ids, not text: it sees the reasoning end when the output's tokens
spell the end marker's tokens (as the model writes it; the same text spelled by other
tokens is not seen). A budget (`max_reasoning_tokens`) forces the marker's tokens once
that many reasoning tokens are out, so a constrained answer always follows.

`GatedMatcher` has a grammar `Matcher`'s interface (accept, finished, error, fill_mask,
allows, constraint); its `constraint` key differs from the inner one's, so rows with and
without a gate never share a mask (gristmill.model.masking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Where a gated output is: before its first token decides whether it reasons (Qwen3
# writes `<think>` itself when it does), inside the reasoning, or in the answer.
OPENING, REASONING, ANSWER = "opening", "reasoning", "answer"


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """What the engine core needs to gate one request's constraint behind its reasoning
    (sent by the client, which knows the reasoning parser and the tokenizer)."""

    #: The end marker's token ids (`</think>`): the answer starts after them.
    end_token_ids: tuple[int, ...]
    #: True: the prompt opened the reasoning (or the model always reasons); False: the
    #: output's first token decides, reasoning if it is `start_token_id`.
    opened: bool
    #: The start marker's token (`<think>`), when it is one token; None: an output that
    #: the prompt did not open is all answer.
    start_token_id: int | None = None
    #: Most reasoning tokens before the end marker is forced (`max_reasoning_tokens`); None: no limit.
    max_tokens: int | None = None

    def check(self, vocab_size: int) -> None:
        """ValueError unless it is well formed for a `vocab_size`-token model."""
        ids = self.end_token_ids
        start = () if self.start_token_id is None else (self.start_token_id,)
        if not isinstance(ids, tuple) or not ids or not all(
                type(t) is int and 0 <= t < vocab_size for t in (*ids, *start)):
            raise ValueError("the reasoning markers' token ids must be token ids in the vocabulary")
        if type(self.opened) is not bool or not (self.max_tokens is None or (
                type(self.max_tokens) is int and self.max_tokens >= 0)):
            raise ValueError("a reasoning gate needs opened (a bool) and max_tokens (an int >= 0 or None)")


class GatedMatcher:
    """One request's constraint (`inner`, a grammar Matcher, or None for a free answer)
    applied after its reasoning; `eos_token_ids` are refused while it reasons."""

    __slots__ = ("inner", "gate", "eos_token_ids", "constraint", "_state", "_spent", "_matched")

    def __init__(self, inner, gate: ReasoningGate, eos_token_ids: frozenset[int]):
        self.inner = inner
        self.gate = gate
        self.eos_token_ids = eos_token_ids
        #: Same key, same tokens, same state: never equal to an ungated matcher's key.
        self.constraint = ("after_reasoning", getattr(inner, "constraint", None), gate, eos_token_ids)
        if gate.opened:
            self._state = REASONING
        elif gate.start_token_id is None or gate.max_tokens == 0:
            self._state = ANSWER  # (no room to reason: the constraint applies from the start)
        else:
            self._state = OPENING
        self._spent = 0  # reasoning tokens so far
        self._matched = 0  # end-marker tokens the reasoning ends with so far

    @property
    def answering(self) -> bool:
        """The reasoning is over (or there was none): the constraint applies."""
        return self._state == ANSWER

    @property
    def _forced(self) -> int | None:
        """The end marker's next token, once the budget is spent; else None."""
        budget = self.gate.max_tokens
        if self._state == REASONING and budget is not None and self._spent >= budget:
            return self.gate.end_token_ids[self._matched]
        return None

    def accept(self, token_id: int) -> bool:
        if self._state == OPENING:
            if token_id == self.gate.start_token_id:
                self._state = REASONING
                return True
            self._state = ANSWER
        if self._state == ANSWER:
            return self.inner.accept(token_id) if self.inner is not None else True
        if not self.allows(token_id):
            return False
        end = self.gate.end_token_ids
        self._spent += 1
        self._matched = self._matched + 1 if token_id == end[self._matched] else int(token_id == end[0])
        if self._matched == len(end):
            self._state = ANSWER
        return True

    @property
    def finished(self) -> bool:
        return self._state == ANSWER and self.inner is not None and self.inner.finished

    @property
    def error(self) -> str | None:
        return self.inner.error if self._state != REASONING and self.inner is not None else None

    def allows(self, token_id: int) -> bool:
        if self._state == REASONING:
            forced = self._forced
            return token_id == forced if forced is not None else token_id not in self.eos_token_ids
        if self._state == OPENING and token_id == self.gate.start_token_id:
            return True
        return self.inner.allows(token_id) if self.inner is not None else True

    def forced_tokens(self) -> list[int]:
        """The end marker's remaining tokens once the budget is spent; the answer's
        constraint's forced tokens once it applies."""
        if self._state == REASONING:
            return list(self.gate.end_token_ids[self._matched:]) if self._forced is not None else []
        if self._state == ANSWER and self.inner is not None:
            return self.inner.forced_tokens()
        return []

    @property
    def constrains_next(self) -> bool:
        if self._state == ANSWER:
            return self.inner is not None and self.inner.constrains_next
        return True

    def grammar_for_mask(self):
        """The grammar matcher whose mask this one's starts from (filled by the grammar
        engine, with the other rows'), or None: `adjust_mask` writes all of it."""
        if self._state == REASONING or self.inner is None:
            return None
        return self.inner.grammar_for_mask()

    def adjust_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Make `bitmask[row]` this matcher's mask, once `grammar_for_mask()`'s is in it."""
        words = bitmask[row]
        if self._state == REASONING:
            forced = self._forced
            if forced is not None:
                words.zero_()
                _set_bit(words, forced, True)
                return
            words.fill_(-1)
            for token_id in self.eos_token_ids:
                _set_bit(words, token_id, False)
        elif self.inner is None:
            words.fill_(-1)
        else:
            self.inner.adjust_mask(bitmask, row)
            if self._state == OPENING:
                _set_bit(words, self.gate.start_token_id, True)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        grammar = self.grammar_for_mask()
        if grammar is not None:
            grammar.fill_mask(bitmask, row)
        self.adjust_mask(bitmask, row)


def _set_bit(words: torch.Tensor, token_id: int, allowed: bool) -> None:
    """Allow or refuse `token_id` in one row of int32 mask words (bit i of word w = token
    32 * w + i)."""
    word, bit = divmod(token_id, 32)
    if word >= words.shape[0]:
        return
    value = int(words[word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    words[word] = value - (1 << 32) if value >= 1 << 31 else value
