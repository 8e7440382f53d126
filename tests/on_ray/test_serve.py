"""One shared engine as a Ray Serve deployment, reached from processors through its handle."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from ray import serve

from gristmill.batch import ERROR_COLUMN, DeploymentProcessorConfig, build_processor
from gristmill.errors import EngineDeadError, RequestError, is_fatal, root_cause
from gristmill.ray import deploy
from tests.harness import process_gone
from tests.on_ray.conftest import ENGINE, GREEDY, by_key, story_rows, tiny_engine

pytestmark = pytest.mark.timeout(180)

APP = "shared-app"
GREEDY_CHAT = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def shared():
    handle = deploy(ENGINE, name="shared", app_name=APP)
    yield handle
    serve.delete(APP)


def _config(**kwargs) -> DeploymentProcessorConfig:
    return DeploymentProcessorConfig(deployment_name="shared", app_name=APP, id_column="key", **kwargs)


def test_deployment_stage_rows_and_errors_cross_rpc_typed(shared):
    rows = story_rows(6) + [
        {"key": 6, "messages": [{"role": "user", "content": "Hi BADROW"}], "sampling_params": dict(GREEDY)},
        {"key": 7, "messages": [{"role": "user", "content": "word " * 600}], "sampling_params": dict(GREEDY)},
        {"key": 8, "messages": [{"role": "robot", "content": "beep"}], "sampling_params": dict(GREEDY)},
        # Structured output and penalties cross to the replica as request fields.
        {"key": 9, "prompt": "Is the sky blue? Answer:",
         "sampling_params": {"max_tokens": 6, "temperature": 0, "structured_output": {"choice": ["yes", "no"]}}},
        {"key": 10, "prompt": "The capital of France is",
         "sampling_params": {**GREEDY, "max_tokens": 20, "bad_words": ["capital"], "presence_penalty": 0.5}},
        {"key": 11, "prompt": "x", "sampling_params": {**GREEDY, "structured_output": {"regex": "[0-9"}}},
    ]
    for row in rows:
        row.setdefault("messages", None)
    processor = build_processor(_config(should_continue_on_error=True, batch_size=4))
    on_ray = by_key(processor(ray.data.from_items(rows)).take_all())
    here = by_key(processor(rows))  # the same deployment, from this process's handle
    assert sorted(on_ray) == sorted(here) == list(range(12))
    expected = {6: "GenerationError: setting up the detokenizer failed: injected fault at 'detokenize_init'",
                7: "PromptTooLongError: prompt (",
                8: "RequestError: invalid request: messages.0.role: Input should be 'system', 'user', 'assistant'",
                11: "RequestError: structured_output.regex is not valid"}
    for out in (on_ray, here):
        for key, start in expected.items():
            assert out[key][ERROR_COLUMN].startswith(start), out[key][ERROR_COLUMN]
            assert "Traceback" not in out[key][ERROR_COLUMN] and "ray::" not in out[key][ERROR_COLUMN]
        for key in range(6):
            assert out[key][ERROR_COLUMN] == "" and out[key]["num_generated_tokens"] == 6
            assert out[key]["generated_text"] == here[key]["generated_text"] != ""
        assert out[9]["generated_text"] in ("yes", "no") and out[9]["finish_reason"] == "stop", (out[9][ERROR_COLUMN], out[9]["finish_reason"], out[9]["num_generated_tokens"])
        assert "capital" not in out[10]["generated_text"] and out[10]["num_generated_tokens"] == 20


def test_a_row_error_without_continue_on_error_is_raised_as_the_replicas_own_error(shared):
    rows = story_rows(2) + [{"key": 2, "prompt": "word " * 600, "sampling_params": dict(GREEDY)}]
    with pytest.raises(RequestError) as caught:
        build_processor(_config())(rows)
    assert type(caught.value).__name__ == "PromptTooLongError" and not is_fatal(caught.value)
    assert caught.value.message.startswith("row 2: prompt (") and "Traceback" not in caught.value.message


def test_two_processors_in_sequence_share_one_replica_and_turn_two_sees_turn_one(shared):
    pids = shared.pids.remote().result()
    questions = ["Name a colour.", "Name an animal."]
    rows = [{"key": i, "question": q} for i, q in enumerate(questions)]
    params = {"max_tokens": 8, "temperature": 0}
    turn1 = build_processor(_config(method="chat", sampling_params=params),
                            preprocess=lambda r: {"key": r["key"], "question": r["question"],
                                                  "messages": [{"role": "user", "content": r["question"]}]},
                            postprocess=lambda r: {"key": r["key"], "question": r["question"],
                                                   "answer1": r["generated_text"]})
    turn2 = build_processor(_config(method="chat", sampling_params=params),
                            preprocess=lambda r: {**r, "messages": [
                                {"role": "user", "content": r["question"]},
                                {"role": "assistant", "content": r["answer1"]},
                                {"role": "user", "content": "Repeat your answer in capitals."}]},
                            postprocess=lambda r: {**r, "answer2": r["generated_text"]})
    out = by_key(turn2(turn1(ray.data.from_items(rows))).take_all())
    for key in range(2):
        assert out[key][ERROR_COLUMN] == "" and out[key]["answer1"] and out[key]["answer2"]
        # turn 2's prompt held turn 1's answer: run the same chat directly and compare
        [direct] = build_processor(_config(method="chat", sampling_params=params))([{
            "key": key, "messages": [{"role": "user", "content": questions[key]},
                                     {"role": "assistant", "content": out[key]["answer1"]},
                                     {"role": "user", "content": "Repeat your answer in capitals."}]}])
        assert direct["generated_text"] == out[key]["answer2"]
    assert shared.pids.remote().result() == pids  # one replica, one engine, all along
    replicas = serve.status().applications[APP].deployments["shared"].replica_states
    assert replicas == {"RUNNING": 1}


def test_ray_data_llm_serve_processor_drives_the_deployment_with_bad_rows_per_row(shared):
    from ray.data.llm import ServeDeploymentProcessorConfig
    from ray.data.llm import build_processor as build_llm_processor

    from gristmill.server.protocol import CompletionRequest

    rows = [{"key": i, "text": f"Story {i}: once upon a time"} for i in range(4)] + [
        {"key": 4, "text": "Story BADROW"}, {"key": 5, "text": "word " * 600}]
    config = ServeDeploymentProcessorConfig(deployment_name="shared", app_name=APP, batch_size=3,
                                            dtype_mapping={"CompletionRequest": CompletionRequest},
                                            should_continue_on_error=True)
    processor = build_llm_processor(
        config,
        # half the rows as a pydantic request (dtype_mapping), half as a plain dict
        preprocess=lambda r: {"key": r["key"], "method": "completions",
                              "dtype": "CompletionRequest" if r["key"] % 2 else None,
                              "request_kwargs": {"prompt": r["text"], **GREEDY}},
        postprocess=lambda r: {"key": r["key"], "text": r["choices"][0]["text"],
                               "tokens": r["usage"]["completion_tokens"]})
    out = by_key(processor(ray.data.from_items(rows)).take_all())
    assert sorted(out) == list(range(6))
    ours = by_key(build_processor(_config())(story_rows(4)))
    for key in range(4):
        assert out[key]["__inference_error__"] == ""
        assert (out[key]["text"], out[key]["tokens"]) == (ours[key]["generated_text"], 6)
    # Ray keeps a row going only on ValueError-like causes: both errors are, and say what failed.
    assert "GenerationError" in out[4]["__inference_error__"]
    assert "setting up the detokenizer failed" in out[4]["__inference_error__"]
    assert "PromptTooLongError" in out[5]["__inference_error__"]
    assert "exceeds max_model_len (512)" in out[5]["__inference_error__"]


def test_a_deployment_refuses_what_it_cannot_honour_rather_than_doing_otherwise(shared):
    # (from test_ray_edges.py, on this module's deployment instead of one of its own)
    rows = [{"key": 0, "prompt": "Hello there"}, {"key": 1, "messages": [{"role": "user", "content": "Hi"}]}]
    config = DeploymentProcessorConfig(deployment_name="shared", app_name=APP, generate=False,
                                       should_continue_on_error=True, id_column="key")
    out = by_key(build_processor(config)(rows))
    for row in out.values():
        assert row["tokenized_prompt"] == []
        assert row[ERROR_COLUMN].startswith("RequestError: generate=False needs a tokenizer beside the processor")
    # A chat with the template off is refused, as by an engine of the processor's own
    # (the replica used to apply the template all the same).
    config = DeploymentProcessorConfig(deployment_name="shared", app_name=APP, apply_chat_template=False,
                                       should_continue_on_error=True)
    chat, prompt = build_processor(config)([{"messages": [{"role": "user", "content": "Hi"}], "sampling_params":
                                             dict(GREEDY)}, {"prompt": "Hello there", "sampling_params": dict(GREEDY)}])
    assert chat[ERROR_COLUMN] == "RequestError: the row has 'messages' but apply_chat_template is off; send " \
                                 "'prompt' or turn it on"
    # Generating, the same deployment answers as usual.
    assert prompt[ERROR_COLUMN] == "" and prompt["num_generated_tokens"] == 6


def test_the_responses_api_on_the_deployment_answers_as_its_chat_and_names_its_own_fields(shared):
    handle = shared.options(stream=True)
    [response] = handle.response.remote({"input": "Name a colour.", "max_output_tokens": 6, **GREEDY_CHAT})
    [chat] = handle.chat.remote({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
                                 **GREEDY_CHAT})
    assert response["object"] == "response" and response["status"] == "incomplete"
    [message] = response["output"]
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"] != ""
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == \
        (chat["usage"]["prompt_tokens"], 6)
    with pytest.raises(RequestError) as raised:
        list(handle.response.remote({"input": "Hi", "max_output_tokens": 10**6}))
    error = root_cause(raised.value)
    assert error.param == "max_output_tokens" and "max_completion_tokens" not in error.message, error.message


def test_a_deployment_that_is_not_running_fails_the_job_at_once_saying_how_to_start_it():
    started = time.monotonic()
    config = DeploymentProcessorConfig(deployment_name="missing", app_name="missing", should_continue_on_error=True)
    with pytest.raises(EngineDeadError, match=r"deployment 'missing' of Serve app 'missing' is not running .*"
                                              r"gristmill.ray.deploy\(EngineConfig\(\.\.\.\), name='missing'"):
        build_processor(config)(story_rows(2))
    assert time.monotonic() - started < 30


def test_back_pressure_from_full_queues_is_retried_until_every_row_is_done(caplog, tiny_model):
    # One request at a time and one queued: of 6 rows sent at once, Serve refuses some.
    # The tiny model: the retries are the point, not the texts.
    deploy(tiny_engine(tiny_model), name="narrow", app_name="narrow-app", max_ongoing_requests=1, max_queued_requests=1)
    try:
        config = DeploymentProcessorConfig(deployment_name="narrow", app_name="narrow-app", id_column="key")
        with caplog.at_level("WARNING", logger="gristmill.ray.handle"):
            out = by_key(build_processor(config)(story_rows(6)))
    finally:
        serve.delete("narrow-app")
    assert sorted(out) == list(range(6))
    assert all(row[ERROR_COLUMN] == "" and row["num_generated_tokens"] == 6 for row in out.values())
    refused = [r.getMessage() for r in caplog.records if "its queues are full" in r.getMessage()]
    assert refused and "deployment 'narrow' of Serve app 'narrow-app' refused row" in refused[0]


def test_a_replica_that_cannot_fit_fails_at_once():
    with pytest.raises(RequestError, match=r"1 replica\(s\) x num_cpus=3 need 3 CPUs but the Ray cluster has 2"):
        deploy(ENGINE, name="too-big", app_name="too-big", ray_actor_options={"num_cpus": 3})


def test_a_replica_killed_mid_job_fails_the_job_fast_and_serve_replaces_it(shared):
    pids = shared.pids.remote().result()
    # The kill comes once every row is in the replica's engine (16 rows: two batches of 8,
    # all sent at once), and rows last seconds longer than a kill takes to land. Killed
    # any earlier, rows still waiting on the caller's side went to the new replica; killed
    # as short rows finished, the job could end cleanly under load.
    rows = [{**row, "sampling_params": {**GREEDY, "max_tokens": 160}} for row in story_rows(16)]
    dataset = build_processor(_config(should_continue_on_error=True, batch_size=8))(ray.data.from_items(rows))
    fired, stop = {}, threading.Event()

    def kill_once_it_runs_rows():
        # Not on a timer: on a slow machine the job may not have reached the replica yet.
        while not stop.wait(0.2):
            stats = shared.stats.remote().result(timeout_s=10)
            if stats["num_running"] + stats["num_waiting"] == len(rows) and stats["num_running"] > 0:
                fired["at"] = time.monotonic()
                os.kill(pids["replica"], signal.SIGKILL)
                return

    killer = threading.Thread(target=kill_once_it_runs_rows, daemon=True)
    killer.start()
    try:
        with pytest.raises(Exception) as caught:
            dataset.take_all()
        failed_at = time.monotonic()
    finally:
        stop.set()
        killer.join(timeout=15)
    assert "at" in fired, "the job ended before the replica ran any row"
    assert is_fatal(caught.value)  # never an error row: a dead replica is the job's failure
    cause = root_cause(caught.value)
    assert isinstance(cause, EngineDeadError) and "is gone: a replica died" in cause.message
    deadline = time.monotonic() + 10
    while not process_gone(pids["core"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(pids["core"])  # the replica's engine core went with it
    assert failed_at - fired["at"] < 10
    # Serve starts a new replica (a new engine); the next job runs on it.
    deadline = time.monotonic() + 90
    while True:
        try:
            new = shared.pids.remote().result(timeout_s=5)
            break
        except Exception:  # noqa: BLE001 - not up yet
            assert time.monotonic() < deadline, "Serve did not replace the killed replica"
            time.sleep(0.5)
    assert new["replica"] != pids["replica"]
    [row] = build_processor(_config())(story_rows(1))
    assert row[ERROR_COLUMN] == "" and row["num_generated_tokens"] == 6

