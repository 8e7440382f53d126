"""HttpProcessorConfig against a real `gristmill serve` on loopback."""

from __future__ import annotations

import time

import httpx
import pytest

from gristmill import EngineDeadError
from gristmill.batch import ERROR_COLUMN, HttpProcessorConfig, build_processor
from tests.batch.conftest import rows_of
from tests.server.conftest import Server, free_port


@pytest.fixture(scope="module")
def busy_server():
    """A server that admits one request at a time and answers 503 past one waiting."""
    server = Server("--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--max-waiting-requests", "1",
                    "--max-model-len", "256", "--served-model-name", "served")
    yield server
    server.stop()


def test_overloaded_server_is_retried_until_every_row_is_done(busy_server):
    config = HttpProcessorConfig(url=f"{busy_server.url}/v1", concurrency=8, max_retries=30, batch_size=8)
    out = build_processor(config)(rows_of(8))
    assert [row["id"] for row in out] == list(range(8))
    assert all(row[ERROR_COLUMN] == "" and row["num_generated_tokens"] == 6 for row in out)
    assert all(row["generated_text"] and row["num_input_tokens"] > 0 for row in out)
    metrics = httpx.get(f"{busy_server.url}/metrics").text
    [overloads] = [line for line in metrics.splitlines()
                   if line.startswith('gristmill_request_errors_total{error_type="EngineOverloadedError"}')]
    assert float(overloads.split()[-1]) > 0  # the server did turn rows away, and they were retried


def test_4xx_rows_are_error_rows_with_the_status_and_message(busy_server):
    rows = rows_of(2) + [
        {"id": "long", "prompt": "word " * 400},
        {"id": "chat", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
         "sampling_params": {"max_tokens": 4}},
    ]
    completions = build_processor(HttpProcessorConfig(url=f"{busy_server.url}/v1", should_continue_on_error=True,
                                                      max_retries=30, model="served"))
    out = completions(rows[:3])
    assert [row[ERROR_COLUMN] for row in out[:2]] == ["", ""]
    assert out[2][ERROR_COLUMN].startswith(f"RequestError: HTTP 400 from {busy_server.url}/v1/completions: ")
    assert "max_model_len (256)" in out[2][ERROR_COLUMN]
    chat = build_processor(HttpProcessorConfig(url=f"{busy_server.url}/v1", method="chat", max_retries=30,
                                               should_continue_on_error=True))
    [row] = chat(rows[3:])
    assert row[ERROR_COLUMN].startswith("RequestError: HTTP 400 from ")
    assert "roles must alternate" in row[ERROR_COLUMN]


def test_an_unreachable_server_stops_the_job_after_its_retries():
    config = HttpProcessorConfig(url=f"http://127.0.0.1:{free_port()}/v1", model="m", max_retries=2,
                                 should_continue_on_error=True)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="is unreachable after 3 tries"):
        build_processor(config)(rows_of(3))
    assert time.monotonic() - started < 30


def test_a_request_past_request_timeout_s_is_an_error_row(busy_server):
    rows = [{"id": i, "prompt": "Tell me a long story.", "sampling_params": {"max_tokens": 200, "ignore_eos": True}}
            for i in range(2)]
    config = HttpProcessorConfig(url=f"{busy_server.url}/v1", model="served", request_timeout_s=0.3, max_retries=0,
                                 should_continue_on_error=True)
    out = build_processor(config)(rows)
    assert [row["id"] for row in out] == [0, 1]
    for row in out:
        assert row[ERROR_COLUMN].startswith("RequestTimeoutError: POST ")
        assert "no response within request_timeout_s=0.3s" in row[ERROR_COLUMN]


def test_qps_paces_the_requests(busy_server):
    config = HttpProcessorConfig(url=f"{busy_server.url}/v1", model="served", qps=4, max_retries=30)
    rows = [{**row, "sampling_params": {"max_tokens": 1}} for row in rows_of(5)]
    started = time.monotonic()
    out = build_processor(config)(rows)
    assert all(row[ERROR_COLUMN] == "" for row in out)
    assert time.monotonic() - started >= 4 / 4  # five starts at 4 per second span at least a second


def test_constrained_and_penalized_rows_reach_the_server_with_every_field(busy_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    rows = [{"id": "json", "prompt": "Answer in JSON:", "sampling_params": {"structured_output": {"json": schema}}},
            {"id": "choice", "prompt": "Is it day? Answer:",
             "sampling_params": {"structured_output": {"choice": ["yes", "no"]}}},
            {"id": "bad", "prompt": "x", "sampling_params": {"structured_output": {"regex": "[0-9"}}},
            # Greedy, this prompt's free text says "capital" again and again.
            {"id": "banned", "prompt": "The capital of France is",
             "sampling_params": {"bad_words": ["capital"], "repetition_penalty": 1.1, "min_tokens": 20}}]
    config = HttpProcessorConfig(url=f"{busy_server.url}/v1", model="served", max_retries=30,
                                 should_continue_on_error=True, sampling_params={"max_tokens": 30, "temperature": 0})
    out = {row["id"]: row for row in build_processor(config)(rows)}
    assert list(__import__("json").loads(out["json"]["generated_text"])) == ["answer"]
    assert out["choice"]["generated_text"] in ("yes", "no") and out["choice"]["finish_reason"] == "stop"
    assert out["bad"][ERROR_COLUMN].startswith("RequestError: structured_output.regex is not valid")
    assert "capital" not in out["banned"]["generated_text"] and out["banned"]["num_generated_tokens"] >= 20


def test_what_a_server_cannot_honour_is_refused_per_row_not_ignored(busy_server):
    """A server applies its own chat template and tokenizes inside: a processor that only
    tokenizes (generate=False) would get no token ids, and messages with the template off
    would be templated all the same. Each row says so (RequestError), as with an engine of
    the processor's own; a prompt row beside them still generates."""
    url = f"{busy_server.url}/v1"
    chat = [{"id": "chat", "messages": [{"role": "user", "content": "Hi"}]}]
    [tokenize_only] = build_processor(HttpProcessorConfig(url=url, generate=False, should_continue_on_error=True))(
        [{"id": "p", "prompt": "Hello"}])
    assert tokenize_only[ERROR_COLUMN].startswith("RequestError: generate=False needs a tokenizer beside the "
                                                  "processor")
    assert tokenize_only["tokenized_prompt"] == []
    template_off = build_processor(HttpProcessorConfig(url=url, apply_chat_template=False, max_retries=30,
                                                       should_continue_on_error=True))
    refused, ok = template_off(chat + [{"id": "p", "prompt": "Hello", "sampling_params": {"max_tokens": 2}}])
    assert refused[ERROR_COLUMN] == ("RequestError: the row has 'messages' but apply_chat_template is off; "
                                     "send 'prompt' or turn it on")
    assert ok[ERROR_COLUMN] == "" and ok["num_generated_tokens"] == 2
