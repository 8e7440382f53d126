"""`gristmill batch --runner ray` against the test's Ray cluster: the same output as the
local runner on the same input (greedy), bad rows included. The Ray runner runs as a
process of its own (a Ray client of the cluster, as a user's job is); the local runner
and the refusals run in this process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray

from tests.batch.inprocess import batch_main
from tests.on_ray.conftest import TINY_MAX_MODEL_LEN

pytestmark = pytest.mark.timeout(240)


def batch_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gristmill.cli", "batch", *map(str, args)], capture_output=True,
                          text=True, timeout=200)


def test_runner_ray_writes_what_the_local_runner_writes(tmp_path, tiny_model):
    # The tiny model: the two runners' outputs are compared, whatever the model.
    rows = [{"prompt": f"Story {i}: once upon a time", "sampling_params": {"max_tokens": 6}} for i in range(8)]
    rows[2:2] = [{"prompt": 42}, {"messages": [{"role": "user", "content": "Hi BADROW"}]},
                 {"prompt": "word " * 300}, {"messages": [{"role": "user", "content": "Name a colour."}]}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ["--temperature", "0", "--max-tokens", "8", "--max-model-len", TINY_MAX_MODEL_LEN, "--batch-size", "4",
              "--model", tiny_model]
    local = batch_main(source, "-o", tmp_path / "local.jsonl", *common)
    assert local.returncode == 0, local.stderr
    on_ray = batch_cli(source, "-o", tmp_path / "ray.jsonl", *common, "--runner", "ray",
                       "--address", ray.get_runtime_context().gcs_address)
    assert on_ray.returncode == 0, on_ray.stderr
    assert "9 rows ok, 3 rows with errors" in on_ray.stderr

    def records(name):
        lines = (tmp_path / name).read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "time_taken_llm"} for line in lines]

    written = records("ray.jsonl")
    assert written == records("local.jsonl")
    assert [r["__row_id__"] for r in written] == list(range(12))  # in input order, each row once
    errors = [r["__inference_error__"].split(":")[0] for r in written]
    assert errors[2:6] == ["RequestError", "GenerationError", "PromptTooLongError", ""]


def test_an_address_nothing_answers_at_fails_in_seconds(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    result = batch_cli(source, "-o", tmp_path / "out.jsonl", "--runner", "ray", "--address", "127.0.0.1:9")
    assert result.returncode == 1
    assert "error: EngineDeadError: no Ray cluster answers at 127.0.0.1:9 (ConnectionRefusedError" in result.stderr
    assert "0 rows written" in result.stderr


def test_an_address_without_runner_ray_is_refused(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    result = batch_main(source, "-o", tmp_path / "out.jsonl", "--address", "127.0.0.1:9")
    assert result.returncode != 0 and "--address names a Ray cluster, which only --runner ray uses" in result.stderr
