"""A `gristmill batch` job's input rows as processor rows, and the processor's rows back in
input order (with the rows that failed before reaching it in their places)."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass

from gristmill.batch.adapters import MODEL_COLUMNS
from gristmill.batch.openai_batch import PARTS_COLUMN, batch_request_row, embedding_inputs
from gristmill.batch.resume import RowIds
from gristmill.batch.row_tools import TOOL_FIELDS
from gristmill.batch.rows import ERROR_COLUMN, error_columns
from gristmill.errors import RequestError

#: Rides with each row through the processor: the input row as read, for the output and
#: the errors file (the processor only sees the columns it needs).
INPUT_COLUMN = "__gristmill_batch_input__"


@dataclass
class Slot:
    """One input row on its way: a processor row, or a row that failed before the
    processor (an unsupported url in a batch file, a missing prompt column)."""

    row: dict
    error: Exception | None = None


def input_slots(rows: Iterable[dict], start: int, ids: RowIds, batch_file: bool, prompt_column: str | None,
                messages_column: str | None, task: str = "generate", named_models: bool = False) -> Iterator[Slot]:
    """Input rows, from position `start` (where the output ends), as processor rows of `task`;
    `named_models`: a batch line's body `model` names the model it runs with (batch_request_row)."""
    for position, original in enumerate(rows, start=start):
        row_id = ids.claim(original, position)
        row = {ids.id_column: row_id, INPUT_COLUMN: original}
        # (a batch line of several embedding inputs: a row each, made one line by `whole_lines`)
        inputs = embedding_inputs(original) if batch_file and task == "embed" else None
        for part in [None] if inputs is None else range(len(inputs)):
            each = row if part is None else {**row, PARTS_COLUMN: [part, len(inputs)]}
            try:
                each.update(batch_request_row(original, task, part, named_models) if batch_file
                            else request_columns(original, prompt_column, messages_column, task))
            except RequestError as exc:
                yield Slot(each, exc)
                continue
            yield Slot(each)


def request_columns(original: dict, prompt_column: str | None, messages_column: str | None,
                    task: str = "generate") -> dict:
    """The columns the processor needs from an input row (CSV cells holding JSON decoded)."""
    row = {"sampling_params": decoded(original.get("sampling_params")),
           "pooling_params": decoded(original.get("pooling_params")),
           **{column: original[column] for column in MODEL_COLUMNS if original.get(column) is not None}}
    if task == "score":
        return {**row, "text_1": original.get("text_1"), "text_2": original.get("text_2")}
    if decoded(original.get("chat_template_kwargs")) is not None:
        row["chat_template_kwargs"] = decoded(original["chat_template_kwargs"])
    for name in TOOL_FIELDS:
        value = decoded(original.get(name))
        if name == "parallel_tool_calls" and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"  # (a CSV cell)
        if value is not None:
            row[name] = value
    column = messages_column or prompt_column
    if column is not None:
        value = decoded(original.get(column)) if messages_column else original.get(column)
        if value is None:
            flag = "--messages-column" if messages_column else "--prompt-column"
            raise RequestError(f"the row has no {column!r} value ({flag} {column}); fill it in or name "
                               f"another column", param=column)
        row["messages" if messages_column else "prompt"] = value
    elif decoded(original.get("messages")) is not None:
        row["messages"] = decoded(original["messages"])
    elif original.get("prompt") is not None or decoded(original.get("tokenized_prompt")) is not None:
        row["prompt"] = original.get("prompt")
        row["tokenized_prompt"] = decoded(original.get("tokenized_prompt"))
    else:
        raise RequestError("the row has no 'prompt' or 'messages' value; name the input's column with "
                           "--prompt-column or --messages-column", param="prompt")
    return row


def merged(processor, slots: Iterable[Slot], task: str = "generate") -> Iterator[dict]:
    """Output rows in input order: the processor's, with the rows that failed before it
    put back in their places (with the error columns of the processor's `task`)."""
    waiting: collections.deque[Slot] = collections.deque()  # filled on the processor's feeder thread

    def to_run():
        for slot in slots:
            waiting.append(slot)
            if slot.error is None:
                yield slot.row

    def failed_early():
        while waiting and waiting[0].error is not None:
            slot = waiting.popleft()
            yield {**slot.row, **error_columns(slot.error, task)}

    stream = processor.stream(to_run())
    with closing(stream):
        for out in stream:
            yield from failed_early()
            waiting.popleft()  # `out`'s own slot: the feeder read it before the processor ran it
            yield out
    yield from failed_early()


def whole_lines(outputs: Iterable[dict]) -> Iterator[dict]:
    """Output rows in input order, the rows of a batch line of several embedding inputs
    (`PARTS_COLUMN`) made one: its vectors in a list, its tokens summed, or the first
    error of its inputs (the line fails whole, as the endpoint would)."""
    parts: list[dict] = []
    for out in outputs:
        part = out.get(PARTS_COLUMN)
        if part is None:
            yield out
            continue
        parts.append(out)
        if part[0] == part[1] - 1:
            yield _line_of(parts)
            parts = []


def _line_of(parts: list[dict]) -> dict:
    for out in parts:
        if out.get(ERROR_COLUMN):
            return {**out, PARTS_COLUMN: None}
    return {**parts[0], "embeddings": [out["embeddings"] for out in parts],
            "num_input_tokens": sum(out["num_input_tokens"] for out in parts)}


def decoded(value):
    """A CSV cell of a JSON column (messages, sampling_params, tokenized_prompt) as the
    value it holds; an empty cell is no value. Prompts are text and never decoded."""
    if value == "":
        return None
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError:
            return value  # the processor says what is wrong with it
    return value
