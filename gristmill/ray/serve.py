"""A shared engine as a Ray Serve application: `deploy(EngineConfig(...), name=, app_name=)`.

Each replica owns one AsyncEngine (its own engine-core process) and answers OpenAI-shaped
requests on two methods, `completions` and `chat`, through a streaming handle: each
yields one whole response (a dict) and ends. That is how Ray Data LLM's
`ServeDeploymentProcessorConfig` calls a deployment, and how gristmill's
`DeploymentProcessorConfig(deployment_name=, app_name=)` does.

Errors cross the RPC boundary typed: a row's own failure raises RequestError or
GenerationError (both ValueErrors, which Ray Data LLM keeps per-row); a dead engine raises
EngineDeadError and fails the replica's health check within a second, so Serve replaces it.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ValidationError
from ray import serve

from gristmill.config import EngineConfig
from gristmill.errors import EngineDeadError, RequestError

#: A replica reserves no CPU unless told to: on a small cluster Ray Data's actors and
#: tasks take whole CPUs, and a replica holding any share leaves a task unable to start.
DEFAULT_REPLICA_OPTIONS = {"num_cpus": 0}
#: Requests one replica takes at once (Serve's default, 5, would starve its batching).
DEFAULT_MAX_ONGOING_REQUESTS = 256


class EngineServer:
    """One replica: an AsyncEngine behind OpenAI-shaped `completions` and `chat`."""

    def __init__(self, engine: EngineConfig, model_name: str | None = None, threads: int | None = None):
        from gristmill.engine.async_engine import AsyncEngine
        from gristmill.paths import DEFAULT_MODEL_NAME
        from gristmill.server.metrics import ServerMetrics
        from gristmill.server.openai_serving import OpenAIServing

        if threads is not None:  # the engine core reads it when it starts
            os.environ["OMP_NUM_THREADS"] = str(threads)
        self.engine = AsyncEngine(engine)
        self.model_name = model_name or engine.model or DEFAULT_MODEL_NAME
        self.serving = OpenAIServing(self.engine, self.model_name, ServerMetrics())

    async def completions(self, request):
        """An OpenAI completions request (a dict or a pydantic model); yields the response."""
        from gristmill.server.protocol import CompletionRequest
        yield await self.serving.response(False, _body(CompletionRequest, request))

    async def chat(self, request):
        """An OpenAI chat completions request (a dict or a pydantic model); yields the response."""
        from gristmill.server.protocol import ChatCompletionRequest
        yield await self.serving.response(True, _body(ChatCompletionRequest, request))

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


def _body(model: type[BaseModel], request):
    """The request as `model`: Ray Data LLM sends a dict (with its own request_id and
    idx_in_batch keys, ignored here) or a pydantic model of the caller's."""
    if isinstance(request, BaseModel):
        request = request.model_dump(exclude_none=True)
    if not isinstance(request, dict):
        raise RequestError(f"a request must be a dict (or a pydantic model) of OpenAI request fields, got "
                           f"{type(request).__name__}", param="request")
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
           model_name: str | None = None, threads: int | None = None):
    """Run `engine` as the Ray Serve application `app_name` with deployment `name` and
    return its DeploymentHandle once every replica is ready (connects to or starts Ray).

    `max_queued_requests` caps the requests waiting for a replica (-1: no cap); past it
    callers get back-pressure, which processors retry a few times before failing the job.
    `ray_actor_options` are each replica's Ray options (default {"num_cpus": 0}: see
    docs/ray.md); `threads` sets the engine's torch threads (default: Ray's, which is the
    replica's num_cpus when it reserves CPUs). Processors reach it with
    `DeploymentProcessorConfig(deployment_name=name, app_name=app_name)`; Ray Data LLM's
    `ServeDeploymentProcessorConfig(deployment_name=name, app_name=app_name)` too.
    `serve.delete(app_name)` stops it.
    """
    engine = engine or EngineConfig()
    if not isinstance(engine, EngineConfig):
        raise RequestError(f"deploy takes an EngineConfig, got {type(engine).__name__}", param="engine")
    for key, value in (("name", name), ("app_name", app_name)):
        if not isinstance(value, str) or not value:
            raise RequestError(f"deploy: {key} must be a non-empty string, got {value!r}", param=key)
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise RequestError(f"deploy: num_replicas must be a positive integer, got {num_replicas!r}",
                           param="num_replicas")
    if ray_actor_options is not None and not isinstance(ray_actor_options, dict):
        raise RequestError(f"deploy: ray_actor_options must be a dict such as {{'num_cpus': 1}}, got "
                           f"{type(ray_actor_options).__name__}", param="ray_actor_options")
    from gristmill.engine import builder
    builder.resolve_model_dir(engine)  # a missing model fails here, not in a loop of replica restarts
    options = {**DEFAULT_REPLICA_OPTIONS, **(ray_actor_options or {})}
    _check_fits(options, num_replicas)
    deployment = serve.deployment(EngineServer, name=name, num_replicas=num_replicas,
                                  ray_actor_options=options, max_ongoing_requests=max_ongoing_requests,
                                  max_queued_requests=max_queued_requests,
                                  health_check_period_s=1.0, health_check_timeout_s=10.0,
                                  graceful_shutdown_timeout_s=5.0)
    return serve.run(deployment.bind(engine, model_name, threads), name=app_name, route_prefix=None)


def _check_fits(options: dict, num_replicas: int) -> None:
    """Fail now, saying what to change, when the replicas can never be placed (Serve
    would otherwise wait for resources for ever)."""
    from gristmill.ray.data import connect

    total = connect().cluster_resources()
    for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        need = float(options.get(key) or 0) * num_replicas
        if need > total.get(resource, 0.0):
            raise RequestError(f"deploy: {num_replicas} replica(s) x {key}={options.get(key)} need {need:g} "
                               f"{resource}s but the Ray cluster has {total.get(resource, 0.0):g}; lower "
                               f"num_replicas or ray_actor_options[{key!r}], or add {resource}s to the cluster",
                               param="ray_actor_options")
