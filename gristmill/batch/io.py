"""Files of `gristmill batch`: JSONL, CSV and Parquet read lazily and written as rows come,
and the rows an interrupted job already wrote (for --resume). OpenAI Batch API files are
openai_batch.py's.

pyarrow is imported inside functions: `gristmill --help` should not pay for it.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gristmill.batch.tables import full_table

_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
_SCAN_ROWS = 1024  # rows per chunk when pyarrow infers the types of a JSONL file


class InputError(Exception):
    """A problem with a file or flag the user can fix; the message says how."""


def check_writable(flag: str, path: str) -> None:
    """Before the model loads: the file `flag` names can be written (its directory
    exists, it is no directory, it or its directory is writable), so no row is lost."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InputError(f"{flag} {path} is a directory; name a file in it")
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {path}: the directory {folder} does not exist; create it or name a file "
                         f"in one that does")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise InputError(f"{flag} {path}: permission denied; name a file you can write")


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
            return (row for _, row in jsonl_rows(self.path))
        return self._arrow_rows()

    def first_row(self) -> dict | None:
        try:
            return next(self.rows(), None)
        except InputError:
            return None  # the full pass reports it with its line number

    def survey(self, check: Callable[[dict, int, str], None] | None = None, types: bool = False) -> Survey:
        """Count the rows and find the columns (and their types if `types`); `check(row,
        position, where)` sees each JSONL and CSV row, so a bad row stops the job before the
        model loads."""
        import pyarrow as pa

        if self.format == "parquet":
            meta = self._parquet()
            return Survey(meta.metadata.num_rows, meta.schema_arrow.names, meta.schema_arrow)
        if self.format == "csv":
            count, schema = 0, pa.schema([pa.field(name, pa.string()) for name in self._csv_header()])
            for batch in self._csv_batches():
                if check is not None:
                    for row in batch.to_pylist():
                        check(row, count, f"{self.path} row {count + 1}")
                        count += 1
                else:
                    count += batch.num_rows
            return Survey(count, schema.names, schema)
        count, columns, schemas, chunk = 0, {}, [], []
        for where, row in jsonl_rows(self.path):
            if check is not None:
                check(row, count, where)
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

    def _arrow_rows(self) -> Iterator[dict]:
        if self.format == "csv":
            batches = self._csv_batches()
        else:
            batches = self._parquet().iter_batches(batch_size=_SCAN_ROWS)
        for batch in batches:
            yield from batch.to_pylist()

    def _parquet(self):
        """The Parquet file, opened (its footer read): a file cut short or empty is refused."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"input {self.path} is not a readable Parquet file ({exc}); it may be cut short "
                             f"or empty (an interrupted copy): write or copy it again") from None

    def _csv_header(self) -> list[str]:
        """The CSV's column names (its first record)."""
        # Bytes that are not UTF-8 are found by pyarrow, which names the row.
        with open(self.path, encoding="utf-8-sig", errors="replace", newline="") as f:
            header = next(csv.reader(f), None)
        if not header or not any(name.strip() for name in header):
            raise InputError(f"{self.path} has no header line; a CSV input starts with a line naming its "
                             f"columns (such as: prompt)")
        return header

    def _csv_batches(self):
        """The CSV's records, every cell as text (as written: "007" stays "007", "12345" is a
        prompt, not a number); an empty cell is ""."""
        import pyarrow as pa
        import pyarrow.csv as pacsv

        header = self._csv_header()
        try:
            reader = pacsv.open_csv(self.path, convert_options=pacsv.ConvertOptions(
                column_types={name: pa.string() for name in header}, quoted_strings_can_be_null=False))
            while True:
                try:
                    yield reader.read_next_batch()
                except StopIteration:
                    return
        except pa.ArrowInvalid as exc:
            hint = ("save the file as UTF-8" if "UTF8" in str(exc) or "utf8" in str(exc).lower()
                    else "check its quoting and that every line has as many fields as the header")
            raise InputError(f"{self.path}: cannot read it as CSV ({exc}); {hint}") from None


def jsonl_rows(path: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of each line of a JSONL file that is not blank, read as it goes;
    `where` names the line ("in.jsonl:3"), and so does the InputError of a line that is
    not UTF-8 or not one JSON object."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM opens some files
            except UnicodeDecodeError as exc:
                raise InputError(f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                                 f"{exc.start + 1}); JSONL is UTF-8: save the file as UTF-8") from None
            if line.strip():
                yield where, parse_json_object(line, where)


def parse_json_object(line: str | bytes, where: str, fix: str = "each line must be one JSON object") -> dict:
    """One JSONL line's object; else an InputError naming `where` and saying `fix`."""
    try:
        row = json.loads(line)
    except ValueError as exc:  # (bytes that are not UTF-8 too)
        raise InputError(f"{where}: not valid JSON ({exc}); {fix}") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: not a JSON object (a row); {fix}")
    return row


def _inferred(rows: list[dict], path: str):
    import pyarrow as pa

    try:
        return full_table(rows).schema
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

def read_written(path: str, output_format: str, extract: Callable[[dict], tuple]) -> tuple[list | None, list, int]:
    """(CSV header or None, `extract(record)` of each complete record, the byte offset
    where they end) of an output an interrupted job left. What follows that offset is a
    torn last record (a kill in the middle of a write): `cut_at` cuts it off once the job
    knows the output is its own, never before (a refused --resume leaves the file as it was)."""
    with open(path, "rb") as f:
        return (_csv_records if output_format == "csv" else _jsonl_records)(f, path, extract)


def cut_at(path: str, end: int) -> None:
    """Cut `path` to its first `end` bytes (`read_written`'s end of the whole records)."""
    with open(path, "rb+") as f:
        f.truncate(end)


#: What to do about a line of an output that gristmill batch cannot have written.
_NOT_WRITTEN_HERE = ("so gristmill batch did not write it, or it was edited: fix or delete the line, or run "
                     "without --resume to start over")


def _jsonl_records(f, path: str, extract):
    extracted, end = [], 0
    for number, line in enumerate(f, 1):
        if not line.endswith(b"\n"):
            break  # torn: the job was killed while writing this line
        if line.strip():
            extracted.append(extract(parse_json_object(line, f"{path}:{number}", _NOT_WRITTEN_HERE)))
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
        try:
            text = pending.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not UTF-8 text (byte {pending[exc.start]:#04x}), so it was not written "
                             f"by gristmill batch; name another output, or run without --resume to "
                             f"overwrite it") from None
        cells = next(csv.reader(io.StringIO(text, newline="")), [])
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
