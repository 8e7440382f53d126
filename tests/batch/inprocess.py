"""The command line run in this process: `gristmill.cli.main(argv)` with the exit status,
stdout and stderr a user's shell would see, without a new interpreter (a `gristmill`
subprocess imports the client and its tokenizer anew, seconds on a busy 2-core machine).

What a process would print is caught at the file descriptors (fd 1 and 2), so the output
of an engine core started by the command is caught too, in the order it was written. An
uncaught `SystemExit("error: ...")` is what Python prints and exits 1 with; any other
exception is no exit status at all: it propagates and fails the test.

The tiny random-weight model lives here too: one file for the whole run, so its one-off
conversion and int8 cache are made once and then shared (warm) by every engine started
on it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import io
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gristmill import faults, startup
from gristmill.cli import main


@dataclass
class Ran:
    """What `subprocess.run(..., capture_output=True, text=True)` would have given."""
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _environment(env: dict[str, str] | None):
    """os.environ set to `env` (None: as it is) for the call, and the faults re-read."""
    if env is None:
        yield
        return
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    faults.load()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)
        faults.load()


@contextlib.contextmanager
def _captured_fds():
    """fd 1 and fd 2 (and sys.stdout / sys.stderr over them) into two files; yields a
    function giving (stdout, stderr) once the block is done."""
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    texts: list[str] = []
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        sys.stdout = io.TextIOWrapper(os.fdopen(os.dup(1), "wb", buffering=0), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(2), "wb", buffering=0), encoding="utf-8", write_through=True)
        yield texts
    finally:
        for ours in (sys.stdout, sys.stderr):
            ours.flush()
            ours.close()
        sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for f in files:
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
            f.close()


@contextlib.contextmanager
def _startup_messages_restored():
    """`show_messages` (which every command calls) adds a handler on the stderr of the
    moment and asks engine cores for their messages, `serve` configures the root logger:
    all undone after the call."""
    logger, root = startup.logger, logging.getLogger()
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    root_handlers, root_level = list(root.handlers), root.level  # (`serve` calls logging.basicConfig)
    asked = os.environ.get("GRISTMILL_STARTUP_MESSAGES")
    try:
        yield
    finally:
        for handler in logger.handlers:
            if handler not in handlers:
                logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        for handler in root.handlers:
            if handler not in root_handlers:
                root.removeHandler(handler)
        root.setLevel(root_level)
        if asked is None:
            os.environ.pop("GRISTMILL_STARTUP_MESSAGES", None)
        else:
            os.environ["GRISTMILL_STARTUP_MESSAGES"] = asked


def run_main(*args, env: dict[str, str] | None = None) -> Ran:
    """`gristmill ARGS...` in this process; `env`: the whole environment for the call."""
    argv = [str(arg) for arg in args]
    with _environment(env), _startup_messages_restored(), _captured_fds() as texts:
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)  # as the interpreter does with SystemExit("...")
            code = 1
    gc.collect()  # an LLM the command made is let go of (its engine core stopped) now, not later
    stdout, stderr = texts
    return Ran(code, stdout, stderr)


def batch_main(*args, env: dict[str, str] | None = None) -> Ran:
    """`gristmill batch ARGS...` in this process."""
    return run_main("batch", *args, env=env)


def without_faults() -> dict[str, str]:
    """This process's environment without GRISTMILL_FAULTS."""
    return {k: v for k, v in os.environ.items() if k != "GRISTMILL_FAULTS"}


_TINY: Path | None = None


def tiny_model() -> Path:
    """The tiny random-weight llama GGUF (byte-level vocabulary, context 256), written
    once per test run and shared, so that its conversion is cached once for all."""
    global _TINY
    if _TINY is None:
        from tests.model.test_loader import write_tiny_gguf

        root = Path(tempfile.mkdtemp(prefix="gristmill-tiny-"))
        atexit.register(shutil.rmtree, root, True)
        _TINY = write_tiny_gguf(root / "tiny.gguf", "llama", "gpt2")
    return _TINY
