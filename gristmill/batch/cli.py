"""`gristmill batch INPUT -o OUTPUT`: every row of a JSONL, CSV or Parquet file (or of an
OpenAI Batch API file) through a processor, written as it goes, each row exactly once.

How a job runs: one pass over the input checks it and counts its rows, before the model
loads. With --resume, the ids the output already holds are read back (a torn last line
is cut off) and as many input rows are skipped, after checking that their ids match.
The other rows stream through `Processor.stream`; each output row is written as it
comes and the files are flushed every batch. Rows come out in input order, so what a
killed job wrote is always a prefix of the input: that is what makes resuming exact.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from contextlib import closing
from dataclasses import dataclass

from gristmill.batch import EngineProcessorConfig, HttpProcessorConfig, UserFunctionError, build_processor
from gristmill.batch.io import (CsvWriter, InputError, InputFile, JsonlWriter, ParquetWriter, batch_line_error,
                                batch_output_line, batch_request_row, check_batch_line, file_format, id_key,
                                is_batch_file, read_written)
from gristmill.batch.rows import ERROR_COLUMN, OUTPUT_COLUMNS, error_columns
from gristmill.batch.tables import arrow_types
from gristmill.cli import _add_engine_args, engine_config, engine_options, run_figures
from gristmill.errors import GristmillError, RequestError, error_string
from gristmill.sampling import SamplingParams

ROW_ID = "__row_id__"
# Rides with each row through the processor: the input row as read, for the output and
# the errors file (the processor only sees the columns it needs).
_META = "__gristmill_batch_input__"


def _read_schema(path: str) -> dict:
    try:
        with open(path) as f:
            schema = json.load(f)
    except OSError as exc:
        raise InputError(f"--json-schema {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise InputError(f"--json-schema {path} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InputError(f"--json-schema {path} must hold a JSON schema object, got {type(schema).__name__}")
    return schema


def add_batch_command(commands) -> None:
    parser = commands.add_parser(
        "batch", help="run every row of a JSONL / CSV / Parquet file (or an OpenAI batch file)",
        description="Generate for every row of INPUT and write OUTPUT as it goes (the format of each "
                    "follows its extension: .jsonl, .csv, .parquet). Each output row is the input row plus "
                    "its id and the output columns (generated_text, ..., __inference_error__). An OpenAI "
                    "Batch API file (lines with custom_id, method, url, body) gets OpenAI batch output lines.")
    parser.add_argument("input", help="rows to run: .jsonl, .csv or .parquet")
    parser.add_argument("-o", "--output", required=True, help="where the rows go: .jsonl, .csv or .parquet")
    columns = parser.add_mutually_exclusive_group()
    columns.add_argument("--prompt-column", metavar="C", help="column holding each row's prompt text "
                         "(default: 'prompt', or 'messages' when a row has it)")
    columns.add_argument("--messages-column", metavar="C", help="column holding each row's chat messages")
    parser.add_argument("--id-column", metavar="C", help="column whose (unique) values are the row ids "
                        f"(default: the input position, written as {ROW_ID})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="default max_tokens of every row; a row's own sampling_params win (default: 16)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default temperature of every row, 0 = greedy (default: 1.0)")
    for name, what in (("repetition-penalty", "repetition_penalty (> 1 discourages repeats; default: 1, off)"),
                       ("presence-penalty", "presence_penalty, in [-2, 2] (default: 0, off)"),
                       ("frequency-penalty", "frequency_penalty, in [-2, 2] (default: 0, off)")):
        parser.add_argument(f"--{name}", type=float, default=None,
                            help=f"default {what} of every row; a row's own sampling_params win")
    parser.add_argument("--json-schema", metavar="FILE", help="constrain every row's output to this JSON schema "
                        "(a .json file); a row's own sampling_params.structured_output wins")
    parser.add_argument("--fail-fast", action="store_true",
                        help="stop at the first row error, in input order, writing the rows before it "
                             "(default: write it as an error row and go on)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows an existing .jsonl/.csv OUTPUT holds and run only the rest "
                             "(default: overwrite OUTPUT)")
    parser.add_argument("--errors", metavar="FILE", help="also write each failed input row, as read, with "
                        "__inference_error__, to this .jsonl file (ready to run again)")
    parser.add_argument("--max-engine-restarts", type=int, default=0,
                        help="times a dead engine is restarted during the job (default: 0)")
    parser.add_argument("--deployment-url", metavar="URL", help="send rows to this OpenAI-compatible server "
                        "(e.g. http://127.0.0.1:8000/v1; a URL without a path gets /v1) instead of a local engine")
    parser.add_argument("--runner", choices=("local", "ray"), default="local",
                        help="where the job runs: 'local', in this process (default), or 'ray', on Ray Data "
                             "(needs pip install 'gristmill[ray]'; see docs/ray.md)")
    parser.add_argument("--address", metavar="ADDR", help="with --runner ray: the Ray cluster to run on, e.g. "
                        "'auto' or 10.0.0.1:6379 (default: RAY_ADDRESS, else a new local cluster)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="engine replicas (with --runner ray, actors), each its own engine (default: 1)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per batch (default: 64)")
    parser.add_argument("--max-concurrent-batches", type=int, default=4,
                        help="batches in flight at once (default: 4)")
    _add_engine_args(parser)
    parser.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    from gristmill import startup

    startup.show_messages()
    try:
        job = _Job(args)
    except (InputError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    return job.run()


@dataclass
class _Slot:
    """One input row on its way: a processor row, or a row that failed before the
    processor (an unsupported url in a batch file, a missing prompt column)."""

    row: dict
    error: Exception | None = None


class _Job:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.source = InputFile(args.input)
        self.out_format = file_format(args.output, "output")
        self.batch_file = self.source.format == "jsonl" and is_batch_file(self.source.first_row())
        self.id_column = "custom_id" if self.batch_file else (args.id_column or ROW_ID)
        self._check_paths()
        self.config = self._processor_config()
        survey = self.source.survey(check=check_batch_line if self.batch_file else None,
                                    types=self.out_format == "parquet" and self.source.format == "jsonl")
        self.total = survey.count
        self.columns, self.schema = self._output_columns(survey)
        self.ok = self.failed = self.tokens = self.skipped = self.written = 0
        self.seen: set[str] = set()  # id keys of the rows read so far
        self.started: float | None = None  # when rows started to run (the engine was up)
        self.processor = None

    # -- set-up ---------------------------------------------------------------------------

    def _check_paths(self) -> None:
        args = self.args
        if self.batch_file and self.out_format != "jsonl":
            raise InputError(f"{args.input} is an OpenAI batch file, whose output is OpenAI batch lines: "
                             f"name the output .jsonl")
        if args.resume and self.out_format == "parquet":
            raise InputError("--resume needs a .jsonl or .csv output (a Parquet file cannot be appended to); "
                             "write .jsonl or .csv, or run without --resume to start over")
        if args.errors and not args.errors.lower().endswith(".jsonl"):
            raise InputError(f"--errors {args.errors}: the errors file is JSONL; name it .jsonl")
        paths = [os.path.realpath(p) for p in (args.input, args.output, args.errors) if p]
        if len(set(paths)) != len(paths):
            raise InputError("INPUT, --output and --errors must be three different files; writing one would "
                             "overwrite another")
        if args.address and args.runner != "ray":
            raise InputError("--address names a Ray cluster, which only --runner ray uses; add --runner ray or "
                             "leave out --address")
        if args.deployment_url and engine_options(args):
            print(f"warning: engine flags ({', '.join(sorted(engine_options(args)))}) configure a local engine "
                  f"and are ignored with --deployment-url", file=sys.stderr)

    def _processor_config(self):
        args = self.args
        defaults = {name: getattr(args, name) for name in ("max_tokens", "temperature", "repetition_penalty",
                                                           "presence_penalty", "frequency_penalty")
                    if getattr(args, name) is not None}
        if args.json_schema:
            defaults["structured_output"] = {"json": _read_schema(args.json_schema)}
        # Row errors always come back as error rows: --fail-fast stops at the first one in
        # input order (see _write_all), not at whichever of a batch's rows failed first.
        common = dict(batch_size=args.batch_size, max_concurrent_batches=args.max_concurrent_batches,
                      should_continue_on_error=True, sampling_params=defaults, id_column=self.id_column)
        try:
            SamplingParams(**defaults)
            if args.deployment_url:
                return HttpProcessorConfig(url=_api_url(args.deployment_url), **common)
            return EngineProcessorConfig(engine=engine_config(args), max_engine_restarts=args.max_engine_restarts,
                                         concurrency=args.concurrency, **common)
        except RequestError as exc:
            flag = "--json-schema" if exc.param == "structured_output" else "--" + (exc.param or "").replace("_", "-")
            raise InputError(f"{exc} (flag {'--deployment-url' if flag == '--url' else flag})") from None

    def _output_columns(self, survey) -> tuple[list[str], object]:
        """The CSV header and Parquet schema: [row id] + input columns + output columns."""
        inputs = [c for c in survey.columns if c not in OUTPUT_COLUMNS and c != ROW_ID]
        columns = ([ROW_ID] if self.id_column == ROW_ID else []) + inputs + list(OUTPUT_COLUMNS)
        if self.out_format != "parquet":
            return columns, None
        import pyarrow as pa

        types = {ROW_ID: pa.int64(), **{c: survey.schema.field(c).type for c in inputs}, **arrow_types()}
        return columns, pa.schema([pa.field(c, types[c]) for c in columns])

    @functools.cached_property
    def model_name(self) -> str:
        from gristmill.paths import DEFAULT_MODEL_NAME

        return self.args.deployment_url if self.args.deployment_url else (
            self.config.engine.model or DEFAULT_MODEL_NAME)

    # -- the run --------------------------------------------------------------------------

    def run(self) -> int:
        args = self.args
        writer = errors = None
        try:
            written = self._read_written()
            writer = self._open_writer(append=args.resume and os.path.exists(args.output))
            errors = JsonlWriter(args.errors) if args.errors else None
            rows = self.source.rows()
            self._skip(rows, written, errors)
            if self.total is None or self.skipped < self.total:  # else nothing is left: no engine to start
                processor = self._processor()
                self._write_all(processor, _merged(processor, self._slots(rows)), writer, errors)
        except KeyboardInterrupt:
            self._close(writer, errors)
            print(f"interrupted{self._where(writer)}", file=sys.stderr)
            return 130
        except (InputError, OSError, GristmillError, UserFunctionError) as exc:
            self._close(writer, errors)
            message = str(exc) if isinstance(exc, (InputError, OSError)) else error_string(exc)
            raise SystemExit(f"error: {message}{self._where(writer)}") from None
        self._close(writer, errors)
        self._summary()
        return 0

    def _processor(self):
        """What runs the rows: the processor, or (--runner ray) Ray Data running it."""
        processor = build_processor(self.config)
        if self.args.runner == "local":
            return processor
        try:
            from gristmill.ray.data import DatasetRunner
        except ImportError as exc:
            raise InputError(f"--runner ray: {exc}") from None
        return DatasetRunner(processor, self.args.address)

    def _read_written(self) -> list[tuple[str, str]]:
        """(id key, error) of each row an interrupted job wrote; none without --resume."""
        args = self.args
        if not args.resume or not os.path.exists(args.output):
            return []
        if self.batch_file:
            def extract(record):
                return id_key(self.out_format, record.get("custom_id")), batch_line_error(record)
        else:
            def extract(record):
                return id_key(self.out_format, record.get(self.id_column)), record.get(ERROR_COLUMN) or ""
        header, written = read_written(args.output, self.out_format, extract)
        if header is not None and header != self.columns:
            raise InputError(f"--resume: the columns of {args.output} ({header}) are not this job's "
                             f"({self.columns}); resume with the input and flags that wrote it, or run "
                             f"without --resume to start over")
        return written

    def _skip(self, rows, written: list[tuple[str, str]], errors) -> None:
        """Take the rows the output already holds off `rows`, checking their ids; the
        errors file is written afresh, so it gets their failed rows again."""
        for position, (key, error) in enumerate(written):
            original = next(rows, None)
            if original is None:
                raise InputError(f"--resume: {self.args.output} holds {len(written)} rows but the input has only "
                                 f"{position}; resume with the input that wrote it, or run without --resume")
            found = id_key(self.out_format, self._row_id(original, position))
            if found != key:
                raise InputError(f"--resume: row {position} of {self.args.output} has id {key} but input row "
                                 f"{position} has id {found}; resume with the input and --id-column that wrote "
                                 f"it, or run without --resume to start over")
            self.seen.add(found)
            if error:
                self.failed += 1
                if errors is not None:
                    errors.write({**original, ERROR_COLUMN: error})
            else:
                self.ok += 1
        self.skipped = self.written = len(written)

    def _row_id(self, original: dict, position: int):
        if self.id_column == ROW_ID:
            return position
        if original.get(self.id_column) is None:
            raise InputError(f"input row {position} has no {self.id_column!r} value; every row needs a unique id "
                             f"(fix the row, or leave out --id-column to number rows by position)")
        return original[self.id_column]

    def _slots(self, rows):
        """Input rows, from where the output ends, as processor rows (or rows that failed early)."""
        for position, original in enumerate(rows, start=self.skipped):
            row_id = self._row_id(original, position)
            key = id_key(self.out_format, row_id)
            if key in self.seen:
                raise InputError(f"input row {position} repeats the id {key} of an earlier row; ids must be "
                                 f"unique for each row to be written exactly once")
            self.seen.add(key)
            row = {self.id_column: row_id, _META: original}
            try:
                row.update(batch_request_row(original) if self.batch_file else self._request_columns(original))
            except RequestError as exc:
                yield _Slot(row, exc)
                continue
            yield _Slot(row)

    def _request_columns(self, original: dict) -> dict:
        """The columns the processor needs from an input row (CSV cells holding JSON decoded)."""
        args = self.args
        row = {"sampling_params": _decoded(original.get("sampling_params"))}
        column = args.messages_column or args.prompt_column
        if column is not None:
            value = _decoded(original.get(column)) if args.messages_column else original.get(column)
            if value is None:
                flag = "--messages-column" if args.messages_column else "--prompt-column"
                raise RequestError(f"the row has no {column!r} value ({flag} {column}); fill it in or name "
                                   f"another column", param=column)
            row["messages" if args.messages_column else "prompt"] = value
        elif _decoded(original.get("messages")) is not None:
            row["messages"] = _decoded(original["messages"])
        elif original.get("prompt") is not None or _decoded(original.get("tokenized_prompt")) is not None:
            row["prompt"] = original.get("prompt")
            row["tokenized_prompt"] = _decoded(original.get("tokenized_prompt"))
        else:
            raise RequestError("the row has no 'prompt' or 'messages' value; name the input's column with "
                               "--prompt-column or --messages-column", param="prompt")
        return row

    # -- writing --------------------------------------------------------------------------

    def _open_writer(self, append: bool):
        if self.out_format == "csv":
            return CsvWriter(self.args.output, self.columns, append)
        if self.out_format == "parquet":
            return ParquetWriter(self.args.output, self.schema)
        return JsonlWriter(self.args.output, append)

    def _write_all(self, processor, stream, writer, errors) -> None:
        from tqdm import tqdm

        bar = None

        def rows_start():  # the engine is up: the bar and the clock start with the rows
            nonlocal bar
            self.started = time.monotonic()
            bar = tqdm(total=self.total, initial=self.skipped, unit="row", desc="gristmill batch",
                       file=sys.stderr, dynamic_ncols=True)

        self.processor = processor
        if hasattr(processor, "on_rows_start"):
            processor.on_rows_start = rows_start
        else:  # a runner that does not say when its rows start (Ray): from now
            rows_start()
        try:
            with closing(stream):
                for out in stream:
                    self._write_one(out, writer, errors)
                    elapsed = max(time.monotonic() - self.started, 1e-9)
                    bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s, {self.failed} errors", refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()

    def _write_one(self, out: dict, writer, errors) -> None:
        if out[ERROR_COLUMN] and self.args.fail_fast:
            raise InputError(f"row {out[self.id_column]!r}: {out[ERROR_COLUMN]}\n--fail-fast stopped the "
                             f"job at this row; fix it, or leave out --fail-fast to write error rows "
                             f"and go on")
        writer.write(self._record(out))
        if out[ERROR_COLUMN]:
            self.failed += 1
            if errors is not None:
                errors.write({**out[_META], ERROR_COLUMN: out[ERROR_COLUMN]})
        else:
            self.ok += 1
            self.tokens += out["num_generated_tokens"]
        self.written += 1
        if (self.written - self.skipped) % self.config.batch_size == 0:
            writer.flush()
            if errors is not None:
                errors.flush()

    def _record(self, out: dict) -> dict:
        if self.batch_file:
            return batch_output_line(out[_META], out, self.model_name)
        record = {ROW_ID: out[ROW_ID]} if self.id_column == ROW_ID else {}
        record.update(out[_META])
        record.update({column: out[column] for column in OUTPUT_COLUMNS})
        return record

    @staticmethod
    def _close(*files) -> None:
        for f in files:
            if f is not None:
                f.close()

    def _where(self, writer) -> str:
        """Where a stopped job left its output, and how to go on; nothing if it wrote none."""
        if writer is None:
            return ""
        rows = f"{self.written} row{'' if self.written == 1 else 's'}"
        if self.out_format == "parquet":
            return (f"\n{rows} written to {self.args.output}; run again to start over (write .jsonl or .csv "
                    f"output to be able to --resume)")
        return f"\n{rows} written to {self.args.output}; fix the cause and rerun with --resume to go on"

    def _summary(self) -> None:
        run_rows = self.written - self.skipped
        run_time = max(time.monotonic() - self.started, 1e-9) if self.started is not None else 1e-9
        resumed = f" ({self.skipped} of them kept from before --resume)" if self.skipped else ""
        failed = f"; failed input rows in {self.args.errors}" if self.args.errors else ""
        start = getattr(self.processor, "engine_start_s", None)
        print(f"gristmill batch: {self.ok} rows ok, {self.failed} rows with errors{resumed}; "
              f"{run_figures(run_rows, self.tokens, run_time, start)}; "
              f"output written to {self.args.output}{failed}", file=sys.stderr)


def _merged(processor, slots):
    """Output rows in input order: the processor's, with the rows that failed before it
    put back in their places."""
    waiting: collections.deque[_Slot] = collections.deque()  # filled on the processor's feeder thread

    def to_run():
        for slot in slots:
            waiting.append(slot)
            if slot.error is None:
                yield slot.row

    def failed_early():
        while waiting and waiting[0].error is not None:
            slot = waiting.popleft()
            yield {**slot.row, **error_columns(slot.error)}

    stream = processor.stream(to_run())
    with closing(stream):
        for out in stream:
            yield from failed_early()
            waiting.popleft()  # `out`'s own slot: the feeder read it before the processor ran it
            yield out
    yield from failed_early()


def _decoded(value):
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


def _api_url(url: str) -> str:
    """http://host:port (no path) is read as the server's /v1 API."""
    from urllib.parse import urlsplit

    return url.rstrip("/") + "/v1" if urlsplit(url).path in ("", "/") else url
