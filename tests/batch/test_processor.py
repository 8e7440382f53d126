"""Processors on the bundled model: the row contract, the three kinds of rows in and
out, streaming, chaining on one deployment, and rows that fail."""

from __future__ import annotations

import itertools
import re

import pandas as pd
import pyarrow as pa
import pytest

from gristmill import GenerationError, PromptTooLongError, RequestError
from gristmill.batch import (ERROR_COLUMN, OUTPUT_COLUMNS, DeploymentProcessorConfig, EngineProcessorConfig,
                             UserFunctionError, build_processor)
from tests.batch.conftest import ENGINE, rows_of
from tests.harness import core_children


def on(shared, **options):
    return DeploymentProcessorConfig(deployment_name=shared.name, **options)


def texts(rows):
    return {row["id"]: row["generated_text"] for row in rows}


def test_an_owned_engine_gives_the_same_rows_as_a_deployment_and_leaves_nothing(shared):
    rows = rows_of(5) + [{"id": 5, "messages": [{"role": "user", "content": "Say hi"}],
                          "sampling_params": {"max_tokens": 6, "temperature": 0}}]
    owned = build_processor(EngineProcessorConfig(engine=ENGINE, batch_size=2),
                            postprocess=lambda row: {**row, "answer": row["generated_text"].upper()})
    out = owned(rows)
    assert [row["id"] for row in out] == list(range(6))
    for row in out:
        assert row[ERROR_COLUMN] == "" and row["finish_reason"] in ("length", "stop")
        assert set(OUTPUT_COLUMNS) <= set(row) and row["answer"] == row["generated_text"].upper()
        assert row["num_generated_tokens"] == len(row["generated_tokens"]) > 0
        assert row["num_input_tokens"] > 0 and row["time_taken_llm"] > 0
    assert [r["num_generated_tokens"] for r in out[:5]] == [6] * 5
    assert core_children() == shared.core_pids  # the owned engine is gone
    shared_out = build_processor(on(shared, method="completions"))(rows[:5])
    assert texts(shared_out) == {i: text for i, text in texts(out).items() if i < 5}


def test_bad_rows_become_error_rows_and_good_rows_are_unaffected(shared):
    good = rows_of(6)
    bad = [
        {"id": "long", "prompt": "word " * 600},
        {"id": "params", "prompt": "x", "sampling_params": {"temperature": -1}},
        {"id": "unknown", "prompt": "x", "sampling_params": {"max_token": 4}},
        {"id": "messages", "messages": [{"role": "user"}]},
        {"id": "nothing", "text": "no prompt here"},
        {"id": "detok", "prompt": "BADROW story", "sampling_params": {"max_tokens": 4}},
        {"id": "tokenize", "messages": [{"role": "user", "content": "TOKFAIL story"}]},
    ]
    mixed = [row for pair in itertools.zip_longest(good, bad) for row in pair if row is not None]
    processor = build_processor(on(shared, should_continue_on_error=True, batch_size=4))
    out = processor(mixed)
    assert [row["id"] for row in out] == [row["id"] for row in mixed]
    errors = {row["id"]: row[ERROR_COLUMN] for row in out if row[ERROR_COLUMN]}
    assert set(errors) == {row["id"] for row in bad}
    assert errors["long"].startswith("PromptTooLongError: prompt (")
    assert errors["params"].startswith("RequestError: temperature must be a number >= 0")
    assert errors["unknown"].startswith("RequestError: unknown sampling_params ['max_token']")
    assert errors["messages"].startswith("RequestError: messages must be a non-empty list")
    assert errors["nothing"].startswith("RequestError: a row needs 'prompt', 'messages' or 'tokenized_prompt'")
    assert errors["detok"].startswith("GenerationError: setting up the detokenizer failed")
    assert errors["tokenize"].startswith("GenerationError: tokenizing the prompt failed")
    for row in out:
        if row[ERROR_COLUMN]:
            assert row["generated_text"] == "" and row["generated_tokens"] == [] and row["finish_reason"] == "error"
    assert texts(r for r in out if not r[ERROR_COLUMN]) == texts(processor(good))


def test_without_continue_on_error_the_first_bad_row_stops_the_job(shared):
    rows = rows_of(3) + [{"id": "long", "prompt": "word " * 600}] + rows_of(3, start=3)
    with pytest.raises(PromptTooLongError, match="row 3: prompt"):
        build_processor(on(shared, batch_size=2))(rows)


def test_user_function_errors_stop_the_job_naming_the_row(shared):
    def preprocess(row):
        if row["id"] == 4:
            raise KeyError("question")
        return row

    with pytest.raises(UserFunctionError, match="preprocess raised on row 4: KeyError"):
        build_processor(on(shared, batch_size=2), preprocess=preprocess)(rows_of(6))
    with pytest.raises(UserFunctionError, match="postprocess must return a dict"):
        build_processor(on(shared), postprocess=lambda row: None)(rows_of(1))


def test_an_iterable_is_streamed_lazily(shared):
    consumed = []

    def source():
        for row in rows_of(1000):
            consumed.append(row["id"])
            yield row

    out = build_processor(on(shared, batch_size=4, max_concurrent_batches=2))(source())
    first = next(out)
    assert first["id"] == 0 and first[ERROR_COLUMN] == ""
    assert len(consumed) <= 4 * 4  # batches in flight, one being read, one handed out
    out.close()


def test_arrow_and_pandas_come_back_as_they_came(shared):
    processor = build_processor(on(shared))
    table = processor(pa.Table.from_pylist(rows_of(3)))
    assert isinstance(table, pa.Table) and table.num_rows == 3
    assert table.schema.field("generated_tokens").type == pa.list_(pa.int64())
    frame = processor(pd.DataFrame(rows_of(3)))
    assert isinstance(frame, pd.DataFrame) and list(frame["id"]) == [0, 1, 2]
    assert list(frame["generated_text"]) == table.column("generated_text").to_pylist()


def test_chained_processors_share_one_engine_and_turn_two_sees_turn_one(shared):
    params = {"max_tokens": 8, "temperature": 0}
    seen_pids = set()

    def turn2_pre(row):
        seen_pids.update(core_children())
        return {**row, "messages": [*row["messages"], {"role": "assistant", "content": row["generated_text"]},
                                    {"role": "user", "content": "And then?"}]}

    turn1 = build_processor(on(shared, method="chat", batch_size=2, sampling_params=params))
    turn2 = build_processor(on(shared, method="chat", batch_size=2, sampling_params=params), preprocess=turn2_pre)
    rows = [{"id": i, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]} for i in range(4)]
    out = list(turn2(turn1(iter(rows))))
    assert [row["id"] for row in out] == [0, 1, 2, 3]
    assert seen_pids == set(shared.core_pids)  # one engine-core process for both turns
    for row in out:
        assert row[ERROR_COLUMN] == "" and len(row["messages"]) == 3
        assert row["messages"][1]["content"]  # turn 1's answer is in turn 2's conversation
        assert row["num_input_tokens"] > 20


def test_a_dataframe_whose_rows_lack_columns_runs_like_the_list_of_rows(shared):
    rows = [{"id": 0, "prompt": "Hello", "sampling_params": {"max_tokens": 2}},
            {"id": 1, "messages": [{"role": "user", "content": "Yo"}]},
            {"id": 2, "prompt": "Hi", "tokenized_prompt": [9259, 1902]}]
    processor = build_processor(on(shared, sampling_params={"max_tokens": 4, "temperature": 0}))
    frame = processor(pd.DataFrame(rows))  # pandas fills the cells a row lacks with NaN
    assert list(frame[ERROR_COLUMN]) == ["", "", ""]
    assert list(frame["num_generated_tokens"]) == [2, 4, 4]
    assert list(frame["num_input_tokens"])[2] == 2  # the row's own token ids were sent
    assert list(frame["generated_text"]) == [row["generated_text"] for row in processor(rows)]


def test_a_row_with_prompt_and_messages_sends_messages_when_the_template_is_on(shared):
    messages = [{"role": "user", "content": "Yo"}]
    params = {"max_tokens": 3, "temperature": 0}
    both = [{"prompt": "Hello", "messages": messages}]
    [as_chat] = build_processor(on(shared, sampling_params=params))([{"messages": messages}])
    [as_text] = build_processor(on(shared, sampling_params=params))([{"prompt": "Hello"}])
    [on_chat] = build_processor(on(shared, sampling_params=params))(both)  # as `gristmill batch` does
    [off_chat] = build_processor(on(shared, sampling_params=params, apply_chat_template=False))(both)
    [forced] = build_processor(on(shared, sampling_params=params, method="completions"))(both)
    assert as_chat["num_input_tokens"] != as_text["num_input_tokens"]
    assert on_chat["num_input_tokens"] == as_chat["num_input_tokens"]
    assert on_chat["generated_text"] == as_chat["generated_text"]
    assert off_chat["num_input_tokens"] == forced["num_input_tokens"] == as_text["num_input_tokens"]


def test_method_chat_sends_the_messages_even_when_the_row_brings_token_ids(shared):
    """docs/batch.md: token ids a row brings win, unless method="chat" (as a Serve
    deployment or a server, which render the messages themselves, always did)."""
    params = {"max_tokens": 3, "temperature": 0}
    messages = [{"role": "user", "content": "Yo"}]
    [as_chat] = build_processor(on(shared, sampling_params=params))([{"messages": messages}])
    [both] = build_processor(on(shared, sampling_params=params, method="chat"))(
        [{"messages": messages, "tokenized_prompt": [9259, 1902]}])
    assert both[ERROR_COLUMN] == ""
    assert both["num_input_tokens"] == as_chat["num_input_tokens"] > 2
    assert both["generated_text"] == as_chat["generated_text"]
    [ids] = build_processor(on(shared, sampling_params=params))([{"messages": messages, "tokenized_prompt": [9259, 1902]}])
    assert ids["num_input_tokens"] == 2  # without method, the row's token ids win


def test_fields_a_row_has_no_column_for_are_refused_not_dropped(shared):
    rows = [{"id": "logprobs", "prompt": "x", "sampling_params": {"logprobs": 2}},
            {"id": "n", "prompt": "x", "sampling_params": {"n": 3}},
            {"id": "ok", "prompt": "x", "sampling_params": {"max_tokens": 2}}]
    out = build_processor(on(shared, should_continue_on_error=True))(rows)
    errors = {row["id"]: row[ERROR_COLUMN] for row in out}
    assert errors["logprobs"].startswith("RequestError: sampling_params.logprobs: a batch row has no logprobs")
    assert errors["n"].startswith("RequestError: a batch row makes one completion; sampling_params.n must be 1")
    assert errors["ok"] == "" and out[2]["num_generated_tokens"] > 0
    with pytest.raises(RequestError, match="processor config sampling_params: sampling_params.logprobs"):
        on(shared, sampling_params={"logprobs": 1})


def test_bad_config_values_are_refused_naming_the_field():
    for options, says in [({"should_continue_on_error": "no"}, "should_continue_on_error: must be True or False"),
                          ({"apply_chat_template": 0}, "apply_chat_template: must be True or False"),
                          ({"sampling_params": {"temperature": -1}}, "temperature must be a number >= 0"),
                          ({"sampling_params": {"max_token": 3}}, "unknown sampling_params ['max_token']"),
                          ({"id_column": 3}, "id_column: must be a column name or None"),
                          ({"max_engine_restarts": True}, "max_engine_restarts: must be an integer >= 0")]:
        with pytest.raises(RequestError, match=re.escape(says)):
            EngineProcessorConfig(engine=ENGINE, **options)


def test_without_generate_rows_are_tokenized_and_carry_an_empty_error(shared):
    processor = build_processor(on(shared, generate=False, should_continue_on_error=True))
    frame = processor(pd.DataFrame([{"prompt": "Hello"}, {"prompt": 5}]))
    assert list(frame.columns) == ["prompt", "tokenized_prompt", ERROR_COLUMN]  # no generation columns
    tokens, error = frame.to_dict("records")
    assert tokens["prompt"] == "Hello" and tokens[ERROR_COLUMN] == ""
    params = {"max_tokens": 3, "temperature": 0}
    [from_text] = build_processor(on(shared, sampling_params=params))([{"prompt": "Hello"}])
    [from_ids] = build_processor(on(shared, sampling_params=params))([{"tokenized_prompt": tokens["tokenized_prompt"]}])
    assert len(tokens["tokenized_prompt"]) == from_text["num_input_tokens"] == from_ids["num_input_tokens"]
    assert from_ids["generated_text"] == from_text["generated_text"]
    assert error["tokenized_prompt"] == [] and error[ERROR_COLUMN].startswith("RequestError: 'prompt' must be a")
