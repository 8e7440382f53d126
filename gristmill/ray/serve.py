"""A shared engine as a Ray Serve application: `deploy(EngineConfig(...), name=, app_name=)`.

Each replica owns one AsyncEngine (its own engine-core process) and answers OpenAI-shaped
requests on three methods, `completions`, `chat` and `response` (the Responses API, as
`POST /v1/responses` answers it), through a streaming handle: each yields one whole
response (a dict) and ends. That is how Ray Data LLM's
`ServeDeploymentProcessorConfig` calls a deployment, and how gristmill's
`DeploymentProcessorConfig(deployment_name=, app_name=)` does.

Errors cross the RPC boundary typed: a row's own failure raises RequestError or
GenerationError (both ValueErrors, which Ray Data LLM keeps per-row); a dead engine raises
EngineDeadError and fails the replica's health check within a second, so Serve replaces it.
"""

from __future__ import annotations

import dataclasses
import os

from pydantic import BaseModel, ValidationError
from ray import serve

from gristmill.batch.adapters import check_lora_modules, with_adapters
from gristmill.config import EngineConfig
from gristmill.errors import EngineDeadError, RequestError
from gristmill.lora import LoRARequest

#: A replica reserves no CPU unless told to: on a small cluster Ray Data's actors and
#: tasks take whole CPUs, and a replica holding any share leaves a task unable to start.
DEFAULT_REPLICA_OPTIONS = {"num_cpus": 0}
#: Requests one replica takes at once (Serve's default, 5, would starve its batching).
DEFAULT_MAX_ONGOING_REQUESTS = 256


class EngineServer:
    """One replica: an AsyncEngine behind OpenAI-shaped `completions`, `chat` and `response`."""

    def __init__(self, engine: EngineConfig, model_name: str | None = None, threads: int | None = None,
                 lora_modules: dict[str, str] | None = None):
        from gristmill.engine.async_engine import AsyncEngine
        from gristmill.paths import DEFAULT_MODEL_NAME
        from gristmill.server.lora_modules import LoRAModules
        from gristmill.server.metrics import ServerMetrics
        from gristmill.server.openai_serving import OpenAIServing
        from gristmill.server.responses_api import ResponsesServing

        if threads is not None:  # (deploy's `threads`: the engine's own cpu_threads)
            engine = dataclasses.replace(engine, cpu_threads=threads)
        self.model_name = model_name or engine.model or DEFAULT_MODEL_NAME
        # A request's `model` naming an adapter runs with it, as on the server; each adapter's
        # config is checked before the engine starts (a bad one fails the replica, named).
        loras = LoRAModules(self.model_name, engine.enable_lora, engine.max_lora_rank)
        for name, path in (lora_modules or {}).items():
            loras.add(LoRARequest(name, 1, path))
        self.engine = AsyncEngine(engine)
        self.serving = OpenAIServing(self.engine, self.model_name, ServerMetrics())
        self.serving.loras = loras
        self.responses = ResponsesServing(self.serving)

    async def completions(self, request):
        """An OpenAI completions request (a dict or a pydantic model); yields the response."""
        from gristmill.server.protocol import CompletionRequest
        yield await self.serving.response(False, _body(CompletionRequest, request))

    async def chat(self, request):
        """An OpenAI chat completions request (a dict or a pydantic model); yields the response."""
        from gristmill.server.protocol import ChatCompletionRequest
        yield await self.serving.response(True, _body(ChatCompletionRequest, request))

    async def response(self, request):
        """An OpenAI Responses API request (a dict or a pydantic model), stateless as the
        server's `POST /v1/responses` (which refuses fields it does not know); yields the
        `response` object."""
        from gristmill.server.responses_protocol import ResponsesRequest
        yield await self.responses.response(_body(ResponsesRequest, request, drop=_RAY_DATA_KEYS))

    def pids(self) -> dict:
        """{"replica": this replica's process, "core": its engine core's} (to watch them)."""
        return {"replica": os.getpid(), "core": self.engine.core_pid}

    async def stats(self) -> dict:
        """This replica's engine stats (requests running and waiting, KV blocks, prefix cache)."""
        return await self.engine.stats()

    def check_health(self) -> None:
        """Serve calls this every second; a dead engine makes Serve replace the replica."""
        if self.engine.errored:
            raise EngineDeadError(self.engine.dead_error.message)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


#: The keys Ray Data LLM adds to each request it sends a deployment.
_RAY_DATA_KEYS = ("request_id", "idx_in_batch")


def _body(model: type[BaseModel], request, drop: tuple[str, ...] = ()):
    """The request as `model`, without the keys `drop`: Ray Data LLM sends a dict (with its
    own request_id and idx_in_batch keys, which models that ignore unknown keys ignore) or
    a pydantic model of the caller's."""
    if isinstance(request, BaseModel):
        request = request.model_dump(exclude_none=True)
    if not isinstance(request, dict):
        raise RequestError(f"a request must be a dict (or a pydantic model) of OpenAI request fields, got "
                           f"{type(request).__name__}", param="request")
    request = {key: value for key, value in request.items() if key not in drop}
    try:
        return model.model_validate(request)
    except ValidationError as exc:  # pydantic's own error does not survive pickling well
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg')}"
                            for e in exc.errors())
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        raise RequestError(f"invalid request: {message}", param=str(first[0]) if first else None) from None


def deploy(engine: EngineConfig | None = None, *, name: str = "gristmill", app_name: str = "gristmill",
           num_replicas: int = 1, ray_actor_options: dict | None = None,
           max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS, max_queued_requests: int = -1,
           model_name: str | None = None, threads: int | None = None, lora_modules: dict[str, str] | None = None):
    """Run `engine` as the Ray Serve application `app_name` with deployment `name` and
    return its DeploymentHandle once every replica is ready (connects to or starts Ray).

    `lora_modules` ({"name": "path"}): LoRA adapters a request's `model` (a processor row's
    `lora` or `model` column) may name, as `gristmill serve --lora-modules`; they turn the
    engine's enable_lora on (a slot per adapter, up to 4, unless it was on already).

    `max_queued_requests` caps the requests waiting for a replica (-1: no cap); past it
    callers get back-pressure, which processors retry a few times before failing the job.
    `ray_actor_options` are each replica's Ray options (default {"num_cpus": 0}: see
    docs/ray.md; an engine on "cuda" or "auto" also gets {"num_gpus": 1} when the cluster
    has GPUs, and a fraction of a GPU that fraction of gpu_memory_utilization); `threads`
    sets the engine's cpu_threads (default: the engine's, else Ray's OMP_NUM_THREADS, which
    is the replica's num_cpus when it reserves CPUs). Processors reach it with
    `DeploymentProcessorConfig(deployment_name=name, app_name=app_name)`; Ray Data LLM's
    `ServeDeploymentProcessorConfig(deployment_name=name, app_name=app_name)` too.
    `serve.delete(app_name)` stops it.
    """
    engine = engine or EngineConfig()
    if not isinstance(engine, EngineConfig):
        raise RequestError(f"deploy takes an EngineConfig, got {type(engine).__name__}", param="engine")
    lora_modules = check_lora_modules(lora_modules)
    engine = with_adapters(engine, lora_modules)
    for key, value in (("name", name), ("app_name", app_name)):
        if not isinstance(value, str) or not value:
            raise RequestError(f"deploy: {key} must be a non-empty string, got {value!r}", param=key)
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise RequestError(f"deploy: num_replicas must be a positive integer, got {num_replicas!r}",
                           param="num_replicas")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise RequestError(f"deploy: threads must be a positive integer (the engine's torch threads) or None, got "
                           f"{threads!r}", param="threads")
    if ray_actor_options is not None and not isinstance(ray_actor_options, dict):
        raise RequestError(f"deploy: ray_actor_options must be a dict such as {{'num_cpus': 1}}, got "
                           f"{type(ray_actor_options).__name__}", param="ray_actor_options")
    from gristmill.engine import builder
    builder.resolve_model_dir(engine)  # a missing model fails here, not in a loop of replica restarts
    options = {**DEFAULT_REPLICA_OPTIONS, **(ray_actor_options or {})}
    from gristmill.ray.cluster import connect, engine_gpus
    engine, options = engine_gpus(engine, options, connect().cluster_resources().get("GPU", 0.0))
    _check_fits(options, num_replicas)
    _wait_for_room(options, num_replicas, app_name)
    deployment = serve.deployment(EngineServer, name=name, num_replicas=num_replicas,
                                  ray_actor_options=options, max_ongoing_requests=max_ongoing_requests,
                                  max_queued_requests=max_queued_requests,
                                  health_check_period_s=1.0, health_check_timeout_s=10.0,
                                  graceful_shutdown_timeout_s=5.0)
    # Processors reach the app through handles (it has no route): Serve started here runs
    # no HTTP proxy, an actor that only costs a small cluster CPU time, and that Serve
    # itself kills when a loaded machine makes it miss its health checks. A Serve the
    # user started (with HTTP) is joined as it is.
    serve.start(proxy_location="Disabled")
    # serve.run would wait for the replicas for ever when they cannot be placed: wait here.
    [handle] = serve.run_many([serve.RunTarget(deployment.bind(engine, model_name, threads, lora_modules or None),
                                               name=app_name,
                                               route_prefix=None)], wait_for_applications_running=False)
    _wait_running(app_name, name, num_replicas, options)
    return handle


def _check_fits(options: dict, num_replicas: int) -> None:
    """Fail now, saying what to change, when the replicas can never be placed (Serve
    would otherwise wait for resources for ever)."""
    from gristmill.ray.cluster import connect, largest_node

    total, needs = connect().cluster_resources(), _need(options, num_replicas)
    for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        need = needs[resource]
        if need > total.get(resource, 0.0):
            raise RequestError(f"deploy: {num_replicas} replica(s) x {key}={options.get(key)} need {need:g} "
                               f"{resource}s but the Ray cluster has {total.get(resource, 0.0):g}; lower "
                               f"num_replicas or ray_actor_options[{key!r}], or add {resource}s to the cluster",
                               param="ray_actor_options")
        largest = largest_node(resource)
        if float(options.get(key) or 0) > largest:  # a replica runs on one node
            raise RequestError(f"deploy: each replica needs {key}={options.get(key)} on one node, but the largest "
                               f"node of the Ray cluster has {largest:g} {resource}s; lower "
                               f"ray_actor_options[{key!r}]", param="ray_actor_options")


#: How long a deploy waits for CPUs / GPUs that other work holds (a Ray Data job's tasks
#: end and free theirs) before it refuses, saying what holds them.
_ROOM_WAIT_S = 5.0
#: Serve's words, in a deployment's status message, for replicas that could not be placed
#: for RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s by default).
_UNSCHEDULED = "to be scheduled"
#: How long replicas Serve has not placed though the cluster has room for them are waited for.
_SLOW_START_S = 180.0


def _apps() -> dict:
    """The Serve applications of the cluster ({} before Serve has started)."""
    try:
        return serve.status().applications
    except Exception:  # noqa: BLE001 - no Serve instance yet
        return {}


def _need(options: dict, num_replicas: int) -> dict:
    return {resource: float(options.get(key) or 0) * num_replicas
            for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus"))}


def _wait_for_room(options: dict, num_replicas: int, app_name: str) -> None:
    """Fail within seconds, saying what to change, when the replicas' CPUs or GPUs are held
    by others (another Serve application's replicas, a Ray Data job's actors): Serve would
    wait for them for ever. A redeploy of `app_name` frees its own, so it is not checked."""
    import time

    import ray

    need = {resource: amount for resource, amount in _need(options, num_replicas).items() if amount > 0}
    if not need or app_name in _apps():
        return
    deadline = time.monotonic() + _ROOM_WAIT_S
    while True:
        free = ray.available_resources()
        short = {resource: amount for resource, amount in need.items() if free.get(resource, 0.0) < amount}
        if not short:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    apps = sorted(_apps())
    (resource, amount), = list(short.items())[:1]
    key = "num_cpus" if resource == "CPU" else "num_gpus"
    raise RequestError(
        f"deploy: {num_replicas} replica(s) x {key}={options.get(key)} need {amount:g} {resource}s but only "
        f"{free.get(resource, 0.0):g} of the Ray cluster's {ray.cluster_resources().get(resource, 0.0):g} are "
        f"free: others hold the rest (Serve applications running: {apps or 'none'}; or a Ray Data job's "
        f"actors); serve.delete(...) an application you no longer use, lower num_replicas or "
        f"ray_actor_options[{key!r}] (replicas reserve none by default), or add {resource}s",
        param="ray_actor_options")


def _wait_running(app_name: str, name: str, num_replicas: int, options: dict) -> None:
    """Until the application runs. A replica that fails to start fails the deploy with its
    error; replicas that Serve cannot place (what they need is held by others) fail it once
    Serve says so, instead of waiting for ever. Replicas Serve is slow to place though the
    cluster has what they need (a loaded machine starting their processes) are waited
    for, up to _SLOW_START_S."""
    import time

    import ray

    need = {resource: amount for resource, amount in _need(options, num_replicas).items() if amount > 0}
    gone_since = None
    started = time.monotonic()
    while True:
        app = serve.status().applications.get(app_name)
        if app is None:  # not yet listed, or deleted meanwhile by another caller
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > 10:
                raise EngineDeadError(f"deploy: Serve app {app_name!r} is gone (deleted while it started?); "
                                      f"deploy it again")
            time.sleep(0.2)
            continue
        gone_since = None
        if app.status == "RUNNING":
            return
        deployment = app.deployments.get(name)
        message = (deployment.message if deployment is not None else "") or app.message or ""
        if app.status == "DEPLOY_FAILED":
            raise EngineDeadError(f"deploy: the replicas of {name!r} (Serve app {app_name!r}) failed to start: "
                                  f"{_last_error(message)}")
        if deployment is not None and _UNSCHEDULED in message:
            free = ray.available_resources()
            if all(free.get(resource, 0.0) >= amount for resource, amount in need.items()):
                if time.monotonic() - started < _SLOW_START_S:
                    time.sleep(0.2)
                    continue  # not held by others: slow, not stuck
                serve.delete(app_name)
                raise EngineDeadError(f"deploy: the replicas of {name!r} (Serve app {app_name!r}) were not placed "
                                      f"within {_SLOW_START_S:.0f} s though the cluster has what they need "
                                      f"({message.strip()}); is the machine overloaded? The app was deleted")
            serve.delete(app_name)
            raise RequestError(
                f"deploy: Serve could not place the {num_replicas} replica(s) of {name!r} (Serve app "
                f"{app_name!r}): what they need is held by others ({message.strip()}); serve.delete(...) an "
                f"application you no longer use, lower num_replicas or ray_actor_options (replicas reserve no "
                f"CPU by default), or add resources; the app was deleted", param="ray_actor_options")
        time.sleep(0.2)


def _last_error(message: str) -> str:
    """The error at the end of Serve's message (a replica's traceback), or the message."""
    lines = [line.strip() for line in (message or "").strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else "no reason given"
