"""Shared fixtures. `default_llm` is the real bundled Gemma 3 270M, loaded once per run."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_llm():
    from gristmill import LLM
    return LLM(device="cpu")
