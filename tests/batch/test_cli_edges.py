"""`gristmill batch` on the inputs users' first files hold: a BOM, a column that first
appears on row 2, ids with leading zeros, numbers as prompts, bytes that are not UTF-8,
an OpenAI batch line without max_tokens. Input that cannot run is refused before the
model loads, naming the line and what to change; input that can runs as it was written.
"""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq

from gristmill.batch import ERROR_COLUMN
from tests.batch.test_cli_batch import batch_cli, read_jsonl, write_jsonl


def _batch_line(custom_id, prompt="Hello", **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def test_input_that_cannot_run_is_refused_before_the_model_loads_naming_the_line(tmp_path):
    jsonl = lambda rows: "".join(json.dumps(row) + "\n" for row in rows).encode()  # noqa: E731
    cases = [
        ("rowid.jsonl", jsonl([{"__row_id__": 5, "prompt": "Hello"}]), [],
         ["has a column named '__row_id__'", "--id-column __row_id__"]),
        ("null_id.jsonl", jsonl([_batch_line("a"), _batch_line(None)]), [], ["null_id.jsonl:2", "custom_id"]),
        ("same_id.jsonl", jsonl([_batch_line("a"), _batch_line("b"), _batch_line("a")]), [],
         ["same_id.jsonl:3", '"a"', "same_id.jsonl:1"]),
        ("latin1.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', [], ["latin1.jsonl:2", "UTF-8"]),
        ("latin1.csv", b"prompt\ncaf\xe9\n", [], ["latin1.csv", "UTF-8"]),
        ("empty.csv", b"", [], ["empty.csv", "has no header line"]),
        ("same_qid.csv", b"qid,prompt\n01,Hello\n1,World\n01,again\n", ["--id-column", "qid"],
         ["same_qid.csv", '"01"']),
        ("short.csv", b"prompt,x\nhi,1\nthere\n", [],
         ["short.csv", "Expected 2 columns, got 1", "as many fields as the header"]),
        ("empty_qid.csv", b"qid,prompt\n01,Hello\n,World\n", ["--id-column", "qid"],
         ["empty_qid.csv row 2 has no 'qid' value"]),
        ("flags.jsonl", jsonl([_batch_line("a")]), ["--id-column", "custom_id", "--prompt-column", "body"],
         ["OpenAI batch file", "--id-column, --prompt-column would do nothing"]),
        ("no_qid.jsonl", jsonl([{"qid": "a", "prompt": "x"}, {"prompt": "y"}]), ["--id-column", "qid"],
         ["no_qid.jsonl:2", "qid"]),
    ]
    for name, content, flags, says in cases:
        (tmp_path / name).write_bytes(content)
        target = tmp_path / f"{name}.out.jsonl"
        result = batch_cli(tmp_path / name, "-o", target, *flags, timeout=60)
        assert result.returncode != 0, name
        for part in says:
            assert part in result.stderr, (name, part, result.stderr)
        assert "Traceback" not in result.stderr and "Loading" not in result.stderr, (name, result.stderr)
        assert not target.exists(), name


def test_jsonl_with_a_bom_and_a_late_column_runs_to_parquet(tmp_path):
    rows = [{"prompt": "The capital of France is"},
            {"prompt": "Water boils at", "sampling_params": {"max_tokens": 2}, "tag": "late"},
            {"prompt": "café au lait", "tag": None}]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(row) + "\n" for row in rows).encode())
    target = tmp_path / "out.parquet"
    result = batch_cli(source, "-o", target, "--temperature", "0", "--max-tokens", "3", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    table = pq.read_table(target)
    assert table.column("__row_id__").to_pylist() == [0, 1, 2]
    assert table.column("prompt").to_pylist() == [row["prompt"] for row in rows]  # no BOM on the first
    assert table.column("tag").to_pylist() == [None, "late", None]
    assert table.column("sampling_params").to_pylist()[1] == {"max_tokens": 2}
    assert table.column("num_generated_tokens").to_pylist()[1] <= 2
    assert table.column(ERROR_COLUMN).to_pylist() == ["", "", ""]
    assert table.schema.field("generated_tokens").type == pa.list_(pa.int64())


def test_csv_cells_are_text_as_written_and_a_refused_resume_leaves_the_output(tmp_path):
    source = tmp_path / "in.csv"
    with open(source, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["qid", "prompt", "note"])
        writer.writerows([["007", "12345", "2024-01-01"], ["7", "67890", "true"], ["010", "", "1e3"]])
    target = tmp_path / "out.csv"
    result = batch_cli(source, "-o", target, "--id-column", "qid", "--temperature", "0", "--max-tokens", "2",
                       "--device", "cpu")
    assert result.returncode == 0, result.stderr
    with open(target, newline="") as f:
        out = list(csv.DictReader(f))
    assert [row["qid"] for row in out] == ["007", "7", "010"]  # "007" and "7" are two rows
    assert [row["note"] for row in out] == ["2024-01-01", "true", "1e3"]
    assert [row["prompt"] for row in out] == ["12345", "67890", ""]
    assert out[0][ERROR_COLUMN] == "" and out[0]["generated_text"] and int(out[0]["num_input_tokens"]) > 0
    assert out[1][ERROR_COLUMN] == ""
    assert out[2][ERROR_COLUMN].startswith("RequestError: prompt is empty")
    # --resume against another input's output is refused and the output is left as it was.
    before = target.read_bytes()
    other = tmp_path / "other.csv"
    other.write_text("qid,prompt\n999,Hello\n")
    refused = batch_cli(other, "-o", target, "--id-column", "qid", "--resume", "--max-tokens", "2", timeout=60)
    assert refused.returncode != 0 and "--resume" in refused.stderr and "Traceback" not in refused.stderr
    assert "0 rows written" not in refused.stderr
    assert target.read_bytes() == before


def test_a_batch_line_without_max_tokens_runs_to_the_context_and_one_line_is_one_prompt(tmp_path):
    lines = [_batch_line("free", "Once upon a time", temperature=0, ignore_eos=True),
             {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}},
             _batch_line("capped", "Once upon a time", temperature=0, ignore_eos=True, max_tokens=3),
             _batch_line("ids", [[2, 9259]], max_tokens=2),  # one prompt of token ids, in a list
             _batch_line("two", ["a", "b"], max_tokens=2)]
    source = write_jsonl(tmp_path / "batch.jsonl", lines)
    result = batch_cli(source, "-o", tmp_path / "out.jsonl", "--device", "cpu", "--max-model-len", "64")
    assert result.returncode == 0, result.stderr
    out = {row["custom_id"]: row["response"] for row in read_jsonl(tmp_path / "out.jsonl")}
    for custom_id in ("free", "chat"):
        body = out[custom_id]["body"]
        assert out[custom_id]["status_code"] == 200, body
        usage = body["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64, usage  # not cut at 16
        assert body["choices"][0]["finish_reason"] == "length"
    assert out["capped"]["body"]["usage"]["completion_tokens"] == 3
    assert out["ids"]["status_code"] == 200 and out["ids"]["body"]["usage"]["prompt_tokens"] == 2
    assert out["two"]["status_code"] == 400
    error = out["two"]["body"]["error"]
    assert error["message"].startswith("body.prompt holds 2 prompts; a batch line makes one completion")


def test_parquet_rows_with_json_schemas_of_different_shapes_each_get_their_own(tmp_path):
    """A Parquet file holds the rows' schemas as one struct type: a string schema reads
    back with the object schema's keys as nulls (`"properties": null`). Each row still runs
    under its own schema: no error row, every document valid."""
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    year = {"type": "integer", "minimum": 1900, "maximum": 2100}
    rows = [{"prompt": "Name a famous scientist, as JSON:", "sampling_params": {"structured_output": {"json": person}}},
            {"prompt": "In what year did the first person walk on the moon?",
             "sampling_params": {"structured_output": {"json": year}}},
            {"prompt": "Is water wet?", "sampling_params": {"structured_output": {"choice": ["yes", "no"]}}}]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    target = tmp_path / "out.jsonl"
    result = batch_cli(source, "-o", target, "--temperature", "0", "--max-tokens", "24", "--device", "cpu",
                       "--max-model-len", "256")
    assert result.returncode == 0, result.stderr
    out = read_jsonl(target)
    assert [row[ERROR_COLUMN] for row in out] == ["", "", ""], out
    assert all(row["finish_reason"] == "stop" for row in out), out
    named, when, answer = (row["generated_text"] for row in out)
    assert list(json.loads(named)) == ["name"] and len(json.loads(named)["name"]) <= 12
    assert 1900 <= json.loads(when) <= 2100 and isinstance(json.loads(when), int)
    assert answer in ("yes", "no")
