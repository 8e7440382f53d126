"""Processors on Ray Data: `processor(dataset)` returns a Dataset.

The stages, as Ray runs them:
- `preprocess` and `postprocess`: `Dataset.map` tasks (postprocess skips error rows);
- the chat template (EngineProcessorConfig): `map_batches` tasks that render rows'
  `messages` into `prompt`;
- the engine stage: an actor pool of `concurrency` actors. For an EngineProcessorConfig
  each actor owns an engine (its own engine-core process) that tokenizes, generates and
  detokenizes its batches exactly as the local runner does (tokenizing and detokenizing
  stay beside the engine: stop strings and incremental text need them there); for a
  DeploymentProcessorConfig (with app_name) or an HttpProcessorConfig, one actor sends
  the rows to the Serve deployment or the server, which applies its own template.

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
import os
import pickle
import socket
import warnings

from gristmill.batch import runtime
from gristmill.batch.config import DeploymentProcessorConfig, EngineProcessorConfig, ProcessorConfig
from gristmill.batch.processor import Processor, call_user, naming_row, needs_template, row_id_of
from gristmill.batch.rows import ERROR_COLUMN, TEMPLATE_ERROR_COLUMN, TEMPLATED_COLUMN
from gristmill.batch.tables import arrow_table
from gristmill.errors import EngineDeadError, GristmillError, RequestError, error_string, last_line, root_cause

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
    `processor(dataset)` comes here (see gristmill.extras)."""
    import ray.data

    config = processor.config
    actors, options = stage_actors(config)
    pre = {"num_cpus": 1, **(processor.preprocess_map_kwargs or {})}
    post = {"num_cpus": 1, **(processor.postprocess_map_kwargs or {})}
    check_fits(actors, options, max(pre["num_cpus"], post["num_cpus"]))
    if processor.preprocess is not None:
        dataset = dataset.map(_UserMap("preprocess", processor.preprocess, config.id_column), **pre)
    if isinstance(config, EngineProcessorConfig) and config.apply_chat_template:
        dataset = dataset.map_batches(_ChatTemplate(config, encoded), batch_size=config.batch_size,
                                      batch_format="pyarrow", zero_copy_batch=False, **pre)
    # Batches of one actor run on its engine together (continuous batching across them).
    compute = ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=config.max_concurrent_batches,
                                         enable_true_multi_threading=True)
    with warnings.catch_warnings():  # max_restarts has no named parameter yet
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        dataset = dataset.map_batches(
            _StageActor, fn_constructor_kwargs={"config": config, "encoded": encoded}, compute=compute,
            batch_size=config.batch_size, batch_format="pyarrow", zero_copy_batch=False, **options)
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


def check_fits(actors: int, options: dict, task_cpus: float) -> None:
    """Fail now, saying what to change, when the stage's actors and one map task can never
    run at once on this cluster: Ray would wait for the CPUs for ever, silently."""
    total = connect().cluster_resources().get("CPU", 0.0)
    need = actors * float(options.get("num_cpus") or 0) + task_cpus
    if need > total:
        raise RequestError(
            f"this processor needs {need:g} CPUs at once on Ray ({actors} actor(s) x num_cpus="
            f"{options.get('num_cpus')} + {task_cpus:g} for a map task) but the cluster has {total:g}; lower "
            f"concurrency, set ray_actor_options={{'num_cpus': ...}} (and num_cpus in preprocess_map_kwargs / "
            f"postprocess_map_kwargs), or add CPUs", param="ray_actor_options")


class _ChatTemplate:
    """The chat-template stage as tasks: rows whose `messages` are what they send get
    `prompt` = the rendered chat (the engine stage tokenizes it without special tokens,
    and its faults and stop strings see the text). The tokenizer loads once per worker,
    and only when a row needs it."""

    def __init__(self, config: EngineProcessorConfig, encoded: bool):
        self.config, self.encoded = config, encoded

    def __call__(self, batch):
        from gristmill.tokenizer import render_chat

        rows = _rows_of(batch, self.encoded)
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not needs_template(row, self.config):
                continue
            try:
                row["prompt"] = render_chat(_tokenizer(self.config), row["messages"], add_generation_prompt=True)
                row[TEMPLATED_COLUMN] = True
            except GristmillError as exc:
                if not self.config.should_continue_on_error:
                    raise naming_row(exc, row_id_of(self.config, row, f"batch row {i}")) from None
                row[TEMPLATE_ERROR_COLUMN] = error_string(exc)
        return _batch_of(rows, self.encoded)


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
    if encoded:
        import pyarrow as pa
        return pa.table({ENCODED_COLUMN: pa.array([pickle.dumps(row) for row in rows], pa.binary())})
    return arrow_table(rows)


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


def connect(address: str | None = None):
    """Ray, connected to the cluster at `address` (None: RAY_ADDRESS, or a new local one).
    GRISTMILL_FAULTS, when set here, is set on the cluster's workers for this job too."""
    from gristmill.ray.requirement import require_ray

    ray = require_ray()
    if not ray.is_initialized():
        _check_reachable(address or os.environ.get("RAY_ADDRESS"))
        env = {name: os.environ[name] for name in _PASSED_ENV if name in os.environ}
        ray.init(address=address, runtime_env={"env_vars": env} if env else None, include_dashboard=False)
    return ray


_PASSED_ENV = ("GRISTMILL_FAULTS",)
_CONNECT_TIMEOUT_S = 5.0


def _check_reachable(address: str | None) -> None:
    """A cluster address that nothing answers at fails in seconds (Ray itself would keep
    trying to reach it for minutes)."""
    if not address or address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        raise EngineDeadError(f"no Ray cluster answers at {address} ({type(exc).__name__}: {exc}); start one "
                              f"with `ray start --head` and pass the address it prints, or leave the address "
                              f"out to start a local cluster") from None
