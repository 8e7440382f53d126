"""Fault injection: make real failures happen inside a running engine, for tests.

Hooks sit in the client, the engine core and the model runner, so this module belongs to
none of them.

Off unless GRISTMILL_FAULTS is set; parsed once, and each hook is one falsy check when
off. Format: comma-separated `point[@trigger]`, triggers `prompt~TEXT` (requests whose
prompt contains TEXT), `step=N` (engine step N) or none (every time). Example:

    GRISTMILL_FAULTS="detokenize_init@prompt~BOOM,core_exit@step=40"
"""

from __future__ import annotations

import os
from dataclasses import dataclass

POINTS = ("tokenize", "detokenize_init", "detokenize", "output_batch", "forward", "device_error",
          "grammar", "core_exit", "core_hang", "load_killed")


class InjectedFault(RuntimeError):
    """The failure a fault point raises."""


@dataclass(frozen=True, slots=True)
class Fault:
    point: str
    prompt_contains: str | None = None
    step: int | None = None

    def matches(self, prompt: str | None, step: int | None) -> bool:
        if self.prompt_contains is not None:
            return prompt is not None and self.prompt_contains in prompt
        if self.step is not None:
            return step == self.step
        return True


def parse(spec: str | None) -> tuple[Fault, ...]:
    """Parse a GRISTMILL_FAULTS value; a malformed one raises ValueError saying why."""
    if not spec or not spec.strip():
        return ()
    faults = []
    for item in spec.split(","):
        item = item.strip()
        point, _, trigger = item.partition("@")
        if point not in POINTS:
            raise ValueError(f"GRISTMILL_FAULTS: unknown fault point {point!r} in {item!r}; "
                             f"points: {', '.join(POINTS)}")
        if not trigger:
            faults.append(Fault(point))
        elif trigger.startswith("prompt~") and len(trigger) > len("prompt~"):
            faults.append(Fault(point, prompt_contains=trigger[len("prompt~"):]))
        elif trigger.startswith("step=") and trigger[5:].isdigit():
            faults.append(Fault(point, step=int(trigger[5:])))
        else:
            raise ValueError(f"GRISTMILL_FAULTS: bad trigger {trigger!r} in {item!r}; use "
                             f"prompt~TEXT, step=N or no trigger")
    return tuple(faults)


ACTIVE: tuple[Fault, ...] = ()


def load() -> tuple[Fault, ...]:
    """(Re)read GRISTMILL_FAULTS; engines call this once when they start."""
    global ACTIVE
    ACTIVE = parse(os.environ.get("GRISTMILL_FAULTS"))
    return ACTIVE


def fires(point: str, prompt: str | None = None, step: int | None = None) -> bool:
    return bool(ACTIVE) and any(f.point == point and f.matches(prompt, step) for f in ACTIVE)


def check(point: str, prompt: str | None = None, step: int | None = None) -> None:
    """Raise InjectedFault when a fault is set for this point and trigger."""
    if ACTIVE and fires(point, prompt, step):
        raise InjectedFault(f"injected fault at {point!r} (GRISTMILL_FAULTS)")


try:
    load()
except ValueError:
    ACTIVE = ()  # reported when an engine starts and calls load()
