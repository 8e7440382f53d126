"""The batch faces where users hit trouble: each test does what a user does, with real
parts (the real CLI, run in this process, real engines, a real `gristmill serve` on
loopback), and asserts what the user should see."""

from __future__ import annotations

import json
import os
import time

import pytest

from gristmill import EngineDeadError, faults
from gristmill.batch import (ERROR_COLUMN, DeploymentProcessorConfig, EngineProcessorConfig, HttpProcessorConfig,
                             build_processor, deploy)
from tests.batch.conftest import FAULTS, rows_of, tiny_engine
from tests.batch.inprocess import batch_main as batch_cli  # (in this process: what the job writes is the point)
from tests.server.conftest import Server

# Engine deaths and restarts, no text checked: the tiny random-weight model.
ENGINE = tiny_engine()


# -- --resume that is refused must leave the output as it was -----------------------------

def test_a_refused_resume_does_not_cut_lines_off_the_output(tmp_path):
    """docs/batch.md: "A --resume that the output does not match (other columns, other
    ids) is refused and leaves the output as it was." A user who points -o (with --resume)
    at a file of their own by mistake gets the refusal, but the file has already been
    truncated: a JSONL without a final newline loses its last line, and a CSV with an odd
    line with one quote (an inch mark) loses every line from there on."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    notes = tmp_path / "notes.jsonl"
    notes_text = '{"note": "keep me"}\n{"note": "the last line, no newline at the end"}'
    notes.write_text(notes_text)
    table = tmp_path / "table.csv"
    table_text = 'item,note\nruler,12" long\npen,blue\n'  # an inch mark: one quote on a line
    table.write_text(table_text)
    kept_errors = tmp_path / "errors.jsonl"
    kept_errors.write_text('{"prompt": "an earlier failure"}\n')
    changed = {}
    for output, before in ((notes, notes_text), (table, table_text)):
        result = batch_cli(source, "-o", output, "--resume", "--errors", kept_errors, "--device", "cpu")
        assert result.returncode != 0 and "--resume" in result.stderr, result.stderr
        if output.read_text() != before:
            changed[output.name] = output.read_text()
    assert changed == {}, f"a refused --resume cut these files to: {changed}"
    assert kept_errors.read_text() == '{"prompt": "an earlier failure"}\n'  # nor emptied the errors file


# -- an engine that dies on every step is fatal past the restart budget ---------------------

@pytest.fixture
def every_step_fails():
    """GRISTMILL_FAULTS=forward: every engine step raises, whatever it runs (a broken
    engine, not a poison row). The package's marked-row faults come back afterwards."""
    os.environ["GRISTMILL_FAULTS"] = "forward"
    faults.load()
    yield
    os.environ["GRISTMILL_FAULTS"] = FAULTS
    faults.load()


def test_an_engine_that_dies_on_every_step_fails_the_job_past_max_engine_restarts(every_step_fails):
    """docs/batch.md: "Past max_engine_restarts, the job fails with EngineDeadError."
    With an engine that cannot run any step, max_engine_restarts=1 and 2 rows in flight,
    the engine is restarted 3 times (deaths while "isolating a poison row" are not
    charged), and every row comes back as an error row "killed the engine each time it
    ran": the fatal error is swallowed and the job succeeds. With N rows in flight it is
    2N - 1 restarts (511 for the CLI's 4 batches of 64: over half an hour on CPU)."""
    config = EngineProcessorConfig(engine=ENGINE, batch_size=2, max_engine_restarts=1,
                                   should_continue_on_error=True)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="max_engine_restarts=1"):
        out = build_processor(config)(rows_of(2))
        pytest.fail(f"the job succeeded with rows {[row[ERROR_COLUMN][:80] for row in out]} after "
                    f"{time.monotonic() - started:.0f} s")


# -- a recovery must not break on a row whose waiter went away --------------------------------

def test_a_deployment_still_serves_after_a_job_stopped_at_a_poison_row():
    """A shared deployment (max_engine_restarts=3) and a job without
    should_continue_on_error whose first row is a poison row (it kills the engine each
    time it runs). The job stops at that row, as documented, which cancels the rows of its
    batch still waiting for the recovery. The recovery then sets the result of a cancelled
    row's future (engines.py `_Replica._retry` has no `future.done()` check), gets
    InvalidStateError, and marks the whole deployment dead ("restarting the engine failed:
    InvalidStateError"), although its engine restarted fine: every later processor on the
    deployment fails at once."""
    with deploy(ENGINE, name="review-poison", max_engine_restarts=3) as deployment:
        config = DeploymentProcessorConfig(deployment_name=deployment.name, batch_size=4)
        rows = [{"id": 0, "prompt": "POISON: once upon a time", "sampling_params": {"max_tokens": 6}}] + rows_of(3, 1)
        with pytest.raises(EngineDeadError, match="killed the engine each time it ran"):
            build_processor(config)(rows)
        later = build_processor(DeploymentProcessorConfig(deployment_name=deployment.name))(rows_of(2))
        assert [row[ERROR_COLUMN] for row in later] == ["", ""]


# -- a column flag that names no column of the input --------------------------------------------

def test_a_prompt_column_the_input_does_not_have_is_refused_before_the_model_loads(tmp_path):
    """docs/batch.md: bad input "stops the job before the model loads, naming" what to
    change (as a missing --id-column value does). A typo in --prompt-column (or an input
    with no prompt / messages column at all) instead loads the model, writes every row
    as an error row and exits 0: a whole job's output of error rows."""
    source = tmp_path / "questions.csv"
    source.write_text("question\nWhat is 2+2?\nName a color.\n")
    for flags in (["--prompt-column", "questoin"], []):
        target = tmp_path / "answers.jsonl"
        result = batch_cli(source, "-o", target, "--max-tokens", "2", "--device", "cpu", *flags)
        assert result.returncode != 0, (flags, target.read_text()[:300] if target.exists() else result.stderr)
        assert "question" in result.stderr, result.stderr  # names the columns the input has
        assert "engine ready" not in result.stderr and not target.exists(), result.stderr


# -- HTTP endpoints that refuse the processor ---------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server():
    """`gristmill serve --api-key secret`, as a user runs it."""
    server = Server("--api-key", "secret", "--max-model-len", "512")
    yield server
    server.stop()


def test_a_server_that_refuses_the_api_key_fails_the_job(keyed_server):
    """A wrong (or missing) API key is a bad configuration: every request gets 401. The
    job should fail with a clear message; instead each row becomes an error row "HTTP
    401" (and each row asks GET /models again), the job returns normally, and the CLI
    exits 0. The same happens for a URL with a wrong path (a 404 on /models)."""
    for url, says in ((f"{keyed_server.url}/v1", "HTTP 401.*api_key"), (keyed_server.url, "HTTP 404.*API's base")):
        config = HttpProcessorConfig(url=url, api_key="wrong", should_continue_on_error=True)
        with pytest.raises(EngineDeadError, match=says):
            out = build_processor(config)(rows_of(3))
            pytest.fail(f"the job succeeded with rows {[row[ERROR_COLUMN][:80] for row in out]}")


def test_the_cli_can_send_rows_to_a_server_that_needs_an_api_key(keyed_server, tmp_path):
    """`gristmill serve --api-key KEY` is documented, and `gristmill batch --deployment-url`
    sends rows to "any OpenAI-compatible server" (OpenAI's own needs a key), but the
    command has no way to pass a key (HttpProcessorConfig.api_key is not a flag, nor read
    from OPENAI_API_KEY)."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows_of(2)))
    target = tmp_path / "out.jsonl"
    result = batch_cli(source, "-o", target, "--deployment-url", keyed_server.url, "--api-key", "secret")
    assert result.returncode == 0, result.stderr[-500:]
    assert [json.loads(line)[ERROR_COLUMN] for line in target.read_text().splitlines()] == ["", ""]


def test_request_timeout_s_is_the_longest_wait_for_a_row(keyed_server):
    """HttpProcessorConfig.request_timeout_s: "Longest wait for one response; past it the
    row is an error row." A timed-out request is retried max_retries (default 5) more
    times, each from scratch (http.py `_send` retries every httpx.TransportError,
    timeouts included): a row ends after about 6 x request_timeout_s plus backoff, with
    the CLI's defaults (120 s, 5 retries) more than 12 minutes for one slow row."""
    config = HttpProcessorConfig(url=f"{keyed_server.url}/v1", api_key="secret", model=None, request_timeout_s=0.5,
                                 should_continue_on_error=True, batch_size=1)
    row = {"id": 0, "prompt": "Tell me a long story.", "sampling_params": {"max_tokens": 400, "ignore_eos": True}}
    started = time.monotonic()
    [out] = build_processor(config)([row])
    took = time.monotonic() - started
    assert out[ERROR_COLUMN].startswith("RequestTimeoutError"), out[ERROR_COLUMN]
    assert took < 2.5, f"a row with request_timeout_s=0.5 took {took:.1f} s to end"
