"""The reasoning gate on its own, over a stand-in grammar: the reasoning runs free but for
end-of-sequence, the budget forces the end marker's tokens in order (a marker of several
tokens too), the constraint's matcher sees only the tokens after the marker, and the masks
say the same as `allows`."""

from __future__ import annotations

import pytest
import torch

from gristmill.model.masking import allowed_tokens
from gristmill.structured.grammars import fill_masks, torch_bitmask
from gristmill.structured.reasoning_gate import GatedMatcher, ReasoningGate

VOCAB = 70  # three mask words, the last one partly used
EOS, START, END_A, END_B = 2, 40, 63, 64  # (token 63 is bit 31 of its word: the sign bit)


class Digits:
    """A grammar that takes digits (tokens 10-19) and then EOS."""

    constraint = "digits"

    def __init__(self):
        self.taken: list[int] = []

    def allows(self, token_id):
        return 10 <= token_id < 20 or (token_id == EOS and bool(self.taken))

    def accept(self, token_id):
        if not self.allows(token_id):
            return False
        self.taken.append(token_id)
        return True

    @property
    def finished(self):
        return bool(self.taken) and self.taken[-1] == EOS

    error = None

    def fill_mask(self, bitmask, row):
        bitmask[row].zero_()
        for token_id in range(VOCAB):
            if self.allows(token_id):  # (all below 31: no sign bit)
                bitmask[row, token_id // 32] |= 1 << (token_id % 32)

    def grammar_for_mask(self):
        return self

    def adjust_mask(self, bitmask, row):
        pass


def mask_of(matcher) -> set[int]:
    bitmask = torch_bitmask(1, VOCAB)
    fill_masks([matcher], bitmask)
    return set(allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist())


def gated(end=(END_A,), opened=True, budget=None, inner=True):
    return GatedMatcher(Digits() if inner else None, ReasoningGate(tuple(end), opened, START, budget),
                        frozenset({EOS}))


def test_the_reasoning_runs_free_but_for_eos_and_the_answer_is_constrained():
    matcher = gated()
    assert mask_of(matcher) == set(range(VOCAB)) - {EOS}
    for token_id in (30, 5, 17, END_B):
        assert matcher.allows(token_id) and matcher.accept(token_id)
    assert not matcher.allows(EOS) and not matcher.accept(EOS)
    assert matcher.accept(END_A) and matcher.answering
    assert mask_of(matcher) == set(range(10, 20))  # the inner grammar's, from its first token
    assert not matcher.accept(30)
    assert matcher.accept(12) and matcher.accept(EOS) and matcher.finished
    assert matcher.inner.taken == [12, EOS]


def test_a_spent_budget_forces_the_end_markers_tokens_in_order():
    matcher = gated(end=(END_A, END_B), budget=3)
    for token_id in (30, END_A, 31):  # (a marker's first token alone does not end it)
        assert matcher.accept(token_id)
    assert mask_of(matcher) == {END_A} and not matcher.allows(12)
    assert matcher.accept(END_A)
    assert mask_of(matcher) == {END_B} and not matcher.accept(END_A)
    assert matcher.accept(END_B) and matcher.answering and mask_of(matcher) == set(range(10, 20))


def test_a_budget_of_zero_closes_an_opened_reasoning_at_once():
    matcher = gated(budget=0)
    assert mask_of(matcher) == {END_A}
    assert matcher.accept(END_A) and matcher.answering


@pytest.mark.parametrize("first, reasons", [(START, True), (15, False)])
def test_when_the_model_decides_its_first_token_may_open_the_reasoning(first, reasons):
    matcher = gated(opened=False)
    assert mask_of(matcher) == set(range(10, 20)) | {START}
    assert matcher.accept(first)
    assert matcher.answering is not reasons
    assert matcher.inner.taken == ([] if reasons else [first])


def test_no_room_to_reason_applies_the_constraint_from_the_first_token():
    assert mask_of(gated(opened=False, budget=0)) == set(range(10, 20))


def test_a_budget_without_a_constraint_leaves_the_answer_free():
    matcher = gated(budget=1, inner=False)
    assert matcher.accept(30) and mask_of(matcher) == {END_A}
    assert matcher.accept(END_A) and mask_of(matcher) == set(range(VOCAB))
    assert matcher.accept(EOS) and not matcher.finished  # (EOS ends it as any request's does)


def test_gated_and_ungated_rows_never_share_a_mask():
    assert gated().constraint != Digits.constraint
    assert gated().constraint == gated().constraint != gated(budget=2).constraint
