"""RestartBudget, the restart policy the server and the batch runtime share: N restarts
within a window of time, or within its whole life."""

from __future__ import annotations

import time

import pytest

from gristmill.engine.restarts import RestartBudget


def test_a_windowed_budget_refills_as_old_restarts_leave_the_window():
    budget = RestartBudget(2, window_s=0.3)
    assert budget.take() and budget.take()
    assert not budget.available() and not budget.take()  # refused: nothing spent
    assert budget.used == 2
    time.sleep(0.35)
    assert budget.available() and budget.take() and budget.used == 3
    assert budget.describe() == "2 restarts within 0.3 s"


def test_a_budget_without_a_window_never_refills():
    budget = RestartBudget(1)
    assert budget.take() and not budget.take()
    time.sleep(0.05)
    assert not budget.available() and budget.used == 1
    assert RestartBudget(0).take() is False
    assert budget.describe() == "1 restart"


@pytest.mark.parametrize("args", [(-1,), (1.5,), (1, 0), (1, -3.0)])
def test_invalid_budgets_say_what_is_wrong(args):
    with pytest.raises(ValueError, match="max_restarts|window_s"):
        RestartBudget(*args)
