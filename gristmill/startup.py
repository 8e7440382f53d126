"""What an engine's start is doing, said as it happens: converting a GGUF, quantizing,
compiling CPU kernels (each once, then cached: the message says where), loading.

The messages go to the `gristmill.startup` logger at INFO. The command line shows them
(`show_messages`); a library user sees them with `logging.basicConfig(level=logging.INFO)`.
The engine-core process shows them when its client does (GRISTMILL_STARTUP_MESSAGES).
Imports no torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger("gristmill.startup")

_ENV = "GRISTMILL_STARTUP_MESSAGES"


@contextlib.contextmanager
def phase(what: str, cached_in: Path | None = None):
    """Say that `what` starts (and where its result is cached, when it is done once),
    then how long it took."""
    once = f" (once; cached in {cached_in})" if cached_in is not None else ""
    logger.info("%s%s ...", what, once)
    start = time.monotonic()
    yield
    logger.info("%s: done in %.1f s", what, time.monotonic() - start)


def cached(what: str, where: Path) -> None:
    """`what` was done before: say where it is kept."""
    logger.info("%s: cached in %s", what, where)


def warn(what: str) -> None:
    """Something the start does that the user should know of (at WARNING: shown even
    where INFO messages are not)."""
    logger.warning("%s", what)


def show_messages() -> None:
    """Print start-up messages on stderr, in this process and in engine cores it starts."""
    os.environ[_ENV] = "1"
    _add_handler()


def show_messages_if_asked() -> None:
    """In an engine-core process: show them when the client does."""
    if os.environ.get(_ENV) == "1":
        _add_handler()


def _add_handler() -> None:
    if any(getattr(h, "_gristmill_startup", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gristmill: %(message)s"))
    handler._gristmill_startup = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler (gristmill serve's) would print them twice
