"""Batch rows with tools, on a tiny random-weight Qwen3 whose chat template writes tools and
calls as Qwen's do (`<tool_call>` blocks): a forced call ("required", a named function)
comes back in the `tool_calls` column with arguments that match the function's schema,
`generated_text` holding the text around the calls; `tool_choice` "none" makes none; a
row's bad tool fields are that row's error. The same through `gristmill batch` (JSONL,
CSV and Parquet), OpenAI batch files, and an OpenAI-compatible server (HttpProcessorConfig)."""

from __future__ import annotations

import csv
import json

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gristmill import EngineConfig
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, HttpProcessorConfig, build_processor
from gristmill.batch.openai_batch import batch_request_row
from gristmill.errors import RequestError
from tests.batch.inprocess import batch_main
from tests.chat.reasoning_models import cache_dir, tiny_reasoning_model
from tests.chat.tools import MESSAGES, SCHEMAS, TOOLS

NAMED = {"type": "function", "function": {"name": "get_time"}}
PARAMS = {"max_tokens": 120, "temperature": 1.0}


def chat_row(seed: int = 0, **fields) -> dict:
    return {"messages": MESSAGES, "tools": TOOLS, "sampling_params": {**PARAMS, "seed": seed}, **fields}


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert set(call) == {"name", "arguments"} and call["name"] in names
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])


@pytest.fixture(scope="module")
def engine():
    return EngineConfig(model=tiny_reasoning_model("hermes_tools"), device="cpu", cache_dir=cache_dir(),
                        quantization=None)


#: Rows of one processor run, by what they test.
ROWS = {
    **{f"required{seed}": chat_row(seed, tool_choice="required") for seed in range(6)},
    **{f"named{seed}": chat_row(seed, tool_choice=NAMED, parallel_tool_calls=False) for seed in range(3)},
    "none": chat_row(tool_choice="none"),
    "plain": {"messages": MESSAGES, "sampling_params": {**PARAMS, "max_tokens": 8}},
    "tools_not_a_list": chat_row(tools={"name": "get_weather"}),
    "unknown_function": chat_row(tool_choice={"type": "function", "function": {"name": "get_date"}}),
    "bad_choice": chat_row(tool_choice="always"),
    "prompt_row": {"prompt": "Hi", "tools": TOOLS, "tool_choice": "required"},
    "two_constraints": chat_row(tool_choice="required",
                                sampling_params={**PARAMS, "structured_output": {"choice": ["a"]}}),
}


@pytest.fixture(scope="module")
def outputs(engine):
    processor = build_processor(EngineProcessorConfig(engine=engine, should_continue_on_error=True,
                                                      id_column="id"))
    return {row["id"]: row for row in processor([{"id": name, **row} for name, row in ROWS.items()])}


def test_required_and_named_calls_parse_and_match_their_schemas(outputs):
    for name, row in outputs.items():
        if name.startswith("required") or name.startswith("named"):
            assert row[ERROR_COLUMN] == "" and row["finish_reason"] == "tool_calls", row
            check_calls(row["tool_calls"], names=("get_time",) if name.startswith("named") else tuple(SCHEMAS))
            assert row["generated_text"] == ""  # (the text was the calls, and nothing else)
            if name.startswith("named"):
                assert len(row["tool_calls"]) == 1  # (parallel_tool_calls false)


def test_tool_choice_none_makes_no_calls_and_rows_without_tools_get_no_column(outputs):
    none, plain = outputs["none"], outputs["plain"]
    assert none[ERROR_COLUMN] == "" and none["tool_calls"] == [] and none["generated_text"]
    assert none["finish_reason"] != "tool_calls"
    assert plain[ERROR_COLUMN] == "" and "tool_calls" not in plain


def test_a_rows_bad_tool_fields_are_its_error_and_the_others_run(outputs):
    expected = {"tools_not_a_list": "RequestError: tools must be a list of",
                "unknown_function": "RequestError: tool_choice names function 'get_date', which is not among",
                "bad_choice": "RequestError: tool_choice must be \"none\", \"auto\", \"required\"",
                "prompt_row": "RequestError: the row has tools, tool_choice, which apply to a chat",
                "two_constraints": "RequestError: tool_choice forces a tool call, whose arguments follow"}
    for name, start in expected.items():
        row = outputs[name]
        assert row[ERROR_COLUMN].startswith(start), row[ERROR_COLUMN]
        assert row["finish_reason"] == "error" and row["generated_text"] == ""
    assert sum(not row[ERROR_COLUMN] for row in outputs.values()) == len(outputs) - len(expected)


def test_the_cli_writes_tool_calls_to_jsonl_and_csv(engine, tmp_path):
    rows = [{"id": "a", **chat_row(1, tool_choice="required")},
            {"id": "b", **chat_row(2, tool_choice=NAMED)},
            {"id": "c", "messages": MESSAGES, "sampling_params": {"max_tokens": 4}},
            {"id": "d", **chat_row(3, tools="nope")}]
    flags = ("--model", engine.model, "--device", "cpu", "--cache-dir", engine.cache_dir, "--quantization", "none",
             "--id-column", "id")
    source, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ran = batch_main(source, "-o", out, *flags)
    assert ran.returncode == 0, ran.stderr
    a, b, c, d = [json.loads(line) for line in out.read_text().splitlines()]
    check_calls(a["tool_calls"])
    check_calls(b["tool_calls"], names=("get_time",))
    assert a["finish_reason"] == "tool_calls" and c["tool_calls"] is None and c[ERROR_COLUMN] == ""
    assert d["tool_calls"] is None and d[ERROR_COLUMN].startswith("RequestError: tools must be a list")
    # CSV: the JSON fields are cells of JSON text, and the calls come back as JSON text too
    csv_source, csv_out = tmp_path / "rows.csv", tmp_path / "out.csv"
    with open(csv_source, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "messages", "tools", "tool_choice", "parallel_tool_calls", "sampling_params"])
        writer.writerow(["a", json.dumps(MESSAGES), json.dumps(TOOLS), "required", "false",
                         json.dumps({**PARAMS, "seed": 4})])
        writer.writerow(["b", json.dumps(MESSAGES), "", "", "", json.dumps({"max_tokens": 4})])
    ran = batch_main(csv_source, "-o", csv_out, *flags)
    assert ran.returncode == 0, ran.stderr
    with open(csv_out, newline="") as f:
        a, b = list(csv.DictReader(f))
    calls = json.loads(a["tool_calls"])
    check_calls(calls)
    assert len(calls) == 1 and a["generated_text"] == ""
    assert b["tool_calls"] == "" and b[ERROR_COLUMN] == ""


def test_the_cli_reads_tools_from_parquet_and_writes_the_calls_as_json_text(engine, tmp_path):
    # The tools are nested structs here, so Arrow gives each tool's schema the other's keys
    # as nulls: the calls must still follow each function's own schema.
    rows = [{"id": "a", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
             "sampling_params": {**PARAMS, "seed": 6}},
            {"id": "b", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "always",
             "sampling_params": {**PARAMS, "seed": 7}},
            {"id": "c", "messages": MESSAGES, "tools": None, "tool_choice": None,
             "sampling_params": {**PARAMS, "max_tokens": 4}}]
    source, out = tmp_path / "rows.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    ran = batch_main(source, "-o", out, "--model", engine.model, "--device", "cpu", "--cache-dir", engine.cache_dir,
                     "--quantization", "none", "--id-column", "id")
    assert ran.returncode == 0, ran.stderr
    table = pq.read_table(out)
    assert table.schema.field("tool_calls").type == pa.string()
    a, b, c = table.to_pylist()
    calls = json.loads(a["tool_calls"])
    check_calls(calls)
    assert a["finish_reason"] == "tool_calls" and a["generated_text"] == "" and a[ERROR_COLUMN] == ""
    assert b["tool_calls"] is None and b[ERROR_COLUMN].startswith("RequestError: tool_choice must be")
    assert c["tool_calls"] is None and c[ERROR_COLUMN] == "" and c["generated_text"]


def test_an_openai_batch_file_with_tools_answers_as_the_server(engine, tmp_path):
    def line(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": MESSAGES, "max_tokens": 120, "seed": 5, **body}}

    lines = [line("forced", tools=TOOLS, tool_choice="required"), line("plain", max_tokens=4),
             line("bad", tools=TOOLS, tool_choice="sometimes")]
    source, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ran = batch_main(source, "-o", out, "--model", engine.model, "--device", "cpu", "--cache-dir", engine.cache_dir,
                     "--quantization", "none")
    assert ran.returncode == 0, ran.stderr
    forced, plain, bad = [json.loads(x)["response"] for x in out.read_text().splitlines()]
    [choice] = forced["body"]["choices"]
    assert forced["status_code"] == 200 and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert "tool_calls" not in plain["body"]["choices"][0]["message"]
    assert bad["status_code"] == 400 and "tool_choice must be" in bad["body"]["error"]["message"]


def test_a_completions_batch_line_refuses_tools():
    line = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi", "tools": TOOLS}}
    with pytest.raises(RequestError, match=r"body fields \['tools'\] are not supported"):
        batch_request_row(line)


def test_rows_sent_to_a_server_carry_their_tools_and_get_its_calls():
    from tests.server.conftest import TINY_MODEL, AppServer, ServerLoop, start_tiny_engine

    loop, engine = ServerLoop(), start_tiny_engine("hermes_tools")
    server = AppServer(loop, engine, model=TINY_MODEL)
    try:
        processor = build_processor(HttpProcessorConfig(url=f"{server.url}/v1", should_continue_on_error=True,
                                                        max_retries=0))
        forced, named, plain, bad = processor([chat_row(1, tool_choice="required"), chat_row(2, tool_choice=NAMED),
                                               {"messages": MESSAGES, "sampling_params": {"max_tokens": 4}},
                                               chat_row(3, tool_choice="always")])
    finally:
        server.stop()
        engine.shutdown()
        loop.close()
    check_calls(forced["tool_calls"])
    check_calls(named["tool_calls"], names=("get_time",))
    assert forced["finish_reason"] == "tool_calls" and forced["generated_text"] == ""
    assert plain[ERROR_COLUMN] == "" and "tool_calls" not in plain
    assert bad[ERROR_COLUMN].startswith("RequestError: HTTP 400") and "tool_choice" in bad[ERROR_COLUMN]
