"""One `gristmill batch` job: every input row through a processor, written as it comes.

How a job runs: one pass over the input checks it and counts its rows, before the model
loads. With --resume, the rows the output already holds are skipped (resume.py). The
other rows stream through `Processor.stream` (job_rows.py turns them into processor rows
and back); each output row is written as it comes and the files are flushed every batch.
Rows come out in input order, so what a killed job wrote is always a prefix of the input:
that is what makes resuming exact. SIGTERM stops a job as Ctrl-C does: the rows written so
far are closed, one line says how to go on, and the exit code is 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from contextlib import closing, contextmanager

from gristmill import extras
from gristmill.batch import UserFunctionError, build_processor
from gristmill.batch.io import (CsvWriter, InputError, InputFile, JsonlWriter, ParquetWriter, check_writable,
                                cut_at, file_format)
from gristmill.batch.job_config import job_task, processor_config
from gristmill.batch.openai_batch import batch_output_line, check_batch_line, is_batch_file
from gristmill.batch.job_rows import INPUT_COLUMN, input_slots, merged, whole_lines
from gristmill.batch.resume import ROW_ID, RowIds, skip_written, written_rows
from gristmill.batch.rows import (ERROR_COLUMN, PROMPT_LOGPROBS_COLUMN, REASONING_COLUMN, TOOL_CALLS_COLUMN,
                                  output_columns)
from gristmill.batch.tables import arrow_types
from gristmill.engine_flags import engine_flag, engine_options, failed_to_start, model_load_error, run_figures
from gristmill.errors import EngineDeadError, GristmillError, error_string


class Interrupted(KeyboardInterrupt):
    """A signal other than SIGINT (SIGTERM) stopping the job: handled as Ctrl-C is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def sigterm_interrupts():
    """In the main thread: SIGTERM raises Interrupted, once (a second one kills at once)."""
    def interrupt(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        raise Interrupted(signum)

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class Job:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.source = InputFile(args.input)
        self.out_format = file_format(args.output, "output")
        self.batch_file = self.source.format == "jsonl" and is_batch_file(self.source.first_row())
        #: Rows are named by their input positions (in the ROW_ID column of the output).
        self.positional = not self.batch_file and args.id_column is None
        self.id_column = "custom_id" if self.batch_file else (args.id_column or ROW_ID)
        self._check_paths()
        self.task = job_task(args, self.source.first_row(), self.batch_file)
        self.output_columns = output_columns(self.task) + (
            (PROMPT_LOGPROBS_COLUMN,) if args.prompt_logprobs is not None and self.task == "generate" else ()) + (
            # (a CSV or Parquet file's columns are fixed before the model loads: named, a
            # parser's column is there; JSONL rows carry it whenever the engine split one)
            (REASONING_COLUMN,) if engine_options(args).get("reasoning_parser") not in (None, "none")
            and self.task == "generate" else ())
        self.config = processor_config(args, self.task, self.id_column, self.batch_file)
        self.ids = RowIds(self.id_column, self.out_format, self.positional, self.batch_file)
        survey = self.source.survey(check=self._check_row,
                                    types=self.out_format == "parquet" and self.source.format == "jsonl")
        self.ids.seen.clear()  # the run claims them again as it reads the rows
        self.total = survey.count
        if survey.count and not self.batch_file:
            self._check_prompt_columns(survey.columns)
        if "tools" in survey.columns and self.task == "generate" and not self.batch_file:
            self.output_columns += (TOOL_CALLS_COLUMN,)  # (a batch file's calls go in its response bodies)
        self.columns, self.schema = self._output_columns(survey)
        self.ok = self.failed = self.tokens = self.skipped = self.written = 0
        self.started: float | None = None  # when rows started to run (the engine was up)
        self.processor = None
        self.writer = self.errors = None  # opened once the engine is up: see _open_outputs

    # -- set-up ---------------------------------------------------------------------------

    def _check_paths(self) -> None:
        args = self.args
        if self.batch_file and self.out_format != "jsonl":
            raise InputError(f"{args.input} is an OpenAI batch file, whose output is OpenAI batch lines: "
                             f"name the output .jsonl")
        column_flags = [flag for flag, value in (("--id-column", args.id_column), ("--prompt-column",
                        args.prompt_column), ("--messages-column", args.messages_column)) if value]
        if self.batch_file and column_flags:
            raise InputError(f"{args.input} is an OpenAI batch file: its requests are named by custom_id and "
                             f"hold their prompts in body, so {', '.join(column_flags)} would do nothing; "
                             f"leave {'it' if len(column_flags) == 1 else 'them'} out")
        if args.resume and self.out_format == "parquet":
            raise InputError("--resume needs a .jsonl or .csv output (a Parquet file cannot be appended to); "
                             "write .jsonl or .csv, or run without --resume to start over")
        if args.errors and not args.errors.lower().endswith(".jsonl"):
            raise InputError(f"--errors {args.errors}: the errors file is JSONL; name it .jsonl")
        paths = [os.path.realpath(p) for p in (args.input, args.output, args.errors) if p]
        if len(set(paths)) != len(paths):
            raise InputError("INPUT, --output and --errors must be three different files; writing one would "
                             "overwrite another")
        for flag, path in (("--output", args.output), ("--errors", args.errors)):
            if path:
                check_writable(flag, path)
        if args.address and args.runner != "ray":
            raise InputError("--address names a Ray cluster, which only --runner ray uses; add --runner ray or "
                             "leave out --address")
        # (--task is the job's: it says which endpoint a server's rows go to)
        local_only = sorted(engine_flag(name) for name in engine_options(args) if name != "task") + [
            flag for flag, given in (
            ("--max-engine-restarts", args.max_engine_restarts != 0), ("--concurrency", args.concurrency != 1)) if given]
        if args.deployment_url and local_only:
            print(f"warning: engine flags ({', '.join(local_only)}) configure a local engine and are ignored "
                  f"with --deployment-url", file=sys.stderr)

    def _check_row(self, row: dict, position: int, where: str) -> None:
        """Before the model loads: each row's id is there and unique, each batch line whole."""
        if self.batch_file:
            check_batch_line(row, where)
        if not self.positional:
            self.ids.claim(row, position, where)

    def _check_prompt_columns(self, columns: list[str]) -> None:
        """Before the model loads: the input has the column the prompts are read from
        (else every row would become an error row)."""
        args, have = self.args, ", ".join(map(repr, columns))
        if self.task != "generate" and args.messages_column is not None:
            raise InputError(f"--messages-column: task {self.task!r} takes text prompts, not chats; name the text "
                             f"column with --prompt-column")
        if self.task == "score":
            missing = [c for c in ("text_1", "text_2") if c not in columns]
            if missing:
                raise InputError(f"{args.input} has no {' or '.join(map(repr, missing))} column (its columns are "
                                 f"{have}); a score row holds the two texts it scores in 'text_1' and 'text_2'")
            return
        for flag, column in (("--prompt-column", args.prompt_column), ("--messages-column", args.messages_column)):
            if column is not None and column not in columns:
                raise InputError(f"{flag} {column}: {args.input} has no column {column!r}; its columns are {have}")
        if self.task != "generate" and args.prompt_column is None and not {"prompt", "tokenized_prompt"} & set(columns):
            raise InputError(f"{args.input} has no 'prompt' or 'tokenized_prompt' column (its columns are {have}); "
                             f"name the one holding the texts to {self.task} with --prompt-column")
        if args.prompt_column is None and args.messages_column is None and not {
                "prompt", "messages", "tokenized_prompt"} & set(columns):
            raise InputError(f"{args.input} has no 'prompt', 'messages' or 'tokenized_prompt' column (its columns "
                             f"are {have}); name the one holding the prompts with --prompt-column, or the chat "
                             f"messages with --messages-column")

    def _output_columns(self, survey) -> tuple[list[str], object]:
        """The CSV header and Parquet schema: [row id] + input columns + output columns."""
        if self.positional and ROW_ID in survey.columns:
            raise InputError(f"{self.args.input} has a column named {ROW_ID!r}, the column gristmill batch "
                             f"numbers rows in; rename it, or pass --id-column {ROW_ID} to name rows by its values")
        inputs = [c for c in survey.columns if c not in self.output_columns]
        columns = ([ROW_ID] if self.positional else []) + inputs + list(self.output_columns)
        if self.out_format != "parquet":
            return columns, None
        import pyarrow as pa

        types = {ROW_ID: pa.int64(), **{c: survey.schema.field(c).type for c in inputs}, **arrow_types(),
                 TOOL_CALLS_COLUMN: pa.string()}  # (JSON text: each call's arguments are of its own shape)
        return columns, pa.schema([pa.field(c, types[c]) for c in columns])

    @functools.cached_property
    def model_name(self) -> str:
        from gristmill.paths import DEFAULT_MODEL_NAME

        return self.args.deployment_url if self.args.deployment_url else (
            self.config.engine.model or DEFAULT_MODEL_NAME)

    # -- the run --------------------------------------------------------------------------

    def run(self) -> int:
        args = self.args
        try:
            resuming = args.resume and os.path.exists(args.output)
            written, end = written_rows(args.output, self.ids, self.batch_file, self.columns,
                                        self.output_columns) if resuming else ([], 0)
            rows = self.source.rows()
            self.ok, failed = skip_written(rows, written, self.ids, args.output)
            self.failed = len(failed)
            self.skipped = self.written = len(written)
            open_outputs = functools.partial(self._open_outputs, end if resuming else None, failed)
            if self.total is None or self.skipped < self.total:
                processor = self._processor()
                # (a batch line's model names its adapter where the job has adapters, or a server has)
                named_models = bool(getattr(self.config, "lora_modules", None) or args.deployment_url)
                slots = input_slots(rows, self.skipped, self.ids, self.batch_file, args.prompt_column,
                                    args.messages_column, self.task, named_models)
                self._write_all(processor, whole_lines(merged(processor, slots, self.task)), open_outputs)
            else:  # nothing is left: no engine to start
                open_outputs()
        except KeyboardInterrupt as exc:
            self._close()
            print(self._interrupted(), file=sys.stderr)
            return 128 + getattr(exc, "signum", signal.SIGINT)
        except (InputError, OSError, GristmillError, UserFunctionError) as exc:
            self._close()
            message = str(exc) if isinstance(exc, (InputError, OSError)) else error_string(exc)
            raise SystemExit(f"error: {message}{self._where()}") from None
        self._close()
        self._summary()
        return 0

    def _open_outputs(self, resume_end: int | None, failed: list[dict]) -> None:
        """Cut and open the output and the errors file, once the engine is up (a job that
        cannot start, or a refused --resume, leaves both as they were). `resume_end`: where
        the rows kept by --resume end; `failed`: the kept rows that failed."""
        if self.args.errors:
            self.errors = JsonlWriter(self.args.errors)
            for row in failed:
                self.errors.write(row)
        if resume_end is not None:
            cut_at(self.args.output, resume_end)
        self.writer = self._open_writer(append=resume_end is not None)

    def _processor(self):
        """What runs the rows: the processor, or (--runner ray) Ray Data running it."""
        processor = build_processor(self.config)
        if self.args.runner == "local":
            return processor
        try:
            runner = extras.load(extras.BATCH_RUNNERS[self.args.runner])
        except ImportError as exc:
            raise InputError(f"--runner {self.args.runner}: {exc}") from None
        return runner(processor, self.args.address)

    # -- writing --------------------------------------------------------------------------

    def _open_writer(self, append: bool):
        if self.out_format == "csv":
            return CsvWriter(self.args.output, self.columns, append)
        if self.out_format == "parquet":
            return ParquetWriter(self.args.output, self.schema)
        return JsonlWriter(self.args.output, append)

    def _write_all(self, processor, stream, open_outputs) -> None:
        from tqdm import tqdm

        bar = None

        def rows_start():  # the engine is up: the clock starts, the files open, the bar starts
            nonlocal bar
            self.started = time.monotonic()
            open_outputs()
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
                    self._write_one(out)
                    elapsed = max(time.monotonic() - self.started, 1e-9)
                    bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s, {self.failed} errors", refresh=False)
                    bar.update(1)
        except EngineDeadError as exc:
            if self.started is None and failed_to_start(exc):  # said as generate and serve say it
                raise InputError(model_load_error(self.config.engine.model, exc)) from exc
            raise
        except (InputError, OSError, GristmillError, UserFunctionError):
            raise
        except Exception as exc:
            if self.started is not None or self.args.deployment_url:
                raise
            # The engine did not start: its model could not be loaded (a file cut short, say).
            raise InputError(model_load_error(self.config.engine.model, exc)) from exc
        finally:
            if bar is not None:
                bar.close()

    def _write_one(self, out: dict) -> None:
        if out[ERROR_COLUMN] and self.args.fail_fast:
            raise InputError(f"row {out[self.id_column]!r}: {out[ERROR_COLUMN]}\n--fail-fast stopped the "
                             f"job at this row; fix it, or leave out --fail-fast to write error rows "
                             f"and go on")
        self.writer.write(self._record(out))
        if out[ERROR_COLUMN]:
            self.failed += 1
            if self.errors is not None:
                self.errors.write({**out[INPUT_COLUMN], ERROR_COLUMN: out[ERROR_COLUMN]})
        else:
            self.ok += 1
            self.tokens += out["num_generated_tokens" if self.task == "generate" else "num_input_tokens"]
        self.written += 1
        if (self.written - self.skipped) % self.config.batch_size == 0:
            self.writer.flush()
            if self.errors is not None:
                self.errors.flush()

    def _record(self, out: dict) -> dict:
        if self.batch_file:
            return batch_output_line(out[INPUT_COLUMN], out, self.model_name)
        record = {ROW_ID: out[ROW_ID]} if self.positional else {}
        record.update(out[INPUT_COLUMN])
        # (an error row has no prompt logprobs: an empty list, the column's type)
        record.update({column: out.get(column, []) if column == PROMPT_LOGPROBS_COLUMN
                       else out.get(column) if column in (REASONING_COLUMN, TOOL_CALLS_COLUMN) else out[column]
                       for column in self.output_columns})
        if REASONING_COLUMN in out and self.out_format == "jsonl":
            record[REASONING_COLUMN] = out[REASONING_COLUMN]
        calls = record.get(TOOL_CALLS_COLUMN)
        if calls is not None and self.out_format != "jsonl":  # CSV and Parquet cells hold them as JSON text
            record[TOOL_CALLS_COLUMN] = json.dumps(calls, ensure_ascii=False)
        return record

    def _close(self) -> None:
        for f in (self.writer, self.errors):
            if f is not None:
                f.close()

    def _where(self) -> str:
        """Where a stopped job left its output, and how to go on; nothing if it never opened it."""
        if self.writer is None:
            return ""
        rows = f"{self.written} row{'' if self.written == 1 else 's'}"
        if self.out_format == "parquet":
            return (f"\n{rows} written to {self.args.output}; run again to start over (write .jsonl or .csv "
                    f"output to be able to --resume)")
        return f"\n{rows} written to {self.args.output}; fix the cause and rerun with --resume to go on"

    def _interrupted(self) -> str:
        """The one line an interrupted job ends with: how much it wrote where, how to go on."""
        rows = f"{self.written} row{'' if self.written == 1 else 's'} written to {self.args.output}"
        if self.out_format == "parquet":
            return (f"interrupted: {rows}; a Parquet output cannot be resumed: run again to start over, or write "
                    f".jsonl or .csv to be able to resume with --resume")
        return f"interrupted, resume with --resume: {rows}"

    def _summary(self) -> None:
        run_rows = self.written - self.skipped
        run_time = max(time.monotonic() - self.started, 1e-9) if self.started is not None else 1e-9
        resumed = f" ({self.skipped} of them kept from before --resume)" if self.skipped else ""
        failed = f"; failed input rows in {self.args.errors}" if self.args.errors else ""
        start = getattr(self.processor, "engine_start_s", None)
        print(f"gristmill batch: {self.ok} rows ok, {self.failed} rows with errors{resumed}; "
              f"{run_figures(run_rows, self.tokens, run_time, start, self.task == 'generate')}; "
              f"output written to {self.args.output}{failed}", file=sys.stderr)
