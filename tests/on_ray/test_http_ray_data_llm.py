"""Ray Data LLM's HttpRequestProcessorConfig, and our HttpProcessorConfig on a Dataset,
against a real `gristmill serve` on loopback."""

from __future__ import annotations

import httpx
import pytest
import ray

from gristmill.batch import ERROR_COLUMN, HttpProcessorConfig, build_processor
from tests.on_ray.conftest import FAULTS, GREEDY, by_key, story_rows
from tests.server.conftest import Server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def busy_server():
    """One request running at a time and one waiting: the rest are turned away with 503
    (retried: 503 is in Ray's retried statuses, and our HttpEngine retries it)."""
    server = Server("--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-model-len", "512",
                    faults=FAULTS)
    yield server
    server.stop()


def test_ray_data_llm_http_processor_gets_answers_and_error_envelopes(busy_server):
    from ray.data.llm import HttpRequestProcessorConfig
    from ray.data.llm import build_processor as build_llm_processor

    rows = [{"key": i, "text": f"Story {i}: once upon a time"} for i in range(6)] + [
        {"key": 6, "text": "Story BADROW"}, {"key": 7, "text": "word " * 600}]
    config = HttpRequestProcessorConfig(url=f"{busy_server.url}/v1/completions", batch_size=8, max_retries=10,
                                        base_retry_wait_time_in_s=0.1)
    processor = build_llm_processor(
        config, preprocess=lambda r: {"key": r["key"], "payload": {"prompt": r["text"], **GREEDY}},
        postprocess=lambda r: {"key": r["key"], "response": r["http_response"]})
    out = by_key(processor(ray.data.from_items(rows)).take_all())
    assert sorted(out) == list(range(8))
    for key in range(6):
        assert out[key]["response"]["choices"][0]["text"] and out[key]["response"]["usage"]["completion_tokens"] == 6
    # Ray hides the status: the body is the OpenAI error envelope, with the type and message.
    assert out[6]["response"]["error"]["type"] == "internal_error"
    assert "setting up the detokenizer failed" in out[6]["response"]["error"]["message"]
    assert out[7]["response"]["error"]["type"] == "invalid_request_error"
    assert "exceeds max_model_len (512)" in out[7]["response"]["error"]["message"]



def test_our_http_processor_on_a_dataset(busy_server):
    rows = story_rows(4) + [{"key": 4, "prompt": "word " * 600, "sampling_params": dict(GREEDY)}]
    config = HttpProcessorConfig(url=f"{busy_server.url}/v1", should_continue_on_error=True, max_retries=30,
                                 id_column="key")
    out = by_key(build_processor(config)(ray.data.from_items(rows)).take_all())
    assert sorted(out) == list(range(5))
    assert all(out[key][ERROR_COLUMN] == "" and out[key]["num_generated_tokens"] == 6 for key in range(4))
    assert out[4][ERROR_COLUMN].startswith(f"RequestError: HTTP 400 from {busy_server.url}/v1/completions: ")
    assert "exceeds max_model_len (512)" in out[4][ERROR_COLUMN]
    metrics = httpx.get(f"{busy_server.url}/metrics").text
    [overloads] = [line for line in metrics.splitlines()
                   if line.startswith('gristmill_request_errors_total{error_type="EngineOverloadedError"}')]
    assert float(overloads.split()[-1]) > 0  # 5 rows at once against room for 2: the 503s were retried
