"""A lazy grammar (as llama.cpp's grammar triggers): the output runs free until it writes a
trigger text, then a grammar holds it from the trigger's first byte until the grammar is
complete, then it runs free again. `tool_choice="auto"` uses it so that a call the model
starts is a whole call whose arguments match their schema (structured.tool_grammar). With
`one_call` (`parallel_tool_calls: false`) the grammar never lets go: once the call is whole
it allows only what ends it (an end marker, the end-of-sequence token), so the first call
ends the answer.

While free, a token costs a lookup of its bytes and a search of the last few bytes for a
trigger: no grammar work, no mask (`constrains_next` is False, so the sampler leaves the
row alone). Triggers are found in the text, whatever tokens spell them: a special token
(`<tool_call>` in Qwen3's vocabulary) and the same text in pieces alike. On a trigger the
grammar takes the text from the trigger's start, as tokens of the vocabulary; the bytes
after the trigger in the token that ended it are the grammar's too (a token that the
grammar cannot take there leaves the call unconstrained: the parser reads it or reports
it as text).

`LazyMatcher` has a grammar `Matcher`'s interface; its `constraint` key is the grammar's
own, which differs from every other constraint's, so only rows of one lazy constraint
with the same output share a mask (gristmill.model.masking).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FREE, HELD = "free", "held"
_BLANK = b" \t\r\n"


def lazy_matcher(grammar, spec: dict, tokenizer):
    """The matcher of a tool-call constraint (`spec`: its "triggers", "start_triggers" and
    "one_call"): `grammar` itself when it has no triggers (a forced call), else a
    LazyMatcher over it."""
    if not spec["triggers"] and not spec["start_triggers"]:
        return grammar
    return LazyMatcher(grammar, tokenizer, [t.encode() for t in spec["triggers"]],
                       [t.encode() for t in spec["start_triggers"]], separators=b";,", one_call=spec["one_call"])


class LazyMatcher:
    """`grammar` (an llguidance Matcher) held off until a trigger. `tokenizer`: the
    LLTokenizer (token bytes; text -> tokens); `triggers`: bytes anywhere in the output;
    `start_triggers`: bytes that start a call only at the start of the output or right
    after a call (after blanks and `separators`); `one_call`: the first call ends the
    output (the grammar holds on to the end-of-sequence token)."""

    __slots__ = ("grammar", "tokenizer", "triggers", "start_triggers", "separators", "one_call", "constraint",
                 "_state", "_tail", "_lead", "_keep")

    def __init__(self, grammar, tokenizer, triggers: list[bytes], start_triggers: list[bytes],
                 separators: bytes = b"", one_call: bool = False):
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.triggers = triggers
        self.start_triggers = start_triggers
        self.separators = _BLANK + separators
        self.one_call = one_call
        self.constraint = ("lazy", grammar.constraint)
        self._state = FREE
        self._tail = b""  # the last bytes of the output while free (a trigger may end in the next token)
        self._lead = b""  # the output since its start or the last call, while a start trigger may begin it
        self._keep = max((len(t) for t in triggers), default=1) - 1

    @property
    def holding(self) -> bool:
        """A call is under way: the grammar holds the output."""
        return self._state == HELD

    def accept(self, token_id: int) -> bool:
        if self._state == HELD:
            if not self.grammar.accept(token_id):
                return False
            self._release_if_done()
            return True
        self._watch(self.tokenizer.decode_bytes([token_id]))
        return True

    def _watch(self, new: bytes) -> None:
        """Look for a trigger that ends in `new`, the bytes of the token just taken."""
        if self._lead is not None:
            self._lead += new
            head = self._lead.lstrip(self.separators)
            for trigger in self.start_triggers:
                if head.startswith(trigger):
                    self._hold(head)
                    return
            if head and not any(t.startswith(head) for t in self.start_triggers):
                self._lead = None
        if not self.triggers:
            return
        text = self._tail + new
        for trigger in self.triggers:
            at = text.find(trigger, max(0, len(self._tail) - len(trigger) + 1))
            if at >= 0:
                self._hold(text[at:])
                return
        self._tail = text[-self._keep:] if self._keep else b""

    def _hold(self, text: bytes) -> None:
        """A call starts with `text` (its trigger, and what the token that ended it wrote after it)."""
        self._tail, self._lead = b"", None
        if self.grammar.restart(self.tokenizer.tokenize_bytes(text)):
            self._state = HELD
            self._release_if_done()
        # (else the token went on in a way no call can: left to the parser)

    def _release_if_done(self) -> None:
        if self.grammar.accepting and not self.one_call:
            self._state, self._lead, self._tail = FREE, b"", b""

    @property
    def finished(self) -> bool:
        # (a free output ends as any does: at its end-of-sequence token or length; one call,
        # as a forced call does)
        return self._state == HELD and self.one_call and self.grammar.finished

    @property
    def error(self) -> str | None:
        return self.grammar.error if self._state == HELD else None

    def allows(self, token_id: int) -> bool:
        return self.grammar.allows(token_id) if self._state == HELD else True

    def forced_tokens(self) -> list[int]:
        return self.grammar.forced_tokens() if self._state == HELD else []

    @property
    def constrains_next(self) -> bool:
        return self._state == HELD

    def grammar_for_mask(self):
        return self.grammar if self._state == HELD else None

    def adjust_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == FREE:
            bitmask[row].fill_(-1)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == HELD:
            self.grammar.fill_mask(bitmask, row)
        else:
            bitmask[row].fill_(-1)
