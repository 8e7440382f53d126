"""The step limits (max_num_seqs, max_num_batched_tokens) an engine runs with when the
config leaves them unset: its device's (EngineConfig.for_device)."""

from __future__ import annotations

import pytest

from gristmill import EngineConfig, RequestError
from gristmill.config import STEP_LIMITS


def _limits(config: EngineConfig) -> tuple[int, int]:
    return config.max_num_seqs, config.max_num_batched_tokens


def test_unset_limits_are_the_devices():
    assert _limits(EngineConfig()) == (None, None)
    assert _limits(EngineConfig().for_device("cpu")) == (128, 2048)
    assert _limits(EngineConfig().for_device("cuda")) == (256, 8192)
    assert STEP_LIMITS == {"cpu": (128, 2048), "cuda": (256, 8192)}


@pytest.mark.parametrize("given, device, expected", [
    (dict(max_num_seqs=512), "cpu", (512, 2048)),
    (dict(max_num_seqs=4096), "cpu", (4096, 4096)),      # the budget grows to decode every row
    (dict(max_num_seqs=8), "cuda", (8, 8192)),
    (dict(max_num_batched_tokens=64), "cuda", (64, 64)),  # the rows shrink to fit the budget
    (dict(max_num_batched_tokens=4096), "cpu", (128, 4096)),
    (dict(max_num_seqs=8, max_num_batched_tokens=16), "cuda", (8, 16)),  # both given: kept
])
def test_a_given_limit_is_kept_and_the_other_fits_it(given, device, expected):
    config = EngineConfig(**given)
    resolved = config.for_device(device)
    assert _limits(resolved) == expected
    assert resolved.max_num_batched_tokens >= resolved.max_num_seqs
    assert _limits(config) == (given.get("max_num_seqs"), given.get("max_num_batched_tokens"))  # not changed


def test_limits_given_together_are_still_checked():
    with pytest.raises(RequestError, match="max_num_batched_tokens.*>= max_num_seqs") as caught:
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    assert caught.value.param == "max_num_batched_tokens"
    with pytest.raises(RequestError, match="positive integer or None"):
        EngineConfig(max_num_seqs=0)


def test_an_engine_reports_the_limits_it_runs_with(default_llm):
    """`LLM.config` is the config as the core runs it: on CPU the CPU's limits, which its
    scheduler uses."""
    assert _limits(default_llm.config) == STEP_LIMITS["cpu"]
    scheduler = default_llm.core.scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == STEP_LIMITS["cpu"]
    assert (default_llm.capacity.max_num_seqs, default_llm.capacity.max_num_batched_tokens) == STEP_LIMITS["cpu"]
