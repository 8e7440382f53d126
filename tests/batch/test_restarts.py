"""Engine deaths in the middle of a job: restarts, failing fast, poison rows.

Every death here starts a new engine core (a process importing torch and loading the
model), and no text is checked: the engines run the tiny random-weight model."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gristmill import EngineDeadError
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, build_processor
from tests.batch.conftest import rows_of, tiny_engine
from tests.harness import core_children

ENGINE = tiny_engine()


@pytest.fixture
def before():
    """Engine cores already running (the package's shared deployment), which the
    tests here leave out."""
    return set(core_children())


def own_cores(before: set[int]) -> set[int]:
    return set(core_children()) - before


def killing_the_core_after(out, n: int, before: set[int]):
    """Take `n` rows from `out`, SIGKILL the engine core, then take the rest; returns
    (rows, kill time, end time, the error raised or None)."""
    rows = [next(out) for _ in range(n)]
    [pid] = own_cores(before)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        rows.extend(out)
        error = None
    except EngineDeadError as exc:
        error = exc
    return rows, killed_at, time.monotonic(), error


def test_with_a_restart_a_killed_engine_loses_no_row(before):
    rows = rows_of(24)
    config = EngineProcessorConfig(engine=ENGINE, batch_size=4, max_concurrent_batches=3, max_engine_restarts=1)
    out, _, _, error = killing_the_core_after(build_processor(config).stream(rows), 4, before)
    assert error is None
    assert [row["id"] for row in out] == list(range(24))
    assert all(row[ERROR_COLUMN] == "" and row["num_generated_tokens"] == 6 for row in out)
    assert own_cores(before) == set()


def test_without_restarts_a_killed_engine_fails_the_job_fast_naming_the_rows(before):
    config = EngineProcessorConfig(engine=ENGINE, batch_size=4, max_concurrent_batches=3,
                                   should_continue_on_error=True)
    _, killed_at, ended_at, error = killing_the_core_after(build_processor(config).stream(rows_of(40)), 4, before)
    assert isinstance(error, EngineDeadError)
    message = str(error)
    assert "max_engine_restarts=0" in message and "killed by signal SIGKILL" in message
    assert "rows in flight: [" in message
    assert ended_at - killed_at < 5.0
    assert own_cores(before) == set()


def test_a_poison_row_ends_as_the_only_error_row(before):
    rows = rows_of(10)
    rows[5] = {"id": 5, "prompt": "POISON: once upon a time", "sampling_params": {"max_tokens": 6}}
    config = EngineProcessorConfig(engine=ENGINE, batch_size=2, max_concurrent_batches=2, max_engine_restarts=1,
                                   should_continue_on_error=True)
    out = build_processor(config)(rows)
    assert [row["id"] for row in out] == list(range(10))
    errors = {row["id"]: row[ERROR_COLUMN] for row in out if row[ERROR_COLUMN]}
    assert list(errors) == [5]
    assert errors[5].startswith("EngineDeadError: row 5 killed the engine each time it ran")
    assert "exited with code 17" in errors[5]
    assert own_cores(before) == set()


def test_a_poison_row_without_restarts_stops_the_job(before):
    rows = rows_of(4) + [{"id": 4, "prompt": "POISON row", "sampling_params": {"max_tokens": 6}}]
    config = EngineProcessorConfig(engine=ENGINE, batch_size=8, should_continue_on_error=True)
    with pytest.raises(EngineDeadError, match="exited with code 17"):
        build_processor(config)(rows)
    assert own_cores(before) == set()


def test_two_poison_rows_in_flight_together_are_both_set_aside(before):
    """The two rows die in different halves of the first split: that death is charged to
    the budget (the rule that fails a broken engine fast), the rest of the isolation is
    not, so a budget of 2 (the first death, the split) sets both aside."""
    rows = rows_of(4)
    for i in (0, 2):
        rows[i] = {"id": i, "prompt": f"POISON {i}: once upon a time", "sampling_params": {"max_tokens": 6}}
    config = EngineProcessorConfig(engine=ENGINE, batch_size=4, max_engine_restarts=2,
                                   should_continue_on_error=True)
    out = build_processor(config)(rows)
    assert [row["id"] for row in out] == list(range(4))
    errors = {row["id"]: row[ERROR_COLUMN] for row in out if row[ERROR_COLUMN]}
    assert sorted(errors) == [0, 2]
    assert all("killed the engine each time it ran" in e for e in errors.values())
    assert all(row["num_generated_tokens"] == 6 for row in out if not row[ERROR_COLUMN])
    assert own_cores(before) == set()
