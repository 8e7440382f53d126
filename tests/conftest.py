"""Shared fixtures: the real bundled Gemma 3 270M, loaded once per run, as users get it
(`default_llm`: int8 weights on CPU) and on the exact float path (`float_llm`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_llm():
    from gristmill import LLM
    return LLM(device="cpu")


@pytest.fixture(scope="session")
def float_llm():
    from gristmill import LLM
    return LLM(device="cpu", quantization=None)
