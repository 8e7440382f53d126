"""Processors applied to a Ray Dataset: the engine stage as actors that own engines."""

from __future__ import annotations

import time

import pytest
import ray

from gristmill import EngineConfig
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, build_processor
from gristmill.errors import EngineDeadError, PromptTooLongError, RequestError, is_fatal, root_cause
from tests.on_ray.conftest import ENGINE, GREEDY, TINY_MAX_MODEL_LEN, by_key, story_rows, tiny_engine

pytestmark = pytest.mark.timeout(180)

BAD_ROWS = [
    {"key": 10, "prompt": "Story BADROW", "sampling_params": dict(GREEDY)},
    {"key": 11, "prompt": "word " * 600, "sampling_params": dict(GREEDY)},
    {"key": 12, "prompt": "Story twelve", "sampling_params": {**GREEDY, "bogus": 1}},
    {"key": 13, "prompt": None, "sampling_params": dict(GREEDY)},
    {"key": 14, "prompt": None, "sampling_params": dict(GREEDY),
     "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
]
CHAT_ROW = {"key": 15, "prompt": None, "sampling_params": dict(GREEDY),
            "messages": [{"role": "user", "content": "Name a colour."}]}
# Structured output and penalties: the same row fields as a local job.
CONTROLLED_ROWS = [
    {"key": 16, "prompt": "Is the sky blue? Answer:",
     "sampling_params": {"max_tokens": 6, "temperature": 0, "structured_output": {"choice": ["yes", "no"]}}},
    {"key": 17, "prompt": "The capital of France is",
     "sampling_params": {**GREEDY, "max_tokens": 20, "bad_words": ["capital"], "repetition_penalty": 1.2}},
    {"key": 18, "prompt": "x", "sampling_params": {**GREEDY, "structured_output": {"regex": "[0-9"}}},
]
EXPECTED_ERRORS = {
    10: "GenerationError: setting up the detokenizer failed: injected fault at 'detokenize_init'",
    11: "PromptTooLongError: prompt (",
    12: "RequestError: unknown sampling_params ['bogus']",
    13: "RequestError: a row needs 'prompt', 'messages' or 'tokenized_prompt'",
    14: "RequestError: ",  # the chat template (a task on Ray) refuses two user turns in a row
}


def _stamp(name):
    return lambda row: {**row, name: 1}


def test_engine_stage_keeps_going_past_bad_rows_with_the_local_runners_output():
    rows = [{**row, "messages": row.get("messages")} for row in story_rows(10) + BAD_ROWS + [CHAT_ROW] + CONTROLLED_ROWS]
    config = EngineProcessorConfig(engine=ENGINE, should_continue_on_error=True, batch_size=4, id_column="key")
    processor = build_processor(config, preprocess=_stamp("pre"), postprocess=_stamp("post"))
    dataset = processor(ray.data.from_items(rows))
    assert isinstance(dataset, ray.data.Dataset)  # lazy: nothing has run yet
    out = by_key(dataset.take_all())

    assert sorted(out) == list(range(19))  # every row, exactly once
    assert out[16]["generated_text"] in ("yes", "no") and out[16]["finish_reason"] == "stop"
    assert "capital" not in out[17]["generated_text"] and out[17]["num_generated_tokens"] == 20
    assert out[18][ERROR_COLUMN].startswith("RequestError: structured_output.regex is not valid")
    for key, expected in EXPECTED_ERRORS.items():
        error = out[key][ERROR_COLUMN]
        assert error.startswith(expected), error
        assert "Traceback" not in error and "ray::" not in error
        assert out[key]["pre"] == 1 and out[key].get("post") is None  # postprocess skips error rows
        assert out[key]["generated_text"] == "" and out[key]["finish_reason"] == "error"
    assert "alternate" in out[14][ERROR_COLUMN]
    for key in [*range(10), 15]:
        assert out[key][ERROR_COLUMN] == "" and out[key]["post"] == 1
        assert out[key]["num_generated_tokens"] == 6 and out[key]["generated_text"]

    local = by_key(build_processor(config, preprocess=_stamp("pre"))(rows))  # the same job, in this process
    for key, row in local.items():
        assert (out[key]["generated_text"], list(out[key]["generated_tokens"]), out[key][ERROR_COLUMN]) == \
            (row["generated_text"], row["generated_tokens"], row[ERROR_COLUMN])


def test_a_row_that_kills_the_engine_fails_the_job_fast_as_a_fatal_error(tiny_model):
    # The tiny model: the engine's death, not the model, is the point.
    rows = story_rows(6) + [{"key": 6, "prompt": "Story POISON", "sampling_params": dict(GREEDY)}]
    config = EngineProcessorConfig(engine=tiny_engine(tiny_model), should_continue_on_error=True, max_engine_restarts=0,
                                   id_column="key")
    dataset = build_processor(config)(ray.data.from_items(rows))
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        dataset.take_all()
    assert time.monotonic() - started < 90  # an engine start, then the death: never Ray's 30-minute retries
    # Ray Data hands the driver a wrapper with the original only in its text; it is still fatal.
    assert type(caught.value).__name__.startswith("RayTaskError")
    assert is_fatal(caught.value)
    cause = root_cause(caught.value)
    assert isinstance(cause, EngineDeadError)
    assert "max_engine_restarts=0" in cause.message and "6" in cause.message


def test_a_row_error_without_continue_on_error_stops_the_job_and_is_not_fatal(tiny_model):
    context = ray.data.DataContext.get_current()
    context.raise_original_map_exception = True
    try:
        rows = story_rows(3) + [{"key": 3, "prompt": "word " * 300, "sampling_params": dict(GREEDY)}]
        config = EngineProcessorConfig(engine=tiny_engine(tiny_model), id_column="key")
        with pytest.raises(Exception) as caught:
            build_processor(config)(ray.data.from_items(rows)).take_all()
    finally:
        context.raise_original_map_exception = False
    assert not is_fatal(caught.value)
    cause = root_cause(caught.value)
    assert isinstance(cause, PromptTooLongError)
    assert cause.message.startswith("row 3: prompt (")
    assert f"exceeds max_model_len ({TINY_MAX_MODEL_LEN})" in cause.message


def test_actors_that_can_never_fit_fail_at_once_saying_what_to_change():
    started = time.monotonic()
    config = EngineProcessorConfig(engine=ENGINE, concurrency=2)
    with pytest.raises(RequestError, match=r"needs 3 CPUs at once on Ray \(2 actor\(s\) x num_cpus=1 \+ 1 for a "
                                           r"map task\) but the cluster has 2; lower concurrency"):
        build_processor(config)(ray.data.from_items(story_rows(2)))
    smaller = EngineProcessorConfig(engine=ENGINE, concurrency=2, ray_actor_options={"num_cpus": 0.5})
    assert isinstance(build_processor(smaller)(ray.data.from_items(story_rows(2))), ray.data.Dataset)
    assert time.monotonic() - started < 5


def test_chat_rows_with_tools_get_their_calls_on_ray_data():
    # The chat-template stage (tasks) writes the tools into the prompt; the engine stage
    # (actors) forces the call and reads it into the tool_calls column.
    import jsonschema

    from tests.chat.reasoning_models import cache_dir, tiny_reasoning_model

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools,
            "sampling_params": {"max_tokens": 80, "temperature": 1.0, "seed": 3}}
    rows = [{"key": 0, **chat, "tool_choice": "required"},
            {"key": 1, **chat, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}]
    engine = EngineConfig(model=tiny_reasoning_model("hermes_tools"), device="cpu", cache_dir=cache_dir(),
                          quantization=None)
    processor = build_processor(EngineProcessorConfig(engine=engine, should_continue_on_error=True, id_column="key"))
    out = by_key(processor(ray.data.from_items(rows)).take_all())
    [call] = out[0]["tool_calls"]
    assert out[0][ERROR_COLUMN] == "" and call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], schema)
    assert out[1][ERROR_COLUMN].startswith("RequestError: tool_choice names function 'get_time'")
