"""200 rows mixing a nested JSON schema, a regex (a date), a choice list and unconstrained
rows on the real bundled model, through every face: LLM.generate and the server with the
real openai client (`response_format` json_schema, `structured_outputs`) take all 200;
`gristmill batch` with `--json-schema` and an OpenAI Batch file take the first 48 (12 of
each kind, in batches of 16: each row costs a face the same decoding, and what a batch
face adds is the translation of each row's fields, the same for every row of a kind).
Every constrained output that finished with "stop" validates (jsonschema), matches its
regex or is one of the choices; the unconstrained rows give the same text as without
the feature; every face gives the texts LLM.generate gives."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from gristmill import SamplingParams
from tests.batch.inprocess import batch_main
from tests.batch.test_cli_batch import read_jsonl, write_jsonl
from tests.server.conftest import API_KEY

MODEL = "gemma-3-270m"
CUSTOMER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "status": {"enum": ["active", "inactive", "banned"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "status", "age", "tags", "address"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
MOODS = ["positive", "negative", "neutral"]
KINDS = ("json", "regex", "choice", "free")
N = 200
N_BATCH = 48  # the rows the two batch-file faces take


def _row(i: int) -> tuple[str, str, dict | None, int]:
    """(kind, prompt, structured_output, max_tokens) of row i."""
    kind = KINDS[i % 4]
    if kind == "json":
        return kind, f"Customer record {i}. The customer, as JSON:", {"json": CUSTOMER}, 80
    if kind == "regex":
        return kind, f"Event {i} took place on (YYYY-MM-DD):", {"regex": DATE}, 16
    if kind == "choice":
        return kind, f"Review {i}: \"I {'loved' if i % 3 else 'hated'} it.\" Sentiment:", {"choice": MOODS}, 8
    return kind, f"Story {i}: once upon a time", None, 12


ROWS = [_row(i) for i in range(N)]


def _check(kind: str, text: str, finish_reason: str) -> bool:
    """Whether a finished constrained text meets its constraint (asserted); False when it
    was cut off by max_tokens."""
    if finish_reason != "stop":
        assert finish_reason == "length", finish_reason
        return False
    if kind == "json":
        jsonschema.validate(json.loads(text), CUSTOMER)
    elif kind == "regex":
        assert re.fullmatch(DATE, text), text
    elif kind == "choice":
        assert text in MOODS, text
    return True


@pytest.fixture(scope="module")
def generated(default_llm):
    """The 200 rows through LLM.generate: their RequestOutputs."""
    params = [SamplingParams(max_tokens=m, temperature=0, structured_output=so) for _, _, so, m in ROWS]
    return default_llm.generate([p for _, p, _, _ in ROWS], params, use_tqdm=False)


@pytest.fixture(scope="module")
def offline(generated):
    """What every other face must give: (text, finish reason) by row."""
    return [(o.text, o.finish_reason) for o in generated]


def test_llm_generate(generated, default_llm):
    finished = sum(_check(kind, o.text, o.finish_reason) for (kind, *_), o in zip(ROWS, generated) if kind != "free")
    assert finished >= 0.9 * (3 * N // 4), f"only {finished} constrained rows finished with stop"
    # Unconstrained rows: the same tokens as a run without any constraint in the batch.
    free = [i for i, (kind, *_) in enumerate(ROWS) if kind == "free"]
    alone = default_llm.generate([ROWS[i][1] for i in free], SamplingParams(max_tokens=12, temperature=0),
                                 use_tqdm=False)
    assert [generated[i].token_ids for i in free] == [o.token_ids for o in alone]


def test_the_server_with_the_openai_client(offline, server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    def one(i):
        kind, prompt, structured, max_tokens = ROWS[i]
        extra = {}  # (the client's completions method has no response_format argument: it goes as a body field)
        if kind == "json":
            extra["response_format"] = {"type": "json_schema",
                                        "json_schema": {"name": "customer", "schema": CUSTOMER, "strict": True}}
        elif structured is not None:
            extra["structured_outputs"] = structured
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body=extra).choices[0]
        return choice.text, choice.finish_reason

    with ThreadPoolExecutor(32) as pool:
        served = list(pool.map(one, range(N)))
    for (kind, *_), (text, reason) in zip(ROWS, served):
        if kind != "free":
            _check(kind, text, reason)
    assert served == offline


def test_gristmill_batch_with_json_schema(offline, tmp_path):
    (tmp_path / "customer.json").write_text(json.dumps(CUSTOMER))
    # --json-schema applies to every row without a constraint of its own (a row's own wins),
    # so the unconstrained rows are left out of this face.
    rows = []
    for i, (kind, prompt, structured, max_tokens) in enumerate(ROWS[:N_BATCH]):
        params = {"max_tokens": max_tokens}
        if kind != "free":
            if kind != "json":
                params["structured_output"] = structured
            rows.append({"id": i, "prompt": prompt, "sampling_params": params})
    constrained = [row["id"] for row in rows]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    result = batch_main(source, "-o", tmp_path / "out.jsonl", "--json-schema", tmp_path / "customer.json",
                        "--temperature", "0", "--device", "cpu", "--batch-size", "16")
    assert result.returncode == 0, result.stderr
    out = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda row: row["id"])
    assert [row["id"] for row in out] == constrained
    assert all(row["__inference_error__"] == "" for row in out)
    assert [(row["generated_text"], row["finish_reason"]) for row in out] == [offline[i] for i in constrained]


def test_an_openai_batch_file(offline, tmp_path):
    lines = []
    for i, (kind, prompt, structured, max_tokens) in enumerate(ROWS[:N_BATCH]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "c", "schema": CUSTOMER}}
        elif structured is not None:
            body["structured_outputs"] = structured
        lines.append({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    source = write_jsonl(tmp_path / "batch.jsonl", lines)
    result = batch_main(source, "-o", tmp_path / "results.jsonl", "--device", "cpu", "--batch-size", "16")
    assert result.returncode == 0, result.stderr
    by_id = {line["custom_id"]: line for line in read_jsonl(tmp_path / "results.jsonl")}
    assert len(by_id) == N_BATCH
    got = []
    for i in range(N_BATCH):
        line = by_id[f"row-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        choice = line["response"]["body"]["choices"][0]
        got.append((choice["text"], choice["finish_reason"]))
    assert got == offline[:N_BATCH]
