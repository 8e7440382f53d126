"""RestartBudget, the restart policy the server and the batch runtime share: N restarts
within a window of time, or within its whole life."""

from __future__ import annotations

import types

import pytest

from gristmill.engine import restarts
from gristmill.engine.restarts import RestartBudget


@pytest.fixture
def clock(monkeypatch):
    """The budget's clock (time.monotonic as restarts.py reads it), moved by the test
    instead of slept through: `clock.advance(seconds)`."""
    now = [1000.0]
    fake = types.SimpleNamespace(monotonic=lambda: now[0])
    fake.advance = lambda seconds: now.__setitem__(0, now[0] + seconds)
    monkeypatch.setattr(restarts, "time", fake)
    return fake


def test_a_windowed_budget_refills_as_old_restarts_leave_the_window(clock):
    budget = RestartBudget(2, window_s=0.3)
    assert budget.take() and budget.take()
    assert not budget.available() and not budget.take()  # refused: nothing spent
    assert budget.used == 2
    clock.advance(0.3)  # at the window's edge, both are still within it
    assert not budget.available()
    clock.advance(0.05)
    assert budget.available() and budget.take() and budget.used == 3
    assert budget.describe() == "2 restarts within 0.3 s"


def test_a_budget_without_a_window_never_refills(clock):
    budget = RestartBudget(1)
    assert budget.take() and not budget.take()
    clock.advance(10 ** 6)
    assert not budget.available() and budget.used == 1
    assert RestartBudget(0).take() is False
    assert budget.describe() == "1 restart"


@pytest.mark.parametrize("args", [(-1,), (1.5,), (1, 0), (1, -3.0)])
def test_invalid_budgets_say_what_is_wrong(args):
    with pytest.raises(ValueError, match="max_restarts|window_s"):
        RestartBudget(*args)
