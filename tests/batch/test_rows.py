"""The row contract and processor configs, without an engine."""

from __future__ import annotations

import pyarrow as pa
import pytest

from gristmill import RequestError
from gristmill.batch import (DeploymentProcessorConfig, EngineProcessorConfig, HttpProcessorConfig,
                             build_processor)
from gristmill.batch.rows import OUTPUT_COLUMNS, error_columns, sampling_params_of
from gristmill.batch.tables import arrow_table, to_rows


def test_row_sampling_params_override_the_defaults():
    params = sampling_params_of({"sampling_params": {"max_tokens": 5, "seed": None}},
                                {"max_tokens": 9, "temperature": 0})
    assert params.max_tokens == 5 and params.temperature == 0 and params.seed is None
    assert sampling_params_of({}, {}).max_tokens == 16


def test_rows_read_as_one_arrow_table_keep_only_their_own_logit_bias():
    """Arrow reads the logit_bias of rows biasing different tokens as one struct, each row
    holding the others' keys as nulls: those are not the row's, and are dropped."""
    _, rows = to_rows(pa.Table.from_pylist([{"sampling_params": {"logit_bias": {"5": 100.0}}},
                                         {"sampling_params": {"logit_bias": {"7": -100.0}}},
                                         {"sampling_params": {"max_tokens": 3}}]))
    assert rows[0]["sampling_params"]["logit_bias"] == {"5": 100.0, "7": None}
    biases = [sampling_params_of(row, {}).logit_bias for row in rows]
    assert [dict(b) if b else b for b in biases] == [{5: 100.0}, {7: -100.0}, None]


@pytest.mark.parametrize("given,says", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temprature": 0.5}, "unknown sampling_params ['temprature']"),
    ("greedy", "sampling_params must be a dict"),
])
def test_bad_sampling_params_are_request_errors(given, says):
    with pytest.raises(RequestError, match=__import__("re").escape(says)):
        sampling_params_of({"sampling_params": given}, {})


def test_error_rows_keep_parquet_types_even_when_every_row_failed():
    rows = [{"id": i, "prompt": "x", **error_columns(RequestError("bad"))} for i in range(3)]
    table = arrow_table(rows)
    assert table.schema.field("generated_tokens").type == pa.list_(pa.int64())
    assert table.schema.field("time_taken_llm").type == pa.float64()
    assert table.column("__inference_error__").to_pylist() == ["RequestError: bad"] * 3
    assert all(table.schema.field(c).type != pa.null() for c in OUTPUT_COLUMNS)


@pytest.mark.parametrize("rows,kind", [([{"a": 1}], "list"), (iter([{"a": 1}]), "iterable"),
                                       (pa.Table.from_pylist([{"a": 1}]), "arrow")])
def test_kinds_of_rows(rows, kind):
    assert to_rows(rows)[0] == kind


@pytest.mark.parametrize("rows,says", [({"prompt": "x"}, "not one row"), ("data.jsonl", "not a string"),
                                       (5, "got int")])
def test_what_is_not_rows_says_what_to_pass(rows, says):
    with pytest.raises(RequestError, match=says):
        to_rows(rows)


@pytest.mark.parametrize("make,says", [
    (lambda: EngineProcessorConfig(batch_size=0), "batch_size: must be a positive integer"),
    (lambda: EngineProcessorConfig(max_engine_restarts=-1), "max_engine_restarts"),
    (lambda: DeploymentProcessorConfig(deployment_name=""), "deployment_name"),
    (lambda: DeploymentProcessorConfig(deployment_name="x", method="embed"), "method"),
    (lambda: HttpProcessorConfig(url="localhost:8000"), r"url: must be an http\(s\) URL"),
    (lambda: HttpProcessorConfig(url="http://x/v1", qps=0), "qps"),
])
def test_config_errors_name_the_field(make, says):
    with pytest.raises(RequestError, match=says):
        make()


def test_build_processor_rejects_other_configs():
    with pytest.raises(RequestError, match="build_processor takes"):
        build_processor({"batch_size": 4})


def test_a_deployment_that_is_not_running_is_named():
    processor = build_processor(DeploymentProcessorConfig(deployment_name="nowhere"))
    with pytest.raises(RequestError, match="no deployment named 'nowhere' is running"):
        processor([{"prompt": "x"}])


def test_an_arrow_table_keeps_columns_that_only_later_rows_have():
    table = arrow_table([{"a": 1}, {"a": 2, "b": "x"}, {"b": "y", "a": 3}])
    assert table.column_names == ["a", "b"]
    assert table.to_pylist() == [{"a": 1, "b": None}, {"a": 2, "b": "x"}, {"a": 3, "b": "y"}]


def test_openai_batch_lines_carry_response_format_and_structured_outputs_as_a_constraint():
    from gristmill.batch.openai_batch import batch_request_row

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}}
    assert batch_request_row(chat)["sampling_params"]["structured_output"] == {"json": schema}
    chat["body"]["response_format"] = {"type": "json_object"}
    assert batch_request_row(chat)["sampling_params"]["structured_output"] == {"json_object": True}
    chat["body"]["response_format"] = {"type": "text"}
    assert batch_request_row(chat)["sampling_params"]["structured_output"] is False  # plain text: no constraint
    completion = {"custom_id": "2", "url": "/v1/completions",
                  "body": {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}}
    assert batch_request_row(completion)["sampling_params"]["structured_output"] == {"choice": ["a", "b"]}
    completion["body"].update(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1, min_tokens=3,
                              bad_words=["x"], logit_bias={"7": 5})
    params = batch_request_row(completion)["sampling_params"]
    assert {k: params[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                                   "bad_words", "logit_bias")} == {
        "presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "min_tokens": 3,
        "bad_words": ["x"], "logit_bias": {"7": 5}}
    completion["body"]["response_format"] = {"type": "json_object"}
    with pytest.raises(RequestError, match="not both") as info:
        batch_request_row(completion)
    assert info.value.param == "response_format"


def test_a_batch_lines_own_choice_of_constraint_wins_over_the_jobs_default():
    """`gristmill batch --json-schema` gives every row a default constraint; a line whose
    body asks for plain text (`response_format: {"type": "text"}`, OpenAI's way) runs
    free, as a row with `structured_output: false` does; `text` beside vLLM's
    `structured_outputs` is no conflict (as in vLLM)."""
    from gristmill.batch.openai_batch import batch_request_row

    default = {"structured_output": {"json": {"type": "object"}}}
    line = {"custom_id": "1", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"}}}
    assert sampling_params_of(batch_request_row(line), default).structured_output is None
    line["body"]["structured_outputs"] = {"regex": "[0-9]+"}
    assert sampling_params_of(batch_request_row(line), default).structured_output == {"regex": "[0-9]+"}
    del line["body"]["response_format"], line["body"]["structured_outputs"]
    assert sampling_params_of(batch_request_row(line), default).structured_output == default["structured_output"]


@pytest.mark.parametrize("body,param,says", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "structured_outputs.regex is not valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "response_format.json is not valid: Invalid type: objectx"),
    ({"response_format": "json_object"}, "response_format",
     'response_format must be an object such as {"type": "json_object"}, got \'json_object\''),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}}, "structured_outputs",
     "leave out disable_any_whitespace"),
])
def test_a_batch_lines_bad_constraint_names_the_body_field_as_the_server_does(body, param, says):
    from gristmill.batch.openai_batch import batch_request_row

    line = {"custom_id": "1", "url": "/v1/completions", "body": {"prompt": "x", **body}}
    with pytest.raises(RequestError) as info:
        batch_request_row(line)
    assert info.value.param == param and says in str(info.value), info.value


def test_rows_read_as_one_arrow_table_keep_only_their_own_json_schema():
    """Arrow reads the JSON schemas of rows (Parquet, a pyarrow Table) as one struct: a
    string schema gets the object schema's `properties` and `required` as nulls. Those are
    not the row's: each row is constrained by its own schema, never an error row."""
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    short = {"type": "string", "maxLength": 5}
    _, rows = to_rows(pa.Table.from_pylist([
        {"sampling_params": {"structured_output": {"json": person}}},
        {"sampling_params": {"structured_output": {"json": short}}},
        {"sampling_params": {"structured_output": {"regex": "[0-9]+"}}},
        {"sampling_params": {"max_tokens": 3}}]))
    assert rows[1]["sampling_params"]["structured_output"]["json"]["properties"] is None  # what Arrow gives
    default = {"structured_output": {"json_object": True}}
    assert [sampling_params_of(row, default).structured_output for row in rows] == [
        {"json": person}, {"json": short}, {"regex": "[0-9]+"}, {"json_object": True}]
