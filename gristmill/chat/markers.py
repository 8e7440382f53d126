"""Holding back text that may be the start of a marker (`</think>`, `<tool_call>`): a
stream decides nothing about characters that could still turn out to be a marker's first
characters, so a marker cut anywhere across deltas never leaks into a field."""

from __future__ import annotations


def undecided_tail(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of
    `markers` (0 when no marker can start in it): those characters wait for more text."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def may_become(text: str, marker: str) -> bool:
    """Whether more text could still make `text` begin with `marker` (true for "")."""
    return marker.startswith(text)
