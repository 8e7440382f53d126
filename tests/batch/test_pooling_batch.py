"""Batch jobs that pool instead of generating (task embed, classify, score), on the tiny
random-weight pooling models: `gristmill batch --task ...` on Parquet, JSONL and OpenAI
batch files, a job killed and resumed, the HTTP processor against an in-process server,
and an engine that dies under a pooling job. The package's GRISTMILL_FAULTS reach the
engines: a prompt holding POISON makes the engine core exit."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gristmill import EngineConfig, EngineDeadError
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, HttpProcessorConfig, build_processor
from gristmill.errors import RequestError
from tests.batch.inprocess import batch_main, without_faults
from tests.harness import core_children, process_gone
from tests.pooling_models import tiny_classifier, tiny_embedder

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Embeddings turn text into vectors of numbers.",
         "ok", "A longer sentence, with commas, numbers like 42 and 3.14, and rarer words: antidisestablishment."]


def float_engine(model) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", quantization=None)


def model_flags(model) -> list:
    return ["--model", model, "--device", "cpu", "--quantization", "none"]


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def reference():
    """LLM.embed's embedding of each of TEXTS (the float path)."""
    from gristmill import LLM

    llm = LLM(str(tiny_embedder()), device="cpu", quantization=None)
    return {text: out.outputs.embedding for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False))}


def test_batch_task_embed_on_parquet_writes_float32_embeddings_matching_llm_embed(tmp_path, reference):
    rows = [{"prompt": text, "sampling_params": None, "pooling_params": None} for text in TEXTS]
    rows.insert(2, {"prompt": "word " * 400, "sampling_params": None, "pooling_params": None})  # > 128 positions
    rows.insert(4, {"prompt": "x", "sampling_params": {"max_tokens": 3}, "pooling_params": None})
    rows.insert(5, {"prompt": "cut " * 400, "sampling_params": None, "pooling_params": {"truncate_prompt_tokens": 16}})
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    result = batch_main(source, "-o", tmp_path / "out.parquet", "--task", "embed", *model_flags(tiny_embedder()),
                        "--batch-size", "3")
    assert result.returncode == 0, result.stderr
    assert "6 rows ok, 2 rows with errors" in result.stderr and "input tokens/s" in result.stderr
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("embeddings").type == pa.list_(pa.float32())
    assert table.schema.field("num_input_tokens").type == pa.int64()
    assert "generated_text" not in table.column_names
    out = table.to_pylist()
    assert [row["__row_id__"] for row in out] == list(range(8))
    errors = {row["__row_id__"]: row[ERROR_COLUMN] for row in out if row[ERROR_COLUMN]}
    assert list(errors) == [2, 4]
    assert errors[2].startswith("PromptTooLongError") and "truncate_prompt_tokens" in errors[2]
    assert errors[4].startswith("RequestError: the row has sampling_params") and "pooling_params" in errors[4]
    assert all(out[i]["embeddings"] == [] and out[i]["num_input_tokens"] == 0 for i in errors)
    assert out[5]["num_input_tokens"] == 16 and len(out[5]["embeddings"]) == 32
    for row in out:
        if row["prompt"] in reference:
            assert cosine(row["embeddings"], reference[row["prompt"]]) >= 0.99999
            assert row["time_taken_llm"] > 0


def test_classify_and_score_rows_write_jsonl_lists_and_floats(tmp_path):
    rows = [{"prompt": text} for text in TEXTS[:3]] + [{"messages": [{"role": "user", "content": "hi"}]},
                                                       {"prompt": "y", "pooling_params": {"dimensions": 4}}]
    result = batch_main(write_jsonl(tmp_path / "in.jsonl", rows), "-o", tmp_path / "probs.jsonl", "--task", "classify",
                        *model_flags(tiny_classifier(3)))
    assert result.returncode == 0, result.stderr
    out = read_jsonl(tmp_path / "probs.jsonl")
    assert all(len(row["probs"]) == 3 and abs(sum(row["probs"]) - 1) < 1e-5 for row in out[:3])
    assert [bool(row[ERROR_COLUMN]) for row in out] == [False, False, False, True, True]
    assert "not 'messages'" in out[3][ERROR_COLUMN] and out[3]["probs"] == []
    assert "dimensions" in out[4][ERROR_COLUMN]

    pairs = [{"text_1": "What is the capital of France?", "text_2": "Paris is the capital of France."},
             {"text_1": "a", "text_2": "b", "pooling_params": {"use_activation": False}},
             {"prompt": "a score row without its pair"}]
    result = batch_main(write_jsonl(tmp_path / "pairs.jsonl", pairs), "-o", tmp_path / "scores.jsonl",
                        "--task", "score", *model_flags(tiny_classifier(1)))
    assert result.returncode == 0, result.stderr
    out = read_jsonl(tmp_path / "scores.jsonl")
    assert 0 < out[0]["score"] < 1 and isinstance(out[1]["score"], float)
    assert out[2]["score"] == 0.0 and "needs 'text_1' and 'text_2'" in out[2][ERROR_COLUMN]


def test_score_by_an_embedding_model_is_the_cosine_of_llm_embed(reference):
    config = EngineProcessorConfig(engine=float_engine(tiny_embedder()), task="score")
    assert config.engine.task == "score"
    out = build_processor(config)([{"text_1": TEXTS[0], "text_2": TEXTS[2]}, {"text_1": TEXTS[1], "text_2": TEXTS[1]}])
    assert abs(out[0]["score"] - cosine(reference[TEXTS[0]], reference[TEXTS[2]])) < 1e-5
    assert abs(out[1]["score"] - 1) < 1e-5 and out[0][ERROR_COLUMN] == ""


def test_processor_configs_refuse_what_a_task_cannot_use():
    with pytest.raises(RequestError, match="task 'embed' but its engine's EngineConfig.task is 'generate'") as exc:
        EngineProcessorConfig(engine=EngineConfig(task="generate"), task="embed")
    assert exc.value.param == "task"
    for kwargs, param in [(dict(task="embed", sampling_params={"max_tokens": 3}), "sampling_params"),
                          (dict(pooling_params={"normalize": False}), "pooling_params"),
                          (dict(task="embed", pooling_params={"bogus": 1}), "pooling_params"),
                          (dict(task="classify", generate=False), "generate"),
                          (dict(task="nope"), "task")]:
        with pytest.raises(RequestError) as exc:
            EngineProcessorConfig(**kwargs)
        assert exc.value.param == param, kwargs
    assert HttpProcessorConfig(url="http://127.0.0.1:1/v1", task="embed").task == "embed"
    with pytest.raises(RequestError, match="takes no method"):
        HttpProcessorConfig(url="http://127.0.0.1:1/v1", task="embed", method="chat")


def test_a_generating_job_refuses_a_rows_pooling_params_naming_the_task(tmp_path):
    from tests.batch.inprocess import tiny_model

    rows = [{"prompt": "a", "sampling_params": {"max_tokens": 2}}, {"prompt": "b", "pooling_params": {"normalize": 1}}]
    result = batch_main(write_jsonl(tmp_path / "in.jsonl", rows), "-o", tmp_path / "out.jsonl", "--model",
                        tiny_model(), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = read_jsonl(tmp_path / "out.jsonl")
    assert out[0][ERROR_COLUMN] == "" and "generated_text" in out[0]
    assert out[1][ERROR_COLUMN].startswith("RequestError: the row has pooling_params")
    assert "task 'generate'" in out[1][ERROR_COLUMN]
    flags = batch_main(write_jsonl(tmp_path / "in2.jsonl", rows), "-o", tmp_path / "o2.jsonl", "--task", "embed",
                       "--max-tokens", "3", *model_flags(tiny_embedder()))
    assert flags.returncode != 0 and "--max-tokens set how rows generate" in flags.stderr
    assert not (tmp_path / "o2.jsonl").exists()


def test_an_openai_batch_file_of_embeddings_lines_gets_embeddings_responses(tmp_path, reference):
    def line(custom_id, body, url="/v1/embeddings"):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "tiny", **body}}

    lines = [line("text", {"input": TEXTS[0]}),
             line("in-a-list", {"input": [TEXTS[2]], "encoding_format": "base64"}),
             line("two", {"input": [TEXTS[0], TEXTS[1]], "encoding_format": "base64"}),
             line("two-one-too-long", {"input": [TEXTS[1], "word " * 400]}),
             line("bad-input", {"input": [TEXTS[1], 7]}),
             line("chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
             line("cut", {"input": "word " * 400, "truncate_prompt_tokens": 10})]
    result = batch_main(write_jsonl(tmp_path / "batch.jsonl", lines), "-o", tmp_path / "out.jsonl",
                        *model_flags(tiny_embedder()))
    assert result.returncode == 0, result.stderr
    out = {row["custom_id"]: row["response"] for row in read_jsonl(tmp_path / "out.jsonl")}
    assert list(out) == ["text", "in-a-list", "two", "two-one-too-long", "bad-input", "chat", "cut"]
    body = out["text"]["body"]
    assert out["text"]["status_code"] == 200 and body["object"] == "list" and body["model"] == "tiny"
    assert body["data"][0]["object"] == "embedding" and body["usage"]["prompt_tokens"] > 0
    assert cosine(body["data"][0]["embedding"], reference[TEXTS[0]]) >= 0.99999
    packed = np.frombuffer(base64.b64decode(out["in-a-list"]["body"]["data"][0]["embedding"]), dtype="<f4")
    assert cosine(packed, reference[TEXTS[2]]) >= 0.99999
    # A line of several inputs: one response with a vector each, in order; one bad input fails the line.
    two = out["two"]["body"]
    assert out["two"]["status_code"] == 200 and [d["index"] for d in two["data"]] == [0, 1]
    for d, text in zip(two["data"], TEXTS):
        assert cosine(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4"), reference[text]) >= 0.99999
    assert two["usage"]["prompt_tokens"] > body["usage"]["prompt_tokens"]
    assert out["two-one-too-long"]["status_code"] == 400
    assert "PromptTooLongError" == out["two-one-too-long"]["body"]["error"]["code"]
    assert out["bad-input"]["status_code"] == 400 and "body.input must be" in out["bad-input"]["body"]["error"]["message"]
    assert out["chat"]["status_code"] == 400 and "task 'generate'" in out["chat"]["body"]["error"]["message"]
    assert out["cut"]["status_code"] == 200 and out["cut"]["body"]["usage"]["prompt_tokens"] == 10
    # Resumed after the first three lines (the line of two inputs among them): each line
    # once more, in order, the lines of several inputs whole.
    whole = read_jsonl(tmp_path / "out.jsonl")
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(line) + "\n" for line in whole[:3]))
    again = batch_main(write_jsonl(tmp_path / "batch.jsonl", lines), "-o", tmp_path / "out.jsonl",
                       *model_flags(tiny_embedder()), "--resume")
    assert again.returncode == 0, again.stderr
    assert "(3 of them kept from before --resume)" in again.stderr
    resumed = read_jsonl(tmp_path / "out.jsonl")
    assert resumed[:3] == whole[:3]
    assert [(r["custom_id"], r["response"]["status_code"], len(r["response"]["body"].get("data", ())))
            for r in resumed] == [(r["custom_id"], r["response"]["status_code"], len(r["response"]["body"].get("data", ())))
                                  for r in whole]


def test_http_processor_task_embed_against_a_served_embedder_matches_the_local_rows(reference):
    from tests.server.conftest import AppServer, ServerLoop, start_engine

    loop = ServerLoop()
    flags = ("--model", str(tiny_embedder()), "--quantization", "none")
    engine = start_engine(*flags)
    server = AppServer(loop, engine, *flags, model=tiny_embedder().name)
    try:
        rows = [{"prompt": text} for text in TEXTS] + [{"prompt": "word " * 400}, {"prompt": "n", "pooling_params": {
            "normalize": False}}, {"prompt": "c", "pooling_params": {"use_activation": True}}]
        config = HttpProcessorConfig(url=f"{server.url}/v1", task="embed", should_continue_on_error=True)
        out = build_processor(config)(rows)
    finally:
        server.stop()
        engine.shutdown()
        loop.close()
    for row, text in zip(out, TEXTS):
        assert row[ERROR_COLUMN] == "" and cosine(row["embeddings"], reference[text]) >= 0.99999
        assert row["num_input_tokens"] > 0
    long_row, raw, misplaced = out[len(TEXTS):]
    assert long_row[ERROR_COLUMN].startswith("RequestError: HTTP 400") and long_row["embeddings"] == []
    assert raw[ERROR_COLUMN] == "" and abs(np.linalg.norm(raw["embeddings"]) - 1) > 1e-3
    assert "use_activation does not apply to task 'embed'" in misplaced[ERROR_COLUMN]


def test_an_engine_death_ends_a_pooling_job_fast_or_sets_the_poison_row_aside():
    rows = [{"id": i, "prompt": f"row {i}: {TEXTS[i % len(TEXTS)]}"} for i in range(12)]
    rows[7]["prompt"] = "POISON " + rows[7]["prompt"]
    engine = float_engine(tiny_embedder())
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="exited with code 17"):
        build_processor(EngineProcessorConfig(engine=engine, task="embed", batch_size=4,
                                              should_continue_on_error=True))(rows)
    assert time.monotonic() - started < 60  # (an engine start and a few steps: no waiting on a timeout)
    out = build_processor(EngineProcessorConfig(engine=engine, task="embed", batch_size=4, max_engine_restarts=1,
                                                should_continue_on_error=True))(rows)
    assert [row["id"] for row in out] == list(range(12))
    errors = {row["id"]: row[ERROR_COLUMN] for row in out if row[ERROR_COLUMN]}
    assert list(errors) == [7] and errors[7].startswith("EngineDeadError: row 7 killed the engine each time")
    assert all(len(row["embeddings"]) == 32 for row in out if row["id"] != 7)


def test_an_embed_job_killed_and_resumed_writes_every_row_once(tmp_path):
    """The job runs as a process of its own; the row marked HANG stops its engine (the
    core_hang fault), so it is killed with the rows before it written. The resumed job
    (no fault) writes the rest: every row once, in order."""
    rows = [{"prompt": f"row {i}: {TEXTS[i % len(TEXTS)]}"} for i in range(40)]
    rows[3]["pooling_params"] = {"dimensions": 4}  # an error row written before the kill
    rows[24]["prompt"] = "HANG " + rows[24]["prompt"]
    source, target = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    command = [source, "-o", target, "--task", "embed", "--batch-size", "4", *model_flags(tiny_embedder())]
    env = {**without_faults(), "GRISTMILL_FAULTS": "core_hang@prompt~HANG"}
    job = subprocess.Popen([sys.executable, "-m", "gristmill.cli", "batch", *map(str, command)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cores = []
    try:
        deadline = time.monotonic() + 240
        while not (target.exists() and len(target.read_bytes().splitlines()) >= 8):
            assert job.poll() is None and time.monotonic() < deadline, "the job ended before the kill"
            time.sleep(0.05)
        cores = core_children(job.pid)
        job.send_signal(signal.SIGKILL)
        job.wait()
    finally:
        job.kill()
        for pid in cores:  # a hung core may outlive its client for a while
            if not process_gone(pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
    kept = [json.loads(line) for line in target.read_bytes().split(b"\n")[:-1]]
    assert 8 <= len(kept) <= 24
    result = batch_main(*command, "--resume", env=without_faults())
    assert result.returncode == 0, result.stderr
    out = read_jsonl(target)
    assert [row["__row_id__"] for row in out] == list(range(40))
    assert out[:len(kept)] == kept
    assert [row["__row_id__"] for row in out if row[ERROR_COLUMN]] == [3]
    assert all(len(row["embeddings"]) == 32 for row in out if not row[ERROR_COLUMN])
    assert f"({len(kept)} of them kept from before --resume)" in result.stderr


def test_the_bundled_embedding_model_named_alone_makes_an_embed_job(tmp_path):
    # No --task: the job's task is the model's, also when the model is named, not a path.
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": text} for text in TEXTS[:2]])
    result = batch_main(source, "-o", tmp_path / "out.jsonl", "--model", "all-MiniLM-L6-v2", "--device", "cpu",
                        "--quantization", "none")
    assert result.returncode == 0, result.stderr
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [len(row["embeddings"]) for row in out] == [384, 384] and all(not row[ERROR_COLUMN] for row in out)
    assert abs(np.linalg.norm(out[0]["embeddings"]) - 1) < 1e-5
