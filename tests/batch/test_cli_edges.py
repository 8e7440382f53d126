"""`gristmill batch` on the inputs users' first files hold: a BOM, a column that first
appears on row 2, ids with leading zeros, numbers as prompts, bytes that are not UTF-8,
an OpenAI batch line without max_tokens. Input that cannot run is refused before the
model loads, naming the line and what to change; input that can runs as it was written.

The commands run in this process (`cli.main`, tests/batch/inprocess.py) with the exit
status and stderr a shell would see; `serve --port 70000` runs as a process (it must not
serve, and a process can be stopped if it does). Rows whose text is not checked run on
the tiny random-weight model.

Then the files and flags a command cannot use, for `batch`, `generate` and `serve`
alike: an input or output that cannot be read, an output that is not this job's, a
model file cut short, a port out of range. Each is one `error:` line that names the file
or flag, never a traceback, and a job that never ran leaves an existing output as it was.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gristmill.batch import ERROR_COLUMN
from gristmill.cli import main
from tests.batch.inprocess import Ran, batch_main, run_main, tiny_model, without_faults
from tests.batch.test_cli_batch import read_jsonl, write_jsonl
from tests.harness import core_children


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
        result = batch_main(tmp_path / name, "-o", target, *flags)
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
    result = batch_main(source, "-o", target, "--temperature", "0", "--max-tokens", "3", "--device", "cpu",
                        "--model", tiny_model())  # (no text is checked: the tiny model)
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
    """Also: a tokenized_prompt cell that is not a list of integers (`[1, 2` cut short, or
    text) makes an error row, a RequestError naming tokenized_prompt; such a cell was once
    generated from as text and came back as a success row."""
    source = tmp_path / "in.csv"
    with open(source, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["qid", "prompt", "note", "tokenized_prompt"])
        writer.writerows([["007", "12345", "2024-01-01", ""], ["7", "67890", "true", ""], ["010", "", "1e3", ""],
                          ["t1", "", "", "[1, 2"], ["t2", "", "", "abc"], ["t3", "", "", "[1, 2]"]])
    target = tmp_path / "out.csv"
    result = batch_main(source, "-o", target, "--id-column", "qid", "--temperature", "0", "--max-tokens", "2",
                        "--device", "cpu")
    assert result.returncode == 0, result.stderr
    with open(target, newline="") as f:
        out = list(csv.DictReader(f))
    assert [row["qid"] for row in out] == ["007", "7", "010", "t1", "t2", "t3"]  # "007" and "7" are two rows
    assert [row["note"] for row in out] == ["2024-01-01", "true", "1e3", "", "", ""]
    assert [row["prompt"] for row in out] == ["12345", "67890", "", "", "", ""]
    assert out[0][ERROR_COLUMN] == "" and out[0]["generated_text"] and int(out[0]["num_input_tokens"]) > 0
    assert out[1][ERROR_COLUMN] == ""
    assert out[2][ERROR_COLUMN].startswith("RequestError: prompt is empty")
    for row in out[3:5]:
        assert row[ERROR_COLUMN].startswith("RequestError") and "tokenized_prompt" in row[ERROR_COLUMN], row
    assert out[5][ERROR_COLUMN] == "" and out[5]["num_input_tokens"] == "2"  # real token ids run as they are
    # --resume against another input's output is refused and the output is left as it was.
    before = target.read_bytes()
    other = tmp_path / "other.csv"
    other.write_text("qid,prompt\n999,Hello\n")
    refused = batch_main(other, "-o", target, "--id-column", "qid", "--resume", "--max-tokens", "2")
    assert refused.returncode != 0 and "--resume" in refused.stderr and "Traceback" not in refused.stderr
    assert "0 rows written" not in refused.stderr
    assert target.read_bytes() == before


def test_a_batch_line_without_max_tokens_runs_to_the_context_and_one_line_is_one_prompt(tmp_path):
    lines = [_batch_line("free", "Once upon a time", temperature=0, ignore_eos=True),
             {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}},
             _batch_line("capped", "Once upon a time", temperature=0, ignore_eos=True, max_tokens=3),
             _batch_line("ids", [[2, 259]], max_tokens=2),  # one prompt of token ids, in a list
             _batch_line("two", ["a", "b"], max_tokens=2)]
    source = write_jsonl(tmp_path / "batch.jsonl", lines)
    result = batch_main(source, "-o", tmp_path / "out.jsonl", "--device", "cpu", "--max-model-len", "64",
                        "--model", tiny_model())  # (no text is checked: the tiny model)
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
    result = batch_main(source, "-o", target, "--temperature", "0", "--max-tokens", "24", "--device", "cpu",
                        "--max-model-len", "256", "--model", tiny_model())  # (any model keeps to a schema)
    assert result.returncode == 0, result.stderr
    out = read_jsonl(target)
    assert [row[ERROR_COLUMN] for row in out] == ["", "", ""], out
    assert all(row["finish_reason"] == "stop" for row in out), out
    named, when, answer = (row["generated_text"] for row in out)
    assert list(json.loads(named)) == ["name"] and len(json.loads(named)["name"]) <= 12
    assert 1900 <= json.loads(when) <= 2100 and isinstance(json.loads(when), int)
    assert answer in ("yes", "no")


# -- files and flags a command cannot use ---------------------------------------------------

def cli(*args) -> Ran:
    """`gristmill ARGS...` in this process, without the package's GRISTMILL_FAULTS."""
    return run_main(*args, env=without_faults())


def refused_cleanly(result: Ran, *says: str) -> None:
    assert result.returncode not in (0, None), result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    for part in says:
        assert part in result.stderr, (part, result.stderr[-2000:])


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def corrupt(tiny, tmp_path_factory):
    """The tiny GGUF cut short, as an interrupted download leaves it."""
    path = tmp_path_factory.mktemp("corrupt") / "cut.gguf"
    path.write_bytes(tiny.read_bytes()[:3000])
    return path


def test_a_truncated_or_empty_parquet_input_is_refused_without_a_traceback(tmp_path):
    """A Parquet input cut short (an interrupted copy) or 0 bytes is refused with one
    `error:` line naming the file, as the CSV and JSONL readers refuse theirs, and no
    output is created. It once died with pyarrow's "ArrowInvalid: Parquet magic bytes not
    found in footer" traceback."""
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), whole)
    (tmp_path / "cut.parquet").write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    (tmp_path / "empty.parquet").write_bytes(b"")
    for name in ("cut.parquet", "empty.parquet"):
        result = cli("batch", tmp_path / name, "-o", tmp_path / f"{name}.out.jsonl", "--device", "cpu")
        refused_cleanly(result, name, "not a readable Parquet file")
        assert not (tmp_path / f"{name}.out.jsonl").exists()


def test_resume_onto_a_jsonl_output_whose_line_is_not_an_object_is_refused_without_a_traceback(tmp_path):
    """`--resume` onto a JSONL output with a line that is JSON but not an object (`[1, 2]`,
    `"text"`: a file gristmill did not write) is refused as a non-JSON line is, naming
    --resume, and leaves the file as it was. It once died with "AttributeError: 'list'
    object has no attribute 'get'"."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    for i, line in enumerate(('[1, 2]\n', '"just text"\n')):
        target = tmp_path / f"out{i}.jsonl"
        target.write_text(line)
        result = cli("batch", source, "-o", target, "--resume", "--device", "cpu")
        refused_cleanly(result, f"out{i}.jsonl:1", "--resume")
        assert target.read_text() == line


def test_resume_onto_a_csv_output_that_is_not_utf8_is_refused_without_a_traceback(tmp_path):
    """`--resume` onto a CSV output that is not UTF-8 (a Latin-1 file of the user's, named by
    mistake) is refused with one `error:` line naming the file, and leaves it as it was. It
    once died with "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9"."""
    source = tmp_path / "in.csv"
    source.write_text("prompt\nhello\n")
    target = tmp_path / "mine.csv"
    target.write_bytes(b"name,city\nJos\xe9,M\xe1laga\n")
    result = cli("batch", source, "-o", target, "--resume", "--device", "cpu")
    refused_cleanly(result, "mine.csv", "not UTF-8", "--resume")
    assert target.read_bytes() == b"name,city\nJos\xe9,M\xe1laga\n"


def test_resume_onto_a_jsonl_output_with_other_columns_is_refused(tmp_path):
    """`--resume` onto a JSONL output whose rows have other columns than this job's (another
    job's output: column `prompt` where this input has `question`) is refused, naming the
    column, and leaves the output as it was, as for a CSV header. It was once accepted
    ("2 rows ok (2 of them kept from before --resume)"), keeping the other job's rows as
    this input's answers."""
    target = tmp_path / "out.jsonl"
    written = "".join(json.dumps({"__row_id__": i, "prompt": p, "generated_text": "x", "generated_tokens": [1],
                                  "num_input_tokens": 1, "num_generated_tokens": 1, "finish_reason": "length",
                                  "time_taken_llm": 0.1, "__inference_error__": ""}) + "\n"
                      for i, p in enumerate("ab"))
    target.write_text(written)  # what a job over [{"prompt": "a"}, {"prompt": "b"}] wrote
    other = write_jsonl(tmp_path / "questions.jsonl", [{"question": "What is 2+2?"}, {"question": "Name a color."}])
    result = cli("batch", other, "-o", target, "--prompt-column", "question", "--resume", "--device", "cpu")
    refused_cleanly(result, "--resume", "'prompt'")
    assert target.read_text() == written


def test_a_job_that_cannot_start_does_not_empty_the_existing_output(tmp_path):
    """A job refused before it runs (a --model path that does not exist, an --errors file in
    a directory that does not exist) leaves an existing output as it was: the output is
    overwritten only once the engine is up. Such a job once left the previous results
    file at 0 bytes."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    target = tmp_path / "out.jsonl"
    before = json.dumps({"__row_id__": 0, "prompt": "a", "generated_text": "hours of work"}) + "\n"
    for flags, says in ((["--model", tmp_path / "no-such-model.gguf"], "not found"),
                        (["--errors", tmp_path / "no-dir" / "errors.jsonl"], "--errors")):
        target.write_text(before)
        result = cli("batch", source, "-o", target, "--device", "cpu", *flags)
        refused_cleanly(result, says)
        assert target.read_text() == before, (flags, result.stderr[-500:])


def test_batch_with_a_corrupt_gguf_says_what_to_do_not_a_traceback(tmp_path, corrupt):
    """`batch --model cut.gguf` (a download cut short) gives the one `error:` line that
    `generate` gives ("the model could not be loaded from ...; check that the model
    directory or file is complete"), not the loader's ValueError traceback, and leaves no
    output."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    result = cli("batch", source, "-o", tmp_path / "out.jsonl", "--model", corrupt, "--device", "cpu")
    refused_cleanly(result, "cut.gguf", "not a readable GGUF file", "could not be loaded")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_bad_setting_in_the_environment_is_named_and_the_model_not_blamed(tmp_path, tiny):
    """A GRISTMILL_* variable set to what it cannot take fails the start saying which and
    what to set; the model's files are fine, so the advice to re-download them (for a file
    that does not load) is not given, nor to restart the engine (it would fail again).
    `generate`, `batch` and `serve` end on the same `error:` line (batch and serve once
    said it as an EngineDeadError of the core process, naming its pid)."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    faces = {"generate": ["generate", "a", "--max-tokens", "2"], "batch": ["batch", source, "-o", tmp_path / "out.jsonl"],
             "serve": ["serve", "--port", "0"]}
    for name, value, says in (("GRISTMILL_MAX_ISA", "avx3", "one of portable, avx2, avx512_vnni"),
                              ("GRISTMILL_PANEL_BYTES", "lots", "give a size such as 6GB")):
        env = {**without_faults(), name: value}
        last_lines = set()
        for face, args in faces.items():
            result = run_main(*args, "--model", tiny, "--device", "cpu", env=env)
            refused_cleanly(result, f"the model could not be loaded from {tiny}", f"{name}='{value}'", says)
            assert "re-download" not in result.stderr and "restart the engine" not in result.stderr, \
                (face, result.stderr[-2000:])
            assert "pid" not in result.stderr, (face, result.stderr[-2000:])
            last_lines.add(result.stderr.strip().splitlines()[-1])
        assert len(last_lines) == 1, last_lines
        assert not (tmp_path / "out.jsonl").exists()


def test_serve_with_a_missing_or_corrupt_model_says_what_to_do_not_a_traceback(tmp_path, corrupt):
    """`serve --model` with a path that does not exist, or a GGUF cut short, exits with one
    `error:` line naming the path, as `batch` and `generate` do; it once died with a
    FileNotFoundError or ValueError traceback."""
    for model, says in ((tmp_path / "nope.gguf", "not found"), (corrupt, "not a readable GGUF file")):
        result = cli("serve", "--model", model, "--device", "cpu", "--port", "0")
        refused_cleanly(result, str(model), says)


def test_serve_refuses_a_port_outside_0_to_65535(tiny):
    """`serve --port 70000` (a typo for 7000) exits non-zero at once, naming --port; it once
    served on port 70000 - 65536 = 4464, where no client would look."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "GRISTMILL_FAULTS"}
    process = subprocess.Popen([sys.executable, "-m", "gristmill.cli", "serve", "--port", str(65536 + free),
                                "--model", str(tiny), "--device", "cpu"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    served = False
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and process.poll() is None:
            try:
                served = httpx.get(f"http://127.0.0.1:{free}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                pass
            if served:
                break
            time.sleep(0.3)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    output = process.stdout.read()
    assert not served, f"--port {65536 + free} was served on port {free}"
    assert process.returncode != 0 and "--port" in output and "0..65535" in output, output[-1500:]


def test_serve_on_a_port_in_use_fails_at_once_naming_the_port():
    """`serve --port P` while another server listens on P exits within a second, before
    the engine loads, with one `error:` line naming the port and what to do; it once
    loaded the model for ~20 s first, then died with uvicorn's `[Errno 98]` log line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--port", str(port), "--device", "cpu"])
        took = time.monotonic() - began
    assert exited.value.code == (f"error: port {port} on 127.0.0.1 is already in use (another server, or a "
                                 f"gristmill serve still running); stop it, or pass a free port with --port")
    assert took < 1.5 and core_children() == []


def test_generate_input_that_cannot_be_read_is_refused_without_a_traceback(tmp_path):
    """`generate --input` with a file that does not exist, or with a byte that is not UTF-8,
    exits with one `error:` line naming the file (and for the byte, the line); it once died
    with a FileNotFoundError or UnicodeDecodeError traceback."""
    result = cli("generate", "--input", tmp_path / "missing.jsonl", "--device", "cpu")
    refused_cleanly(result, "missing.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    result = cli("generate", "--input", tmp_path / "latin1.jsonl", "--device", "cpu")
    refused_cleanly(result, "latin1.jsonl:2", "UTF-8")


def test_generate_output_to_a_directory_is_refused_before_generating(tmp_path, tiny):
    """`generate -o results`, where `results` is a directory, is refused with one `error:`
    line naming it before the model loads. It once generated every prompt, then died with
    IsADirectoryError, losing every result."""
    (tmp_path / "results").mkdir()
    result = cli("generate", "hello", "--model", tiny, "--device", "cpu", "--max-tokens", "2",
                 "-o", tmp_path / "results")
    refused_cleanly(result, "results", "is a directory")
    assert "engine ready" not in result.stderr, result.stderr[-1000:]
