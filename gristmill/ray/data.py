"""Processors on Ray Data: `processor(dataset)` returns a Dataset.

The stages, as Ray runs them:
- `preprocess` and `postprocess`: `Dataset.map` tasks (postprocess skips error rows);
- the chat template (EngineProcessorConfig of task "generate"): `map_batches` tasks that
  render rows' `messages` into `prompt`;
- the engine stage: an actor pool of `concurrency` actors. For an EngineProcessorConfig
  each actor owns an engine (its own engine-core process) that tokenizes, generates and
  detokenizes its batches exactly as the local runner does (tokenizing and detokenizing
  stay beside the engine: stop strings and incremental text need them there); for a
  DeploymentProcessorConfig (with app_name) or an HttpProcessorConfig, one actor sends
  the rows to the Serve deployment or the server, which applies its own template.

Between preprocess and postprocess the rows travel pickled, one per cell (each input block
encoded on its own), so Ray Data never merges the Arrow types of rows that differ: a row
of another shape is that row's error, never the job's (see process_dataset).

Row errors become error rows inside the actor (`should_continue_on_error`), so they never
cross Ray as exceptions; what does cross (a fatal error, a row error with
`should_continue_on_error=False`, a user function's error) fails the Dataset. Ray's own
retries are bounded: an engine actor is restarted at most `max_engine_restarts` times,
never for ever.

Rows come out in no particular order (Ray Data's default); set
`DataContext.get_current().execution_options.preserve_order = True` to keep input order.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings

from gristmill.batch import runtime
from gristmill.batch.config import DeploymentProcessorConfig, EngineProcessorConfig, ProcessorConfig
from gristmill.batch.processor import Processor, call_user, naming_row, needs_template, row_id_of
from gristmill.batch.row_tools import resolved, tool_fields_of
from gristmill.batch.rows import ERROR_COLUMN, TEMPLATE_ERROR_COLUMN, TEMPLATED_COLUMN, chat_template_kwargs_of
from gristmill.batch.tables import arrow_table, arrow_types
from gristmill.errors import EngineDeadError, GristmillError, RequestError, error_string, last_line, root_cause
from gristmill.ray.cluster import actors_in, check_fits, connect, engine_gpus

#: An engine actor reserves a CPU: it computes. Actors that only wait on a deployment or
#: a server reserve none, so they fit beside the replicas and tasks of a small cluster.
ENGINE_ACTOR_OPTIONS = {"num_cpus": 1}
CLIENT_ACTOR_OPTIONS = {"num_cpus": 0}
#: Rows pickled into one binary column: how `gristmill batch --runner ray` sends rows of
#: any shape through Ray Data without Arrow inferring (and failing on) their types.
ENCODED_COLUMN = "__gristmill_row__"
_CLOSE_TIMEOUT_S = 10.0


def process_dataset(processor: Processor, dataset, encoded: bool = False):
    """`processor`'s stages appended to `dataset` (lazy: nothing runs until it is read);
    `processor(dataset)` comes here (see gristmill.extras). `encoded`: the rows come (and
    go) pickled in ENCODED_COLUMN, as `gristmill batch --runner ray` sends them."""
    import ray.data

    config = processor.config
    actors, options = stage_actors(config)
    if isinstance(config, EngineProcessorConfig):
        engine, options = engine_gpus(config.engine, options, connect().cluster_resources().get("GPU", 0.0))
        config = dataclasses.replace(config, engine=engine)
    pre = {"num_cpus": 1, **(processor.preprocess_map_kwargs or {})}
    post = {"num_cpus": 1, **(processor.postprocess_map_kwargs or {})}
    check_fits(actors, options, max(pre["num_cpus"], post["num_cpus"]), held=actors_in(dataset))
    if isinstance(config, EngineProcessorConfig):
        from gristmill.engine import builder
        builder.resolve_model_dir(config.engine)  # a missing model fails here, not in each actor
    if processor.preprocess is not None:
        dataset = dataset.map(_UserMap("preprocess", processor.preprocess, config.id_column), **pre)
    if not encoded:
        # Up to the engine stage's output, rows travel pickled, one per cell, and each input
        # block is encoded alone (batch_size=None). Ray Data would otherwise merge the Arrow
        # types of the blocks it batches together: a row whose column has another type
        # (`messages` as a string) would fail the whole job, and a struct column (a
        # `logit_bias`) would get every other row's keys, as nulls.
        dataset = dataset.map_batches(_encode_batch, batch_size=None, batch_format="pyarrow",
                                      zero_copy_batch=True, **pre)
    if isinstance(config, EngineProcessorConfig) and config.apply_chat_template and config.task == "generate":
        dataset = dataset.map_batches(_ChatTemplate(config, True), batch_size=config.batch_size,
                                      batch_format="pyarrow", zero_copy_batch=False, **pre)
    # Batches of one actor run on its engine together (continuous batching across them).
    compute = ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=config.max_concurrent_batches,
                                         enable_true_multi_threading=True)
    with warnings.catch_warnings():  # max_restarts has no named parameter yet
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        dataset = dataset.map_batches(
            _StageActor, fn_constructor_kwargs={"config": config, "encoded": True}, compute=compute,
            batch_size=config.batch_size, batch_format="pyarrow", zero_copy_batch=False, **options)
    if not encoded:
        dataset = dataset.map_batches(_decode_batch, batch_size=None, batch_format="pyarrow",
                                      zero_copy_batch=True, **post)
    if processor.postprocess is not None:
        dataset = dataset.map(_UserMap("postprocess", processor.postprocess, config.id_column,
                                       skip_errors=True), **post)
    return dataset


def stage_actors(config: ProcessorConfig) -> tuple[int, dict]:
    """(actors in the engine stage's pool, their Ray options)."""
    if isinstance(config, DeploymentProcessorConfig) and config.app_name is None:
        raise RequestError("on a Ray Dataset a deployment is reached through Ray Serve: set app_name to the "
                           "Serve application made with gristmill.ray.deploy (a gristmill.batch.deploy "
                           "deployment lives in this process only)", param="app_name")
    if isinstance(config, EngineProcessorConfig):
        # A dead actor is restarted (and its batch retried) within the job's restart budget:
        # Ray's default would retry a deterministic crash until its timeout.
        actors, defaults = config.concurrency, {**ENGINE_ACTOR_OPTIONS, "max_restarts": config.max_engine_restarts,
                                                "max_task_retries": config.max_engine_restarts}
    else:
        actors, defaults = 1, {**CLIENT_ACTOR_OPTIONS, "max_restarts": 0, "max_task_retries": 0}
    return actors, {**defaults, **(config.ray_actor_options or {})}


def _encode_batch(batch):
    """One block of rows as Arrow gave them, pickled one per cell (see process_dataset)."""
    return _batch_of([_from_arrow(row) for row in batch.to_pylist()], True)


def _decode_batch(batch):
    """The engine stage's rows, unpickled into the Arrow table of a block."""
    return _batch_of(_rows_of(batch, True), False)


def _from_arrow(row: dict) -> dict:
    """A row as it was before Arrow merged the struct types of its block: the `logit_bias`
    of a row in a block where other rows bias other tokens holds theirs too, as nulls (a
    null bias is never a row's own)."""
    params = row.get("sampling_params")
    if isinstance(params, dict) and isinstance(params.get("logit_bias"), dict):
        bias = {token: value for token, value in params["logit_bias"].items() if value is not None}
        row["sampling_params"] = {**params, "logit_bias": bias or None}
    return row


class _ChatTemplate:
    """The chat-template stage as tasks: rows whose `messages` are what they send get
    `prompt` = the rendered chat (the engine stage tokenizes it without special tokens,
    and its faults and stop strings see the text). The tokenizer loads once per worker,
    and only when a row needs it."""

    def __init__(self, config: EngineProcessorConfig, encoded: bool):
        self.config, self.encoded = config, encoded

    def __call__(self, batch):
        from gristmill.chat.tool_calls import choose_tool_parser
        from gristmill.tokenizer import render_chat

        rows = _rows_of(batch, self.encoded)
        changed = False
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not needs_template(row, self.config):
                continue
            changed = True
            try:
                tokenizer = _tokenizer(self.config)
                tools = resolved(tool_fields_of(row), choose_tool_parser(self.config.engine.tool_call_parser,
                                                                         getattr(tokenizer, "chat_template", None)))
                row["prompt"] = render_chat(tokenizer, row["messages"], add_generation_prompt=True,
                                            template_kwargs=chat_template_kwargs_of(row,
                                                                                   self.config.chat_template_kwargs),
                                            tools=tools.tools if tools is not None else None)
                row[TEMPLATED_COLUMN] = True
            except GristmillError as exc:
                if not self.config.should_continue_on_error:
                    raise naming_row(exc, row_id_of(self.config, row, f"batch row {i}")) from None
                row[TEMPLATE_ERROR_COLUMN] = error_string(exc)
        return _batch_of(rows, self.encoded) if changed else batch  # no chat in it: the batch as it came


_tokenizers: dict = {}


def _tokenizer(config: EngineProcessorConfig):
    from gristmill.engine import builder

    model_dir = builder.resolve_model_dir(config.engine)
    if model_dir not in _tokenizers:
        _tokenizers[model_dir] = builder.load_tokenizer(model_dir, config.engine.cache_dir)[0]
    return _tokenizers[model_dir]


def _rows_of(batch, encoded: bool) -> list:
    if encoded:
        return [pickle.loads(value) for value in batch.column(ENCODED_COLUMN).to_pylist()]
    return batch.to_pylist()


def _batch_of(rows: list, encoded: bool):
    import pyarrow as pa

    if encoded:
        return pa.table({ENCODED_COLUMN: pa.array([pickle.dumps(row) for row in rows], pa.binary())})
    try:
        return arrow_table(rows)
    except (pa.ArrowException, OverflowError):
        # A column Arrow cannot type (logit_bias with int keys, a column of mixed types):
        # Ray's own conversion keeps it as Python objects, as ray.data.from_items does.
        from ray.data.block import BlockAccessor

        names = list(dict.fromkeys(key for row in rows for key in row))
        table = BlockAccessor.batch_to_block({name: [row.get(name) for row in rows] for name in names})
        for name, wanted in arrow_types().items():
            if name in table.column_names and table.schema.field(name).type != wanted:
                try:
                    table = table.set_column(table.column_names.index(name), name, table[name].cast(wanted))
                except (pa.ArrowException, TypeError):
                    pass  # left as Ray typed it
        return table


class _StageActor:
    """One actor of the engine stage: its own engine (or deployment / server client) on
    the batch runtime loop of its process; batches arrive on up to
    max_concurrent_batches threads and run on that loop together."""

    def __init__(self, config: ProcessorConfig, encoded: bool):
        if isinstance(config, EngineProcessorConfig):
            config = dataclasses.replace(config, concurrency=1)  # the pool is of actors
        self.encoded = encoded
        self.processor = Processor(config)
        self.engine = self.processor.open_engine()

    def __call__(self, batch):
        rows = _rows_of(batch, self.encoded)
        config = self.processor.config
        prepared = [(row_id_of(config, row, f"batch row {i}"), row) for i, row in enumerate(rows)]
        done = runtime.call(self.processor.process_batch(self.engine, prepared))
        out = []
        for _, row in done:
            if isinstance(row, dict):
                row.pop(TEMPLATED_COLUMN, None)
                row.pop(TEMPLATE_ERROR_COLUMN, None)
            out.append(row)
        return _batch_of(out, self.encoded)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:  # closing a deployment's engine leaves the deployment up
            try:
                runtime.submit(engine.close()).result(_CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the process is going away; its engine core follows it
                pass


class _UserMap:
    """preprocess / postprocess as a Dataset.map function; errors name the row and stop
    the job (as they do locally)."""

    def __init__(self, what: str, fn, id_column: str | None, skip_errors: bool = False):
        self.what, self.fn, self.id_column, self.skip_errors = what, fn, id_column, skip_errors

    def __call__(self, row: dict) -> dict:
        if self.skip_errors and row.get(ERROR_COLUMN):
            return row
        return call_user(self.what, self.fn, row, row.get(self.id_column) if self.id_column else "?")


def encode_rows(rows) -> list[dict]:
    """Rows as `gristmill batch --runner ray` hands them to Ray Data."""
    return [{ENCODED_COLUMN: pickle.dumps(row)} for row in rows]


def decode_row(record: dict) -> dict:
    return pickle.loads(record[ENCODED_COLUMN])


class DatasetRunner:
    """`gristmill batch --runner ray`: a processor's rows through Ray Data, in input order.

    Rows travel pickled (ENCODED_COLUMN), so rows of any shape reach the engine stage as
    they left the reader; errors that stop the job come back as gristmill errors."""

    def __init__(self, processor, address: str | None = None):
        self.processor = processor
        self.address = address

    def stream(self, rows):
        ray = connect(self.address)
        rows = list(rows)
        if not rows:
            return
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        dataset = process_dataset(self.processor, ray.data.from_items(encode_rows(rows)), encoded=True)
        try:
            for record in dataset.iter_rows():
                yield decode_row(record)
        except Exception as exc:  # noqa: BLE001 - Ray's wrappers, as the error inside them
            if isinstance(exc, GristmillError):
                raise
            cause = root_cause(exc)
            if isinstance(cause, GristmillError):
                raise cause from None
            raise EngineDeadError(f"the job failed on Ray: {type(exc).__name__}: {last_line(exc, 500)}") from None
