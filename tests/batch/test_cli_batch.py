"""`gristmill batch` as a user runs it: the real CLI, with the exit status and the stderr
a shell would see.

Where the job's files are the point (rows, errors file, formats, schemas) the command
runs in this process (`cli.main`, tests/batch/inprocess.py); a job that is killed or
stopped by a signal is a real process. Runs whose rows must have text (the bundled
model's) are on the bundled model; the others (signals, --fail-fast, JSON schemas, whose
documents are checked against the schema) on the tiny random-weight model, which starts
and generates in a fraction of the time (its text is bytes at random, often none). Each run starts an
engine (an engine-core process importing torch: seconds), so the runs are few and each
is checked for everything a user would look at: the output rows, the errors file, the
summary, the exit status. The package's GRISTMILL_FAULTS reach the engines: a prompt
holding BADROW fails its detokenizer (a GenerationError row).
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time

import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gristmill.batch import ERROR_COLUMN
from gristmill.batch.io import CsvWriter, cut_at, read_written
from gristmill.cli import build_parser
from gristmill.engine_flags import engine_config
from tests.batch.inprocess import batch_main, tiny_model
from tests.harness import core_children, process_gone
from tests.server.conftest import Server

GREEDY = ("--temperature", "0", "--max-tokens", "5")
MIXED = [
    {"id": "a", "prompt": "The capital of France is"},
    {"id": "long", "prompt": "word " * 600},
    {"id": "b", "messages": [{"role": "user", "content": "Name a color."}]},
    {"id": "params", "prompt": "x", "sampling_params": {"temperature": -1}},
    {"id": "c", "prompt": "Water boils at", "sampling_params": {"max_tokens": 3}},
    {"id": "messages", "messages": [{"role": "user"}]},
    {"id": "detok", "prompt": "BADROW story"},
    {"id": "d", "prompt": "def fib(n):"},
]
MIXED_ERRORS = {"long": "PromptTooLongError: prompt (", "params": "RequestError: temperature must be a number >= 0",
                "messages": "RequestError: messages must be a non-empty list",
                "detok": "GenerationError: setting up the detokenizer failed"}


def tiny(*args) -> list:
    """Engine flags for the tiny model (its context is 256 tokens)."""
    return ["--model", tiny_model(), "--device", "cpu", *args]


def batch_job(*args) -> subprocess.Popen:
    """`gristmill batch ARGS...` as a process of its own (stderr: a file, or nothing)."""
    return subprocess.Popen([sys.executable, "-m", "gristmill.cli", "batch", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """The mixed input, run once on a local engine; (result, output rows, errors rows)."""
    tmp = tmp_path_factory.mktemp("mixed")
    source = write_jsonl(tmp / "in.jsonl", MIXED)
    result = batch_main(source, "-o", tmp / "out.jsonl", "--errors", tmp / "errors.jsonl", *GREEDY,
                        "--device", "cpu", "--max-model-len", "512", "--batch-size", "3")
    assert result.returncode == 0, result.stderr
    return result, read_jsonl(tmp / "out.jsonl"), read_jsonl(tmp / "errors.jsonl")


def test_bad_rows_become_error_rows_and_the_errors_file_holds_exactly_them(mixed_run):
    result, out, errors = mixed_run
    assert [(row["__row_id__"], row["id"]) for row in out] == list(enumerate(row["id"] for row in MIXED))
    for row, given in zip(out, MIXED):
        assert {key: row[key] for key in given} == given  # the input row as it was, plus the outputs
        if given["id"] in MIXED_ERRORS:
            assert row[ERROR_COLUMN].startswith(MIXED_ERRORS[given["id"]]), row
            assert row["generated_text"] == "" and row["generated_tokens"] == [] and row["finish_reason"] == "error"
        else:
            assert row[ERROR_COLUMN] == "" and row["generated_text"] and row["num_generated_tokens"] > 0, row
    assert out[4]["num_generated_tokens"] == 3  # the row's own sampling_params beat --max-tokens
    assert [row["id"] for row in errors] == [row["id"] for row in MIXED if row["id"] in MIXED_ERRORS]
    for failed in errors:
        given = next(row for row in MIXED if row["id"] == failed["id"])
        assert failed == {**given, ERROR_COLUMN: failed[ERROR_COLUMN]}  # ready to run again as is
        assert failed[ERROR_COLUMN].startswith(MIXED_ERRORS[given["id"]])
    summary = result.stderr.strip().splitlines()[-1]
    assert "4 rows ok, 4 rows with errors" in summary and "rows/s" in summary and "generated tokens/s" in summary
    assert "out.jsonl" in summary and "Traceback" not in result.stderr


def test_fail_fast_stops_at_the_first_bad_row_in_input_order(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", MIXED)
    result = batch_main(source, "-o", tmp_path / "out.jsonl", *GREEDY, *tiny("--max-model-len", "256"),
                        "--fail-fast")
    assert result.returncode != 0
    assert "error: row 1: PromptTooLongError: prompt (" in result.stderr
    assert "1 row written to" in result.stderr and "--resume" in result.stderr
    assert "Traceback" not in result.stderr
    assert [row["id"] for row in read_jsonl(tmp_path / "out.jsonl")] == ["a"]


def test_csv_in_parquet_out_keeps_one_type_per_column(tmp_path):
    source = tmp_path / "in.csv"
    with open(source, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["qid", "question", "sampling_params"])
        writer.writerow([10, "The capital of France is", json.dumps({"max_tokens": 3})])
        writer.writerow([11, "A poem about the sea,\nin two lines:", ""])
        writer.writerow([12, "", ""])  # an empty prompt: an error row
    target = tmp_path / "out.parquet"
    result = batch_main(source, "-o", target, "--prompt-column", "question", "--id-column", "qid", *GREEDY,
                        "--device", "cpu")
    assert result.returncode == 0, result.stderr
    table = pq.read_table(target)
    assert table.column("qid").to_pylist() == ["10", "11", "12"] and "__row_id__" not in table.column_names
    types = {name: table.schema.field(name).type for name in table.column_names}
    assert types["generated_tokens"] == pa.list_(pa.int64()) and types["num_generated_tokens"] == pa.int64()
    assert types["time_taken_llm"] == pa.float64() and types[ERROR_COLUMN] == pa.string()
    rows = table.to_pylist()
    assert [row["num_generated_tokens"] for row in rows] == [3, 5, 0]  # row 10's JSON cell was read
    assert rows[1]["question"] == "A poem about the sea,\nin two lines:" and rows[1]["generated_text"]
    assert rows[2][ERROR_COLUMN].startswith("RequestError: prompt is empty") and rows[2]["generated_tokens"] == []


def test_openai_batch_file_gets_openai_batch_output_lines(tmp_path):
    def line(custom_id, url, body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    chat = "/v1/chat/completions"
    requests = [
        line("chat-1", chat, {"model": "any-name", "messages": [{"role": "user", "content": "Hi"}],
                              "max_completion_tokens": 4, "temperature": 0}),
        line("cmpl-1", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "seed": 3}),
        line("embed-1", "/v1/embeddings", {"model": "m", "input": "x"}),
        line("bad-1", chat, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}),
        line("detok-1", "/v1/completions", {"prompt": "BADROW", "max_tokens": 4}),
    ]
    source = write_jsonl(tmp_path / "batch.jsonl", requests)
    result = batch_main(source, "-o", tmp_path / "out.jsonl", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = {row["custom_id"]: row for row in read_jsonl(tmp_path / "out.jsonl")}
    assert list(out) == [r["custom_id"] for r in requests]
    assert all(row["id"].startswith("batch_req_") and row["error"] is None for row in out.values())
    assert {cid: row["response"]["status_code"] for cid, row in out.items()} == {
        "chat-1": 200, "cmpl-1": 200, "embed-1": 400, "bad-1": 400, "detok-1": 500}
    completion = openai.types.chat.ChatCompletion.model_validate(out["chat-1"]["response"]["body"])
    assert completion.model == "any-name" and completion.choices[0].message.content
    assert 0 < completion.usage.completion_tokens <= 4 and completion.usage.prompt_tokens > 0
    text = openai.types.Completion.model_validate(out["cmpl-1"]["response"]["body"])
    assert text.object == "text_completion" and text.choices[0].text and text.usage.prompt_tokens > 0
    errors = {cid: out[cid]["response"]["body"]["error"] for cid in ("embed-1", "bad-1", "detok-1")}
    assert all(set(e) == {"message", "type", "param", "code"} for e in errors.values())
    assert "url /v1/embeddings needs a job of task 'embed'" in errors["embed-1"]["message"]  # (a file of its own)
    assert errors["bad-1"]["type"] == "invalid_request_error" and "max_tokens" in errors["bad-1"]["message"]
    assert errors["detok-1"]["code"] == "GenerationError"

    (tmp_path / "broken.jsonl").write_text(json.dumps(requests[0]) + "\n" + '{"custom_id": "x", "url": "/v1/co\n')
    broken = batch_main(tmp_path / "broken.jsonl", "-o", tmp_path / "never.jsonl")
    assert broken.returncode != 0 and f"{tmp_path / 'broken.jsonl'}:2: not valid JSON" in broken.stderr
    assert "Traceback" not in broken.stderr and not (tmp_path / "never.jsonl").exists()


def rows_with_a_slow_tail(n: int) -> list[dict]:
    """`n` rows: the first 10 ask for 4 tokens, the others for 120, so that a job writes its
    first rows at once and is still at work seconds later, whenever the signal comes (the
    tiny model is quick: rows of 4 tokens only would all be done before it)."""
    return [{"prompt": f"Story {i}: once upon a time",
             "sampling_params": {"max_tokens": 4 if i < 10 else 120, "ignore_eos": True}} for i in range(n)]


def wait_for_rows(job: subprocess.Popen, target, n: int) -> None:
    deadline = time.monotonic() + 240
    while not (target.exists() and len(target.read_bytes().splitlines()) >= n):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before the signal"
        time.sleep(0.05)


def test_a_job_killed_with_sigkill_resumes_to_each_row_exactly_once_in_order(tmp_path):
    rows = rows_with_a_slow_tail(60)
    rows[2] = {"prompt": "y", "sampling_params": {"top_p": 0}}   # written before the kill
    rows[30] = {"prompt": "x", "sampling_params": {"top_p": 5}}  # most likely written after it
    source, target, errors = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    command = [source, "-o", target, "--errors", errors, "--batch-size", "4", "--temperature", "0", *tiny()]
    job = batch_job(*command)
    try:
        wait_for_rows(job, target, 8)
        cores = core_children(job.pid)
        job.send_signal(signal.SIGKILL)
        job.wait()
    finally:
        job.kill()
    assert cores and _gone_within(cores, 10)  # the engine core exits by itself when its client dies
    kept = [json.loads(line) for line in target.read_bytes().split(b"\n")[:-1]]  # the kill may have cut the last
    assert 8 <= len(kept) < 60
    with open(target, "a") as f:
        f.write('{"__row_id__": %d, "prompt": "Story' % len(kept))  # a kill in the middle of a line
    result = batch_main(*command, "--resume")  # (the resumed job: what it writes is the point, run here)
    assert result.returncode == 0, result.stderr
    out = read_jsonl(target)
    assert [row["__row_id__"] for row in out] == list(range(60))
    assert out[:len(kept)] == kept  # the rows already there were kept, not run again
    assert [row["__row_id__"] for row in out if row[ERROR_COLUMN]] == [2, 30]
    assert [row["prompt"] for row in read_jsonl(errors)] == ["y", "x"]
    assert f"({len(kept)} of them kept from before --resume)" in result.stderr


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_job_stopped_by_a_signal_says_how_to_resume_and_exits_128_plus_the_signal(tmp_path, sig, code):
    """SIGTERM (a scheduler stopping the job) ends it as Ctrl-C does: the rows written so far
    are whole lines, the last line says how to go on, naming the output, the exit code is
    128 + the signal's number, and --resume then runs each row exactly once, in order. The
    engine shut down under the rows in flight is no death to report or restart from."""
    rows = rows_with_a_slow_tail(40)
    source, target = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    command = [source, "-o", target, "--batch-size", "4", "--temperature", "0", *tiny(),
               "--max-engine-restarts", "1"]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        job = subprocess.Popen([sys.executable, "-m", "gristmill.cli", "batch", *map(str, command)],
                               stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for_rows(job, target, 8)
        cores = core_children(job.pid)
        job.send_signal(sig)
        assert job.wait(60) == code
    finally:
        job.kill()
    assert cores and _gone_within(cores, 10)
    kept = read_jsonl(target)  # (every line whole: json.loads reads each)
    assert 8 <= len(kept) < 40 and target.read_bytes().endswith(b"\n")
    stderr = (tmp_path / "stderr.txt").read_text()
    last = stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert last == f"interrupted, resume with --resume: {len(kept)} rows written to {target}"
    assert "Traceback" not in stderr and "engine died" not in stderr, stderr[-2000:]
    if sig == signal.SIGTERM:
        result = batch_main(*command, "--resume")
        assert result.returncode == 0, result.stderr
        assert [row["__row_id__"] for row in read_jsonl(target)] == list(range(40))
        assert read_jsonl(target)[:len(kept)] == kept


def test_deployment_url_gives_the_texts_of_the_local_engine(mixed_run, tmp_path):
    _, local, _ = mixed_run
    server = Server("--max-model-len", "512")
    try:
        source = write_jsonl(tmp_path / "in.jsonl", MIXED)
        result = batch_main(source, "-o", tmp_path / "out.jsonl", *GREEDY, "--deployment-url", server.url,
                            "--max-model-len", "512", "--concurrency", "2")
        assert result.returncode == 0, result.stderr
        assert ("warning: engine flags (--max-model-len, --concurrency) configure a local engine and are ignored "
                "with --deployment-url") in result.stderr
    finally:
        server.stop()
    remote = read_jsonl(tmp_path / "out.jsonl")
    assert [row["id"] for row in remote] == [row["id"] for row in MIXED]
    good = [i for i, row in enumerate(local) if not row[ERROR_COLUMN]]
    assert len(good) == 4
    assert [remote[i]["generated_text"] for i in good] == [local[i]["generated_text"] for i in good]
    # The server returns the token ids (return_token_ids): the rows' generated_tokens, as local.
    assert [remote[i]["generated_tokens"] for i in good] == [local[i]["generated_tokens"] for i in good]
    assert all(remote[i]["generated_tokens"] for i in good)
    assert remote[1][ERROR_COLUMN].startswith("RequestError: HTTP 400 from ")  # the too-long prompt


def test_batch_takes_every_engine_flag_and_checks_its_own_flags(tmp_path):
    args = build_parser().parse_args(["batch", "in.jsonl", "-o", "out.jsonl", "--max-model-len", "64",
                                      "--engine-seed", "5"])
    config = engine_config(args)
    assert (config.max_model_len, config.seed) == (64, 5)
    source = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    for flags, says in [(["-o", tmp_path / "out.parquet", "--resume"], "--resume needs a .jsonl or .csv output"),
                        (["-o", tmp_path / "out.jsonl", "--batch-size", "0"], "batch_size: must be a positive"),
                        (["-o", tmp_path / "out.txt"], "name it .jsonl, .csv or .parquet"),
                        (["-o", tmp_path / "out.jsonl", "--repetition-penalty", "0"], "(flag --repetition-penalty)")]:
        result = batch_main(source, *flags)
        assert result.returncode != 0 and says in result.stderr and "Traceback" not in result.stderr


def test_resume_reads_csv_records_back_and_cuts_off_a_torn_one(tmp_path):
    target = str(tmp_path / "out.csv")
    writer = CsvWriter(target, ["__row_id__", "generated_text", ERROR_COLUMN])
    for i in range(3):
        writer.write({"__row_id__": i, "generated_text": f"line one\nline, \"two\" of row {i}", ERROR_COLUMN: ""})
    writer.close()
    whole = open(target, "rb").read()
    with open(target, "a") as f:
        f.write('3,"line one\n')  # killed right after a newline inside a quoted field
    header, written, end = read_written(target, "csv", lambda r: (r["__row_id__"], r["generated_text"]))
    assert header == ["__row_id__", "generated_text", ERROR_COLUMN]
    assert written == [(str(i), f"line one\nline, \"two\" of row {i}") for i in range(3)]
    assert open(target, "rb").read() != whole  # (reading cuts nothing: the job cuts, once it resumes)
    cut_at(target, end)
    assert open(target, "rb").read() == whole


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(process_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_json_schema_constrains_every_row_and_a_rows_own_constraint_wins(tmp_path):
    """Constraining works on any model: the tiny one's documents parse and hold to the
    schema as the bundled model's would."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    rows = [{"id": "a", "prompt": "What is the capital of France? Reply in JSON:"},
            {"id": "b", "messages": [{"role": "user", "content": "Name a color, as JSON."}]},
            {"id": "own", "prompt": "Is water wet?", "sampling_params": {"structured_output": {"choice": ["yes", "no"]}}},
            {"id": "bad", "prompt": "x", "sampling_params": {"structured_output": {"regex": "[0-9"}}},
            {"id": "free", "prompt": "The capital of France is",
             "sampling_params": {"structured_output": False, "max_tokens": 5}}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    result = batch_main(source, "-o", tmp_path / "out.jsonl", "--json-schema", tmp_path / "schema.json",
                        "--temperature", "0", "--max-tokens", "40", *tiny("--max-model-len", "256"))
    assert result.returncode == 0, result.stderr
    out = {row["id"]: row for row in read_jsonl(tmp_path / "out.jsonl")}
    for row_id in ("a", "b"):
        assert out[row_id]["finish_reason"] == "stop", out[row_id]
        value = json.loads(out[row_id]["generated_text"])
        assert list(value) == ["answer"] and isinstance(value["answer"], str) and len(value["answer"]) <= 12
    assert out["own"]["generated_text"] in ("yes", "no") and out["own"][ERROR_COLUMN] == ""
    assert out["bad"][ERROR_COLUMN].startswith("RequestError: structured_output.regex is not valid")
    # A row that opts out runs free: the same text as the model's unconstrained greedy answer.
    free = batch_main(write_jsonl(tmp_path / "free.jsonl", [rows[-1]]), "-o", tmp_path / "free_out.jsonl",
                      "--temperature", "0", "--max-tokens", "40", *tiny("--max-model-len", "256"))
    assert free.returncode == 0, free.stderr
    [unconstrained] = read_jsonl(tmp_path / "free_out.jsonl")
    assert out["free"][ERROR_COLUMN] == "" and out["free"]["generated_text"] == unconstrained["generated_text"]
    assert out["free"]["generated_tokens"] == unconstrained["generated_tokens"] != []
    assert not out["free"]["generated_text"].lstrip().startswith("{")
    # A schema file that is not one is refused before any engine starts.
    (tmp_path / "broken.json").write_text("{not json")
    refused = batch_main(source, "-o", tmp_path / "out2.jsonl", "--json-schema", tmp_path / "broken.json")
    assert refused.returncode != 0 and "--json-schema" in refused.stderr and "is not JSON" in refused.stderr
    assert "Traceback" not in refused.stderr
