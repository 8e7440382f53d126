"""Files of `gristmill batch`: JSONL, CSV and Parquet read lazily and written as rows come,
the rows an interrupted job already wrote (for --resume), and OpenAI Batch API files as
`vllm run-batch` reads them.

pyarrow is imported inside functions: `gristmill --help` should not pay for it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gristmill.errors import GristmillError, RequestError
from gristmill.structured.spec import openai_constraint

_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
_SCAN_ROWS = 1024  # rows per chunk when pyarrow infers the types of a JSONL file


class InputError(Exception):
    """A problem with a file or flag the user can fix; the message says how."""


def file_format(path: str, role: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMATS:
        raise InputError(f"{role} {path}: unknown file type {suffix or '(none)'!r}; name it .jsonl, .csv "
                         f"or .parquet")
    return _FORMATS[suffix]


@dataclass
class Survey:
    """What one pass over the input found, before any row is generated."""

    count: int | None
    #: Column names in first-seen order.
    columns: list[str]
    #: Column types (None unless asked for).
    schema: object | None


class InputFile:
    def __init__(self, path: str):
        self.path = str(path)
        self.format = file_format(self.path, "input")
        if not os.path.isfile(self.path):
            raise InputError(f"input {self.path} does not exist; pass a .jsonl, .csv or .parquet file")

    def rows(self) -> Iterator[dict]:
        """The rows as read, lazily: JSONL line by line, CSV and Parquet by record batches."""
        if self.format == "jsonl":
            return (row for _, row in self._jsonl())
        return self._arrow_rows()

    def first_row(self) -> dict | None:
        try:
            return next(self.rows(), None)
        except InputError:
            return None  # the full pass reports it with its line number

    def survey(self, check: Callable[[dict, str], None] | None = None, types: bool = False) -> Survey:
        """Count the rows and find the columns (and their types if `types`); `check(row,
        where)` sees each JSONL row, so a bad line stops the job before the model loads."""
        import pyarrow as pa

        if self.format == "parquet":
            import pyarrow.parquet as pq
            meta = pq.ParquetFile(self.path)
            return Survey(meta.metadata.num_rows, meta.schema_arrow.names, meta.schema_arrow)
        if self.format == "csv":
            count, schema = 0, None
            for batch in self._csv_batches():
                count, schema = count + batch.num_rows, batch.schema
            return Survey(count, schema.names if schema else [], schema)
        count, columns, schemas, chunk = 0, {}, [], []
        for where, row in self._jsonl():
            if check is not None:
                check(row, where)
            count += 1
            columns.update(dict.fromkeys(row))
            if types:
                chunk.append(row)
                if len(chunk) == _SCAN_ROWS:
                    schemas.append(_inferred(chunk, self.path))
                    chunk = []
        if types and chunk:
            schemas.append(_inferred(chunk, self.path))
        schema = (_unified(schemas, self.path) if schemas else pa.schema([])) if types else None
        return Survey(count, list(columns), schema)

    def _jsonl(self) -> Iterator[tuple[str, dict]]:
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield f"{self.path}:{number}", parse_json_object(line, f"{self.path}:{number}")

    def _arrow_rows(self) -> Iterator[dict]:
        if self.format == "csv":
            batches = self._csv_batches()
        else:
            import pyarrow.parquet as pq
            batches = pq.ParquetFile(self.path).iter_batches(batch_size=_SCAN_ROWS)
        for batch in batches:
            yield from batch.to_pylist()

    def _csv_batches(self):
        import pyarrow as pa
        import pyarrow.csv as pacsv

        try:
            reader = pacsv.open_csv(self.path)
            while True:
                try:
                    yield reader.read_next_batch()
                except StopIteration:
                    return
        except pa.ArrowInvalid as exc:
            raise InputError(f"{self.path}: cannot read it as CSV ({exc}); pyarrow types each column from "
                             f"the file's first rows, so a later value of another type fails: make the "
                             f"column's values one type, or convert the file to JSONL") from None


def parse_json_object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc}); each line must be one JSON object") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: each line must be a JSON object (a row), got {type(row).__name__}")
    return row


def _inferred(rows: list[dict], path: str):
    import pyarrow as pa

    try:
        return pa.Table.from_pylist(rows).schema
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"{path}: a column holds values of different types ({exc}); Parquet needs one type "
                         f"per column: fix the input or write .jsonl output") from None


def _unified(schemas: list, path: str):
    import pyarrow as pa

    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"{path}: a column holds values of different types ({exc}); Parquet needs one type "
                         f"per column: fix the input or write .jsonl output") from None


# -- writing -----------------------------------------------------------------------------

def cell_text(value) -> str:
    """A value as a CSV cell: lists and objects (generated_tokens, messages) as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def id_key(output_format: str, value) -> str:
    """A row id as the output file holds it, so ids read back compare equal to the input's."""
    if output_format == "csv":
        return cell_text(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


class JsonlWriter:
    def __init__(self, path: str, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class CsvWriter:
    def __init__(self, path: str, columns: list[str], append: bool = False):
        fresh = not append or not os.path.exists(path) or os.path.getsize(path) == 0
        self.columns = columns
        self.file = open(path, "a" if append else "w", encoding="utf-8", newline="")
        # "\n" ends a record; resume reads records back by the same rule.
        self.writer = csv.writer(self.file, lineterminator="\n")
        if fresh:
            self.writer.writerow(columns)

    def write(self, record: dict) -> None:
        self.writer.writerow([cell_text(record.get(c)) for c in self.columns])

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ParquetWriter:
    """One row group per flush, every group with the schema given up front."""

    def __init__(self, path: str, schema):
        import pyarrow.parquet as pq

        self.schema = schema
        self.writer = pq.ParquetWriter(path, schema)
        self.pending: list[dict] = []

    def write(self, record: dict) -> None:
        self.pending.append(record)

    def flush(self) -> None:
        import pyarrow as pa

        if not self.pending:
            return
        try:
            table = pa.Table.from_pylist(self.pending, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InputError(f"a row does not fit the Parquet output's column types ({exc}); make the input "
                             f"column's values one type, or write .jsonl output") from None
        self.writer.write_table(table)
        self.pending = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


# -- what an interrupted job wrote ---------------------------------------------------------

def read_written(path: str, output_format: str, extract: Callable[[dict], tuple]) -> tuple[list | None, list]:
    """(CSV header or None, `extract(record)` of each complete record) of an output an
    interrupted job left; a torn last record (a kill in the middle of a write) is cut off."""
    with open(path, "rb+") as f:
        header, extracted, end = (_csv_records if output_format == "csv" else _jsonl_records)(f, path, extract)
        f.truncate(end)
    return header, extracted


def _jsonl_records(f, path: str, extract):
    extracted, end = [], 0
    for number, line in enumerate(f, 1):
        if not line.endswith(b"\n"):
            break  # torn: the job was killed while writing this line
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                raise InputError(f"{path}:{number}: not valid JSON, so it was not written by gristmill batch "
                                 f"or was edited; fix or delete the line, or run without --resume to start "
                                 f"over") from None
            extracted.append(extract(record))
        end += len(line)
    return None, extracted, end


def _csv_records(f, path: str, extract):
    header, extracted, end, consumed, pending = None, [], 0, 0, b""
    for line in f:
        consumed += len(line)
        pending += line
        # A record is whole at a newline outside quotes: quotes inside fields come doubled,
        # so the record so far holds an even number of them.
        if not line.endswith(b"\n") or pending.count(b'"') % 2:
            continue
        cells = next(csv.reader(io.StringIO(pending.decode("utf-8"), newline="")), [])
        pending = b""
        if header is None:
            header = cells
        elif len(cells) != len(header):
            raise InputError(f"{path}: a record has {len(cells)} fields where the header has {len(header)}, so "
                             f"it was not written by gristmill batch or was edited; fix it or run without "
                             f"--resume to start over")
        else:
            extracted.append(extract(dict(zip(header, cells))))
        end = consumed
    return header, extracted, end


# -- OpenAI Batch API files -----------------------------------------------------------------

BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_BATCH_KEYS = ("custom_id", "method", "url", "body")
# Body fields copied into sampling_params, by their SamplingParams name.
_BODY_PARAMS = {"max_completion_tokens": "max_tokens", **{name: name for name in (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n",
    "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "bad_words",
    "skip_special_tokens")}}
# Body fields that change nothing here (a model name may be anything).
_BODY_IGNORED = {"model", "messages", "prompt", "user", "stream", "stream_options", "metadata", "store"}
# Body fields that become sampling_params.structured_output.
_BODY_CONSTRAINTS = ("response_format", "structured_outputs")


def is_batch_file(first_row: dict | None) -> bool:
    return isinstance(first_row, dict) and all(key in first_row for key in _BATCH_KEYS)


def check_batch_line(line: dict, where: str) -> None:
    missing = [key for key in ("custom_id", "url", "body") if key not in line]
    if missing or not isinstance(line["body"], dict):
        raise InputError(f"{where}: an OpenAI batch line needs 'custom_id', 'url' and 'body' (an object)"
                         f"{'; missing ' + ', '.join(missing) if missing else ''}")


def batch_request_row(line: dict) -> dict:
    """A batch line as a processor row; raises RequestError for a request this line
    cannot make (it becomes a 400 line of the output)."""
    url, body = line["url"], line["body"]
    if url not in BATCH_URLS:
        raise RequestError(f"url {url!r} is not supported; use one of {sorted(BATCH_URLS)}", param="url")
    if str(line.get("method", "POST")).upper() != "POST":
        raise RequestError(f"method {line['method']!r} is not supported; use POST", param="method")
    unsupported = sorted(k for k, v in body.items()
                         if k not in _BODY_PARAMS and k not in _BODY_IGNORED and k not in _BODY_CONSTRAINTS and v)
    if unsupported:
        raise RequestError(f"body fields {unsupported} are not supported by gristmill batch; leave them out",
                           param=unsupported[0])
    params = {_BODY_PARAMS[k]: v for k, v in body.items() if k in _BODY_PARAMS and k != "max_tokens"}
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is not None:
        params["max_tokens"] = body["max_tokens"]
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    params["structured_output"], _ = openai_constraint(body.get("response_format"), body.get("structured_outputs"))
    row = {"custom_id": line["custom_id"], "sampling_params": {k: v for k, v in params.items() if v is not None}}
    if BATCH_URLS[url] == "chat":
        row["messages"] = body.get("messages")
        return row
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # one prompt in a list: still one request
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        row["tokenized_prompt"] = prompt
    else:
        row["prompt"] = prompt
    return row


def batch_output_line(line: dict, out: dict, model: str) -> dict:
    """The OpenAI batch output line for one request, from its processor output row."""
    error = out.get("__inference_error__")
    if error:
        status, body = _error_body(error)
    else:
        body = _completion_body(BATCH_URLS[line["url"]], out, line["body"].get("model") or model)
        status = 200
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"],
            "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def batch_line_error(record: dict) -> str:
    """The `"<ErrorType>: <message>"` of a batch output line, or "" if it succeeded."""
    response = record.get("response") or {}
    if response.get("status_code") == 200:
        return ""
    error = (response.get("body") or {}).get("error") or {}
    return f"{error.get('code')}: {error.get('message')}"


def _completion_body(kind: str, out: dict, model: str) -> dict:
    text, reason = out["generated_text"], out["finish_reason"]
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
               "logprobs": None} if kind == "chat"
              else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
    prompt_tokens, completion_tokens = out["num_input_tokens"], out["num_generated_tokens"]
    return {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if kind == "chat" else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _error_body(error: str) -> tuple[int, dict]:
    """(status, OpenAI error envelope) of an error row: 400 for the RequestError family,
    500 for the rest. `code` names the error type, so the row's error reads back whole."""
    type_name, _, message = error.partition(": ")
    known = {cls.__name__: cls for cls in _subclasses(GristmillError)}
    cls = known.get(type_name)
    status = 400 if cls is not None and issubclass(cls, RequestError) else 500
    error_type = cls.error_type if cls is not None else "internal_error"
    return status, {"error": {"message": message or error, "type": error_type, "param": None, "code": type_name}}


def _subclasses(cls) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_subclasses(sub))
    return found
