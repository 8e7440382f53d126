"""--resume: what an interrupted job wrote, and the input rows it already holds.

Rows come out in input order, so what a killed job wrote is always a prefix of the input:
the ids the output holds are read back (a torn last line is cut off) and as many input
rows are skipped, after checking that their ids match. Every row's id is checked unique
as it is read, so each row is written exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

from gristmill.batch.io import InputError, id_key, read_written
from gristmill.batch.openai_batch import batch_line_error
from gristmill.batch.rows import ERROR_COLUMN, OUTPUT_COLUMNS

#: The id column of a job without --id-column: each row's input position.
ROW_ID = "__row_id__"


class RowIds:
    """The ids of a job's input rows: the values of `id_column` (each row has one, and no
    two rows the same), or if `positional` their positions (and `id_column` is ROW_ID).
    `batch_file`: the ids are an OpenAI batch file's custom_ids."""

    def __init__(self, id_column: str, out_format: str, positional: bool = False, batch_file: bool = False):
        self.id_column = id_column
        self.out_format = out_format
        self.positional = positional
        self.batch_file = batch_file
        self.seen: dict[str, str] = {}  # id key -> where the row that has it was read

    def of(self, original: dict, position: int, where: str | None = None):
        if self.positional:
            return position
        if original.get(self.id_column) in (None, ""):  # an empty CSV cell is no id either
            at = where or f"input row {position}"
            if self.batch_file:
                raise InputError(f"{at}: the request has no custom_id; every line of an OpenAI batch file needs "
                                 f"a unique custom_id (a string)")
            raise InputError(f"{at} has no {self.id_column!r} value; every row needs a unique id (fill it in, or "
                             f"leave out --id-column to number rows by position)")
        return original[self.id_column]

    def key(self, row_id) -> str:
        """The id as the output file holds it."""
        return id_key(self.out_format, row_id)

    def claim(self, original: dict, position: int, where: str | None = None):
        """The row's id, checked unique."""
        row_id = self.of(original, position, where)
        key = self.key(row_id)
        at = where or f"input row {position}"
        if key in self.seen:
            what = "custom_id" if self.batch_file else "id"
            raise InputError(f"{at} repeats the {what} {key} of {self.seen[key]}; {what}s must be unique for "
                             f"each row to be written exactly once")
        self.seen[key] = at
        return row_id


def written_rows(output: str, ids: RowIds, batch_file: bool, columns: list[str],
                 output_columns: tuple[str, ...] = OUTPUT_COLUMNS) -> tuple[list[tuple[str, str]], int]:
    """((id key, error) of each row an interrupted job wrote to `output`, whose columns must
    be this job's `columns` (of which `output_columns` are its task's); the byte offset
    where those rows end, after which a torn row may follow: see `io.read_written`)."""
    if batch_file:
        def extract(record):
            return ids.key(record.get("custom_id")), batch_line_error(record)
    else:
        jsonl = ids.out_format == "jsonl"

        def extract(record):
            if jsonl:  # each JSONL row names its own columns; a CSV header is checked below
                _check_columns(record, output, columns, ids.id_column, output_columns)
            return ids.key(record.get(ids.id_column)), record.get(ERROR_COLUMN) or ""
    header, written, end = read_written(output, ids.out_format, extract)
    if header is not None and header != columns:
        raise InputError(f"--resume: the columns of {output} ({header}) are not this job's "
                         f"({columns}); resume with the input and flags that wrote it, or run "
                         f"without --resume to start over")
    return written, end


def _check_columns(record: dict, output: str, columns: list[str], id_column: str,
                   output_columns: tuple[str, ...]) -> None:
    """A JSONL row of `output` has this job's id and output columns, and no other columns
    than this job's (a row lacks the input columns its input row lacked)."""
    other = [c for c in record if c not in columns]
    missing = [c for c in (id_column, *output_columns) if c not in record]
    if other or missing:
        found = f"has {_columns(other)}" if other else f"lacks {_columns(missing)}"
        raise InputError(f"--resume: a row of {output} {found}, so it is not the output of this job, whose "
                         f"columns are {columns}; resume with the input and flags that wrote it, or run "
                         f"without --resume to start over")


def _columns(names: list[str]) -> str:
    return ("the column " if len(names) == 1 else "the columns ") + ", ".join(map(repr, names))


def skip_written(rows: Iterator[dict], written: list[tuple[str, str]], ids: RowIds,
                 output: str) -> tuple[int, list[dict]]:
    """Take the rows `output` already holds off `rows`, checking their ids; returns (how
    many succeeded, the input rows that failed, with their error): the errors file is
    written afresh, so it gets the failed rows again."""
    ok, failed = 0, []
    for position, (key, error) in enumerate(written):
        original = next(rows, None)
        if original is None:
            raise InputError(f"--resume: {output} holds {len(written)} rows but the input has only "
                             f"{position}; resume with the input that wrote it, or run without --resume")
        found = ids.key(ids.of(original, position))
        if found != key:
            raise InputError(f"--resume: row {position} of {output} has id {key} but input row "
                             f"{position} has id {found}; resume with the input and --id-column that wrote "
                             f"it, or run without --resume to start over")
        ids.seen[found] = f"input row {position}"
        if error:
            failed.append({**original, ERROR_COLUMN: error})
        else:
            ok += 1
    return ok, failed
