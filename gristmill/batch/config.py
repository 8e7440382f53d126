"""Processor configs: which engine a processor reaches, and how it batches rows.

Three ways to reach an engine, with the same rows in and the same columns out:
- `EngineProcessorConfig`: the processor owns its engine (started on first use);
- `DeploymentProcessorConfig`: a shared engine made with `gristmill.batch.deploy`, which
  several processors (e.g. the turns of a conversation) use in turn;
- `HttpProcessorConfig`: any OpenAI-compatible server.

Each runs one task (`task`): "generate" (text, the default), or a pooling task: "embed"
(`embeddings`), "classify" (`probs`) or "score" (`score` of a `text_1`, `text_2` pair);
see rows.py for the rows each takes and gives back.

The configs are plain data: the processor opens the engine a config names
(`Processor.open_engine`, processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from gristmill.batch.adapters import check_lora_modules, with_adapters
from gristmill.batch.rows import pooling_params_of, sampling_params_of
from gristmill.config import EngineConfig
from gristmill.errors import RequestError
from gristmill.pooling_params import TASKS

Method = Literal["completions", "chat"]
Task = Literal["generate", "embed", "classify", "score"]


@dataclass(kw_only=True)
class ProcessorConfig:
    """What every processor shares. Invalid values raise RequestError naming the field."""

    #: Rows handed to a stage at a time.
    batch_size: int = 64
    #: Batches in flight at once (read ahead, generating, or waiting to be handed out).
    max_concurrent_batches: int = 4
    #: A failed row becomes an error row (`__inference_error__`) and the job goes on;
    #: False stops the job at the first row error. Fatal errors always stop it.
    should_continue_on_error: bool = False
    #: Render `messages` with the model's chat template.
    apply_chat_template: bool = True
    #: Tokenize `prompt` before generating (rows may bring `tokenized_prompt` instead).
    tokenize: bool = True
    #: Run the engine; off, rows only go through the template and tokenizer stages.
    generate: bool = True
    #: Fill `generated_text`; off, only `generated_tokens` is filled (an HTTP server that
    #: returns no token ids, such as OpenAI's API, still fills the text).
    detokenize: bool = True
    #: What every row is for: "generate" (text), or a pooling task: "embed" (the column
    #: `embeddings`), "classify" (`probs`) or "score" (`score` of the row's `text_1`, `text_2`).
    task: Task = "generate"
    #: Defaults for every row's `sampling_params` (a row's own values win); task "generate".
    sampling_params: dict = field(default_factory=dict)
    #: Variables for every row's chat template (Qwen3's {"enable_thinking": False}); a
    #: row's own `chat_template_kwargs` are merged over them (its values win, key by key).
    chat_template_kwargs: dict | None = None
    #: Defaults for every row's `pooling_params` (PoolingParams fields: dimensions,
    #: normalize, use_activation, truncate_prompt_tokens; a row's own values win); pooling tasks.
    pooling_params: dict = field(default_factory=dict)
    #: Column whose value names a row in errors and logs; None = its input position.
    id_column: str | None = None
    #: On a Ray Dataset only: Ray options of the actors that run this stage, e.g.
    #: {"num_cpus": 2, "memory": 4e9}. Defaults: an engine actor reserves 1 CPU; an actor
    #: that only calls a deployment or a server reserves none (see docs/ray.md).
    ray_actor_options: dict | None = None

    def __post_init__(self):
        _check(_positive_int(self.batch_size), "batch_size", f"must be a positive integer, got {self.batch_size!r}")
        _check(_positive_int(self.max_concurrent_batches), "max_concurrent_batches",
               f"must be a positive integer, got {self.max_concurrent_batches!r}")
        for name in ("should_continue_on_error", "apply_chat_template", "tokenize", "generate", "detokenize"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be True or False, got {value!r}")
        _check(isinstance(self.sampling_params, dict), "sampling_params",
               f"must be a dict of SamplingParams fields, got {type(self.sampling_params).__name__}")
        _check(self.chat_template_kwargs is None or isinstance(self.chat_template_kwargs, dict),
               "chat_template_kwargs", f"must be a dict of chat template variables or None, got "
               f"{type(self.chat_template_kwargs).__name__}")
        _check(self.task in TASKS, "task", f"must be one of {', '.join(map(repr, TASKS))}, got {self.task!r}")
        _check(isinstance(self.pooling_params, dict), "pooling_params",
               f"must be a dict of PoolingParams fields, got {type(self.pooling_params).__name__}")
        pooling = self.task != "generate"
        _check(not (pooling and self.sampling_params), "sampling_params",
               f"sampling_params apply to task 'generate'; task {self.task!r} samples nothing: leave them out, "
               f"or set pooling_params")
        _check(pooling or not self.pooling_params, "pooling_params",
               "pooling_params apply to a pooling task (embed, classify, score); set task, or leave them out")
        _check(not (pooling and not self.generate), "generate",
               f"generate=False runs only the tokenize stage of task 'generate'; task {self.task!r} needs the engine")
        try:  # checked now, not on every row
            sampling_params_of({}, self.sampling_params)
            pooling_params_of({}, self.pooling_params)
        except RequestError as exc:
            what = "pooling_params" if pooling else "sampling_params"
            raise RequestError(f"processor config {what}: {exc.message}", param=exc.param) from None
        _check(self.id_column is None or isinstance(self.id_column, str), "id_column",
               f"must be a column name or None, got {self.id_column!r}")
        _check(self.ray_actor_options is None or isinstance(self.ray_actor_options, dict), "ray_actor_options",
               f"must be a dict of Ray actor options such as {{'num_cpus': 1}}, got "
               f"{type(self.ray_actor_options).__name__}")


@dataclass(kw_only=True)
class _EngineBacked(ProcessorConfig):
    #: Times a dead engine is restarted during one job; the rows it had in flight are
    #: run again (a row that kills it every time ends as an error row). Past this, the
    #: job fails with EngineDeadError.
    max_engine_restarts: int = 0

    def __post_init__(self):
        super().__post_init__()
        _check(_int(self.max_engine_restarts) and self.max_engine_restarts >= 0,
               "max_engine_restarts", f"must be an integer >= 0, got {self.max_engine_restarts!r}")


@dataclass(kw_only=True)
class EngineProcessorConfig(_EngineBacked):
    """The processor owns its engine(s): started on first use, shut down when the
    processor's output is exhausted or closed."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    #: Engine replicas, each its own engine-core process; rows go to the least busy.
    #: With device "cuda" or "auto" on several GPUs, replica i runs on GPU i % GPUs;
    #: replicas sharing a GPU split its gpu_memory_utilization (`gristmill.gpus`).
    concurrency: int = 1
    #: LoRA adapters rows may name in their `lora` or `model` column, by name: {"name":
    #: "path/to/peft-adapter"}. Turns the engine's enable_lora on (with a slot per adapter,
    #: up to 4, unless the EngineConfig turned it on itself); see docs/lora.md.
    lora_modules: dict[str, str] | None = None

    def __post_init__(self):
        super().__post_init__()
        _check(isinstance(self.engine, EngineConfig), "engine",
               f"must be an EngineConfig, got {type(self.engine).__name__}")
        _check(_positive_int(self.concurrency), "concurrency", f"must be a positive integer, got {self.concurrency!r}")
        self.lora_modules = check_lora_modules(self.lora_modules) or None
        self.engine = with_adapters(self.engine, self.lora_modules)
        # The engine runs the processor's task: "auto" becomes it (and the model is checked
        # able to when the engine starts); another task is a conflict.
        if self.engine.task == "auto":
            self.engine = replace(self.engine, task=self.task)
        _check(self.engine.task == self.task, "task",
               f"the processor runs task {self.task!r} but its engine's EngineConfig.task is {self.engine.task!r}; "
               f"make them the same (or leave EngineConfig.task 'auto')")


@dataclass(kw_only=True)
class DeploymentProcessorConfig(ProcessorConfig):
    """Rows go to the shared engine deployed under `deployment_name`: one made with
    `gristmill.batch.deploy` in this process, or with `app_name`, a Ray Serve deployment
    made with `gristmill.ray.deploy` (reached through a deployment handle)."""

    deployment_name: str
    #: The Ray Serve application holding the deployment; None = a `gristmill.batch.deploy`
    #: deployment in this process (not reachable from a Ray Dataset's workers).
    app_name: str | None = None
    #: "chat": every row's `messages` go through the chat template; "completions":
    #: every row's `prompt` is completed; None: `messages` if a row has them, else `prompt`.
    method: Method | None = None

    def __post_init__(self):
        super().__post_init__()
        _check(isinstance(self.deployment_name, str) and bool(self.deployment_name), "deployment_name",
               f"must name a deployment made with gristmill.batch.deploy, got {self.deployment_name!r}")
        _check(self.app_name is None or (isinstance(self.app_name, str) and bool(self.app_name)), "app_name",
               f"must name a Ray Serve application made with gristmill.ray.deploy, or be None, got "
               f"{self.app_name!r}")
        _check_method(self.method, self.task)
        _check(self.app_name is None or self.task == "generate", "task",
               f"a Ray Serve deployment (app_name) takes generating rows only; for task {self.task!r} use a "
               f"gristmill.batch.deploy deployment, or HttpProcessorConfig on the Serve app's URL")


@dataclass(kw_only=True)
class HttpProcessorConfig(ProcessorConfig):
    """Rows go to an OpenAI-compatible server (`gristmill serve`, vLLM, OpenAI ...)."""

    #: Base URL of the API, e.g. "http://127.0.0.1:8000/v1".
    url: str
    #: Task "generate": "chat" posts rows' `messages` to /chat/completions; "completions"
    #: posts `prompt` to /completions; None: `messages` if a row has them, else `prompt`.
    #: (Task "embed" posts to /embeddings, "classify" to /classify, "score" to /score.)
    method: Method | None = None
    #: Model name sent with each request; None = the first model of GET {url}/models.
    model: str | None = None
    api_key: str | None = None
    #: Most requests started per second; None = no limit.
    qps: float | None = None
    #: Retries of one request on 429, 408, 5xx and connection errors (exponential
    #: backoff with jitter); after them a 429/5xx row is an error row, and a server that
    #: stays unreachable stops the job.
    max_retries: int = 5
    #: Requests in flight at once.
    concurrency: int = 16
    #: Longest wait for one response; past it the row is an error row (not retried).
    request_timeout_s: float = 120.0

    def __post_init__(self):
        super().__post_init__()
        _check(isinstance(self.url, str) and self.url.startswith(("http://", "https://")), "url",
               f"must be an http(s) URL such as 'http://127.0.0.1:8000/v1', got {self.url!r}")
        _check_method(self.method, self.task)
        _check(self.qps is None or (isinstance(self.qps, (int, float)) and self.qps > 0), "qps",
               f"must be > 0 or None, got {self.qps!r}")
        _check(_int(self.max_retries) and self.max_retries >= 0, "max_retries",
               f"must be an integer >= 0, got {self.max_retries!r}")
        _check(_positive_int(self.concurrency), "concurrency", f"must be a positive integer, got {self.concurrency!r}")
        _check(isinstance(self.request_timeout_s, (int, float)) and self.request_timeout_s > 0,
               "request_timeout_s", f"must be a number of seconds > 0, got {self.request_timeout_s!r}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise RequestError(f"processor config {name}: {message}", param=name)


def _check_method(method, task: str) -> None:
    _check(method in ("completions", "chat", None), "method",
           f"must be 'completions', 'chat' or None (by row), got {method!r}")
    _check(method is None or task == "generate", "method",
           f"chooses how rows generate; task {task!r} takes no method: leave it None")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value) -> bool:
    return _int(value) and value > 0
