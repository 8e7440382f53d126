"""The kinds of rows a processor takes and gives back: lists of dicts, any iterable of
dicts (streamed), pyarrow Tables and pandas DataFrames."""

from __future__ import annotations

from collections.abc import Iterable

from gristmill.errors import RequestError


def to_rows(rows) -> tuple[str, Iterable[dict]]:
    """(kind, rows as an iterable of dicts)."""
    module = type(rows).__module__
    if module.startswith("pyarrow") and hasattr(rows, "to_pylist"):
        return "arrow", rows.to_pylist()
    if module.startswith("pandas") and hasattr(rows, "to_dict"):
        return "pandas", [{key: _pandas_cell(value) for key, value in row.items()}
                          for row in rows.to_dict("records")]
    if isinstance(rows, dict):
        raise RequestError("a processor takes rows (a list of dicts, an iterable, a pyarrow Table or a "
                           "pandas DataFrame), not one row: wrap it in a list", param="rows")
    if isinstance(rows, (str, bytes)):
        raise RequestError("a processor takes rows, not a string; to read a file use "
                           "`gristmill batch INPUT -o OUTPUT` or load it first", param="rows")
    if isinstance(rows, (list, tuple)):
        return "list", rows
    if isinstance(rows, Iterable):
        return "iterable", rows
    raise RequestError(f"a processor takes rows (a list of dicts, an iterable, a pyarrow Table or a "
                       f"pandas DataFrame), got {type(rows).__name__}", param="rows")


def _pandas_cell(value):
    """A DataFrame cell as a row value: a missing one (NaN, None, NA, NaT: pandas fills the
    columns a row lacks with NaN) is None, a numpy array (a list column) a list."""
    if isinstance(value, float) and value != value:
        return None
    kind = type(value).__name__
    if kind in ("NAType", "NaTType"):
        return None
    if kind == "ndarray":
        return value.tolist()
    return value


def from_rows(rows: list[dict], kind: str):
    if kind == "arrow":
        return arrow_table(rows)
    if kind == "pandas":
        import pandas as pd
        return pd.DataFrame(rows)
    return rows


def arrow_types() -> dict:
    """The pyarrow type of each output column (and of `tokenized_prompt`), by name."""
    import pyarrow as pa

    return {"generated_text": pa.string(), "generated_tokens": pa.list_(pa.int64()),
            "num_input_tokens": pa.int64(), "num_generated_tokens": pa.int64(),
            "finish_reason": pa.string(), "time_taken_llm": pa.float64(), "__inference_error__": pa.string(),
            "tokenized_prompt": pa.list_(pa.int64()), "prompt_logprobs": pa.list_(pa.float64()),
            "reasoning": pa.string(),
            # pooling tasks' columns (rows.POOLED_COLUMNS)
            "embeddings": pa.list_(pa.float32()), "probs": pa.list_(pa.float32()), "score": pa.float64()}


def arrow_table(rows: list[dict]):
    """A pyarrow Table of output rows, with the output columns' types fixed (so a batch
    of error rows still writes `generated_tokens` as list<int64>, never a null column)."""
    table = full_table(rows)
    for name, wanted in arrow_types().items():
        if name in table.column_names and table.schema.field(name).type != wanted:
            index = table.column_names.index(name)
            table = table.set_column(index, name, table[name].cast(wanted))
    return table


def full_table(rows: list[dict]):
    """A pyarrow Table with every key of every row as a column, in first-seen order
    (`from_pylist` alone keeps the first row's keys); a row without one has null there."""
    import pyarrow as pa

    names = list(dict.fromkeys(key for row in rows for key in row))
    return pa.Table.from_pylist([{name: row.get(name) for name in names} for row in rows])
