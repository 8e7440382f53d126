"""Processors: rows in, one output row per input row out, in order, exactly once.

    processor = build_processor(EngineProcessorConfig(engine=EngineConfig()),
                                preprocess=lambda row: {**row, "prompt": row["question"]},
                                postprocess=lambda row: {"answer": row["generated_text"], **row})
    out = processor(rows)   # list / iterable (streamed) / pyarrow Table / pandas DataFrame

How rows move: a feeder thread reads the input (lazily: at most `max_concurrent_batches`
batches are read ahead), runs `preprocess` and hands each batch to the batch runtime's
event loop, where its rows run through the stages (chat template, tokenize, generate,
detokenize) concurrently; the caller's thread takes finished batches in input order,
runs `postprocess` and yields the rows. Nothing that blocks runs on the loop, so
processors chained as `p2(p1(rows))` run at once.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from gristmill import extras
from gristmill.batch import runtime
from gristmill.batch.adapters import row_model
from gristmill.batch.config import (DeploymentProcessorConfig, EngineProcessorConfig, HttpProcessorConfig,
                                    ProcessorConfig)
from gristmill.batch.deployment import get_deployment
from gristmill.batch.engines import RowFailed, start_pool
from gristmill.batch.row_tools import tool_fields_of
from gristmill.batch.rows import (ERROR_COLUMN, TEMPLATE_ERROR_COLUMN, TEMPLATED_COLUMN, RowRequest,
                                  chat_template_kwargs_of, error_columns, has_values, is_error_row, pooled_columns,
                                  pooling_params_of, result_columns, sampling_params_of)
from gristmill.batch.stages import RowEngine
from gristmill.batch.tables import from_rows, to_rows
from gristmill.errors import GristmillError, RequestError, is_fatal
from gristmill.prompts import is_token_ids
from gristmill.structured.spec import short

Row = dict


class UserFunctionError(RuntimeError):
    """A user's preprocess or postprocess raised; the job stops (the original error is
    the `__cause__`)."""


def build_processor(config: ProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None, *,
                    preprocess_map_kwargs: dict | None = None,
                    postprocess_map_kwargs: dict | None = None) -> "Processor":
    """A processor for `config`. The map kwargs apply on a Ray Dataset only: the Ray
    options of the preprocess / postprocess `Dataset.map` tasks (e.g. {"num_cpus": 0.5})."""
    if not isinstance(config, (EngineProcessorConfig, DeploymentProcessorConfig, HttpProcessorConfig)):
        raise RequestError(f"build_processor takes an EngineProcessorConfig, DeploymentProcessorConfig or "
                           f"HttpProcessorConfig, got {type(config).__name__}", param="config")
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


class Processor:
    def __init__(self, config: ProcessorConfig, preprocess=None, postprocess=None,
                 preprocess_map_kwargs: dict | None = None, postprocess_map_kwargs: dict | None = None):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.preprocess_map_kwargs = preprocess_map_kwargs
        self.postprocess_map_kwargs = postprocess_map_kwargs
        #: Seconds the last `stream` took to open its engine (to start it, for an engine
        #: of its own): not part of the rows' running time.
        self.engine_start_s: float | None = None
        #: Called (no arguments) once the engine is open and rows start to run.
        self.on_rows_start: Callable[[], None] | None = None

    def __call__(self, rows):
        """Rows in, rows out, of the same kind: a list, a pyarrow Table or a pandas
        DataFrame come back whole; any other iterable comes back as a generator that
        streams (the input is read as it goes); a Ray Dataset comes back as a Dataset
        with this processor's stages on Ray Data (see docs/ray.md)."""
        runner = extras.dataset_runner(rows)
        if runner is not None:
            return runner(self, rows)
        kind, row_iter = to_rows(rows)
        out = self.stream(row_iter)
        return out if kind == "iterable" else from_rows(list(out), kind)

    def stream(self, rows: Iterable[Row]) -> Iterator[Row]:
        """Output rows as they are ready, in input order. The engine starts when the first
        row is asked for and (if the processor owns it) stops when the stream ends."""
        opening = time.monotonic()
        engine = self.open_engine()
        self.engine_start_s = time.monotonic() - opening
        try:
            if self.on_rows_start is not None:
                self.on_rows_start()
            yield from self._pipeline(engine, rows)
        finally:
            runtime.call(engine.close())

    def open_engine(self) -> RowEngine:
        """The engine of this processor's config, ready for rows (started, for an engine of
        its own: blocks meanwhile, so never on the batch runtime loop). `stream` opens one
        per run; a runner that drives `process_batch` itself (an actor of the Ray runner)
        opens one and closes it, on the batch runtime, when done."""
        config = self.config
        if isinstance(config, EngineProcessorConfig):
            return start_pool(config.engine, config.concurrency, config.max_engine_restarts, config.lora_modules)
        if isinstance(config, DeploymentProcessorConfig):
            if config.app_name is not None:  # a Ray Serve deployment, in the Ray extra
                return extras.load(extras.SERVE_ENGINE)(config.deployment_name, config.app_name)
            return get_deployment(config.deployment_name).borrow(config.task)
        if isinstance(config, HttpProcessorConfig):
            from gristmill.batch.http import HttpEngine  # (httpx: imported by the processors that need it)
            return HttpEngine(config)
        raise NotImplementedError(f"{type(config).__name__} names no engine")

    # -- the pipeline -------------------------------------------------------------------

    def _pipeline(self, engine, rows: Iterable[Row]) -> Iterator[Row]:
        slots = threading.Semaphore(self.config.max_concurrent_batches)
        pending: queue.Queue = queue.Queue()
        stop = threading.Event()
        feeder = threading.Thread(target=self._feed, args=(engine, rows, slots, pending, stop),
                                  name="gristmill-batch-feeder", daemon=True)
        feeder.start()
        try:
            while (item := pending.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                batch = item.result()
                slots.release()
                for row_id, row in batch:
                    yield row if is_error_row(row) else call_user("postprocess", self.postprocess, row, row_id)
        finally:
            stop.set()
            slots.release()  # wakes a feeder waiting for a slot, so it sees `stop`
            while True:
                try:
                    item = pending.get_nowait()
                except queue.Empty:
                    break
                if hasattr(item, "cancel"):
                    item.cancel()

    def _feed(self, engine, rows, slots: threading.Semaphore, pending: queue.Queue, stop: threading.Event):
        """On the feeder thread: read, preprocess and submit batches, at most
        max_concurrent_batches ahead of the consumer."""
        try:
            positions = itertools.count()
            for batch in _batched(rows, self.config.batch_size):
                prepared = []
                for row in batch:
                    row_id = row_id_of(self.config, row, next(positions))
                    prepared.append((row_id, call_user("preprocess", self.preprocess, row, row_id)))
                slots.acquire()
                if stop.is_set():
                    return
                pending.put(runtime.submit(self.process_batch(engine, prepared)))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            pending.put(exc)
        finally:
            pending.put(_END)

    # -- on the runtime loop --------------------------------------------------------------

    async def process_batch(self, engine: RowEngine, batch: list[tuple[object, Row]]) -> list[tuple[object, Row]]:
        """(row id, output row) of each (row id, row) of `batch`, in order: its rows run at
        once through the chat template, tokenize and generate stages. A row's error makes
        an error row, or (should_continue_on_error off, or a fatal error) is raised."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._process_row(engine, row_id, row)) for row_id, row in batch]
        except BaseExceptionGroup as group_error:
            raise _first(group_error) from None
        return [(row_id, task.result()) for (row_id, _), task in zip(batch, tasks)]

    async def _process_row(self, engine: RowEngine, row_id, row: Row) -> Row:
        config = self.config
        try:
            if not isinstance(row, dict):
                raise RequestError(f"a row must be a dict, got {type(row).__name__}", param="row")
            if row.get(TEMPLATE_ERROR_COLUMN):  # failed in the chat-template stage before this one
                return self._error_row(row, row[TEMPLATE_ERROR_COLUMN])
            if config.task != "generate":
                request = pooling_request(config, row_id, row)
                start = time.perf_counter()
                pooled = await engine.pool(request)
                return {**row, **pooled_columns(config.task, pooled, time.perf_counter() - start)}
            request = self._prepare(engine, row_id, row)
            if not config.generate:
                return {**row, "prompt": request.prompt, "tokenized_prompt": request.prompt_token_ids or [],
                        ERROR_COLUMN: ""}
            start = time.perf_counter()
            generated = await engine.generate(request)
            return {**row, **result_columns(generated, time.perf_counter() - start, config.detokenize)}
        except RowFailed as failed:
            error = failed.error
        except Exception as exc:  # noqa: BLE001 - sorted below: fatal, stop, or an error row
            if is_fatal(exc):
                raise
            error = exc
        if not config.should_continue_on_error:
            raise naming_row(error, row_id)
        return self._error_row(row if isinstance(row, dict) else {}, error)

    def _error_row(self, row: Row, error: BaseException | str) -> Row:
        if not self.config.generate:  # the columns of the rows that went well, with the error
            return {**row, "tokenized_prompt": [], ERROR_COLUMN: error_columns(error)[ERROR_COLUMN]}
        return {**row, **error_columns(error, self.config.task)}

    def _prepare(self, engine: RowEngine, row_id, row: Row) -> RowRequest:
        """The chat template and tokenize stages: a row as an engine request."""
        config = self.config
        if has_values(row.get("pooling_params")):
            raise RequestError("the row has pooling_params, which apply to a pooling task (embed, classify, score), "
                               "and this processor generates text (task 'generate'): leave them out, or set the "
                               "processor's task", param="pooling_params")
        params = sampling_params_of(row, config.sampling_params)
        method = getattr(config, "method", None)
        prompt, messages, token_ids = row.get("prompt"), row.get("messages"), row.get("tokenized_prompt")
        if method == "chat" and messages is None:
            raise RequestError("method='chat' needs a 'messages' column (a list of {'role', 'content'})",
                               param="messages")
        if method == "completions" and prompt is None and token_ids is None:
            raise RequestError("method='completions' needs a 'prompt' (or 'tokenized_prompt') column",
                               param="prompt")
        if prompt is None and messages is None and token_ids is None:
            raise RequestError("a row needs 'prompt', 'messages' or 'tokenized_prompt'", param="prompt")
        if method == "chat":  # the messages are what every row sends, not token ids it brings too
            token_ids = None
        if token_ids is not None and not is_token_ids(token_ids):  # (lists, numpy arrays from Ray Data)
            raise RequestError(f"'tokenized_prompt' must be a list of token ids (integers), got "
                               f"{type(token_ids).__name__} {short(token_ids)}; in a CSV cell write it as "
                               f"JSON, such as [1, 2, 3]",
                               param="tokenized_prompt")
        templated = bool(row.get(TEMPLATED_COLUMN))  # rendered by a stage before this one
        tool_fields = tool_fields_of(row)
        model = row_model(row)
        if messages is not None and not templated and needs_template(row, config):
            kwargs = chat_template_kwargs_of(row, config.chat_template_kwargs)
            return engine.stages.chat(RowRequest(row_id, None, messages, token_ids, params,
                                                 chat_template_kwargs=kwargs, tool_fields=tool_fields, model=model),
                                      config)
        if tool_fields is not None and not templated:
            raise RequestError(f"the row has {', '.join(tool_fields)}, which apply to a chat: send its 'messages' "
                               f"(with the chat template on), or leave them out", param=next(iter(tool_fields)))
        if prompt is not None and not isinstance(prompt, str):
            raise RequestError(f"'prompt' must be a string, got {type(prompt).__name__}", param="prompt")
        # A rendered chat holds its own special tokens.
        request = RowRequest(row_id, prompt, None, token_ids, params, add_special_tokens=not templated,
                             chat=templated, tool_fields=tool_fields, model=model)
        return engine.stages.tokenize(request, config)


def pooling_request(config: ProcessorConfig, row_id, row: Row) -> RowRequest:
    """A row of a pooling processor as an engine request: `prompt` or `tokenized_prompt`
    (embed, classify), or `text_1` and `text_2` (score). The engine tokenizes (a pair
    together, and `truncate_prompt_tokens` cuts by its tokenizer), so no stage runs first."""
    task = config.task
    if has_values(row.get("sampling_params")):
        raise RequestError(f"the row has sampling_params, which apply to task 'generate', and this processor "
                           f"runs task {task!r}: leave them out (pooling_params hold what a row of task "
                           f"{task!r} may set)", param="sampling_params")
    params = pooling_params_of(row, config.pooling_params)
    model = row_model(row)
    if task == "score":
        first, second = row.get("text_1"), row.get("text_2")
        if not isinstance(first, str) or not isinstance(second, str):
            raise RequestError(f"a score row needs 'text_1' and 'text_2', the two texts it scores (strings); got "
                               f"text_1={short(first)}, text_2={short(second)}", param="text_1")
        return RowRequest(row_id, first, None, None, None, task=task, pooling_params=params, text_pair=second,
                          model=model)
    prompt, token_ids = row.get("prompt"), row.get("tokenized_prompt")
    if row.get("messages") is not None and prompt is None and token_ids is None:
        raise RequestError(f"task {task!r} takes a row's 'prompt' (text) or 'tokenized_prompt', not 'messages'",
                           param="messages")
    if prompt is None and token_ids is None:
        raise RequestError(f"a row of task {task!r} needs 'prompt' (text) or 'tokenized_prompt'", param="prompt")
    if token_ids is not None and not is_token_ids(token_ids):
        raise RequestError(f"'tokenized_prompt' must be a list of token ids (integers), got "
                           f"{type(token_ids).__name__} {short(token_ids)}", param="tokenized_prompt")
    if token_ids is None and not isinstance(prompt, str):
        raise RequestError(f"'prompt' must be a string, got {type(prompt).__name__}", param="prompt")
    token_ids = [int(t) for t in token_ids] if token_ids is not None else None  # (numpy arrays from Ray Data)
    return RowRequest(row_id, prompt, None, token_ids, None, task=task, pooling_params=params, model=model)


def row_id_of(config: ProcessorConfig, row: Row, position):
    """The row's id: its `id_column` value, else `position`."""
    column = config.id_column
    if column is not None and isinstance(row, dict) and column in row:
        return row[column]
    return position


def call_user(what: str, fn, row: Row, row_id):
    if fn is None:
        return row
    try:
        result = fn(row)
    except Exception as exc:
        raise UserFunctionError(f"{what} raised on row {row_id!r}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, dict):
        raise UserFunctionError(f"{what} must return a dict (the row), got {type(result).__name__} "
                                f"on row {row_id!r}")
    return result


def needs_template(row: Row, config: ProcessorConfig) -> bool:
    """Whether the row's `messages` are what it sends (rendered by the chat template).
    A row with both `messages` and `prompt` sends its messages when the chat template is
    on (as the CLI, and Ray Data LLM's chat-template stage, which writes the prompt), its
    prompt when it is off; `method` decides for every row; token ids a row brings are
    what it sends, unless method="chat"."""
    if row.get("messages") is None:
        return False
    method = getattr(config, "method", None)
    if method is not None:
        return method == "chat"
    if row.get("tokenized_prompt") is not None:
        return False
    return row.get("prompt") is None or config.apply_chat_template


_END = object()


def _batched(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    iterator = iter(rows)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _first(group: BaseExceptionGroup) -> BaseException:
    """The error to raise for a batch: a fatal one first, else the first."""
    leaves = list(_leaves(group))
    return next((e for e in leaves if is_fatal(e)), leaves[0])


def _leaves(error: BaseException):
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def naming_row(error: BaseException, row_id) -> BaseException:
    """`error` with the row's id in its message (same type and fields where we can)."""
    if isinstance(error, GristmillError):
        named = type(error)(f"row {row_id!r}: {error.message}", **error.fields)
        named.__cause__ = error
        return named
    return error
