"""Shared engine deployments: one engine (pool of replicas) that processors reach by name.

    with deploy(EngineConfig(), name="shared") as engine:
        turn1 = build_processor(DeploymentProcessorConfig(deployment_name="shared", method="chat"), ...)
        turn2 = build_processor(DeploymentProcessorConfig(deployment_name="shared", method="chat"), ...)
        rows = turn2(turn1(rows))   # one engine-core process for both
"""

from __future__ import annotations

import threading

from gristmill.batch import runtime
from gristmill.batch.adapters import check_lora_modules, with_adapters
from gristmill.batch.engines import EnginePool, start_pool
from gristmill.batch.rows import Generated, Pooled, RowRequest
from gristmill.config import EngineConfig
from gristmill.errors import RequestError

_lock = threading.Lock()
_deployments: dict[str, "Deployment"] = {}


class Deployment:
    """A handle on a running shared engine; `shutdown()` (or leaving its `with`) stops it."""

    def __init__(self, name: str, pool: EnginePool):
        self.name = name
        self.pool = pool

    @property
    def core_pids(self) -> list[int]:
        """The engine-core process of each replica (they change when one is restarted)."""
        return self.pool.core_pids

    def borrow(self, task: str = "generate") -> "_Borrowed":
        """A RowEngine on this deployment for one processor of `task` (the task its engine
        must run), which leaves it running when it is done (a deployment outlives its users)."""
        self.pool.check_task(task)
        return _Borrowed(self.pool)

    def shutdown(self) -> None:
        with _lock:
            if _deployments.get(self.name) is self:
                del _deployments[self.name]
        runtime.call(self.pool.close())

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Deployment(name={self.name!r}, replicas={self.pool.concurrency})"


def deploy(engine: EngineConfig | None = None, *, name: str, concurrency: int = 1,
           max_engine_restarts: int = 0, lora_modules: dict[str, str] | None = None) -> Deployment:
    """Start a shared engine under `name` (returns once it is ready). Processors built
    with `DeploymentProcessorConfig(deployment_name=name)` send their rows to it.
    `lora_modules` ({"name": "path"}): the LoRA adapters its rows may name (in their
    `lora` or `model` column), as EngineProcessorConfig's."""
    if not isinstance(name, str) or not name:
        raise RequestError(f"deploy: name must be a non-empty string, got {name!r}", param="name")
    lora_modules = check_lora_modules(lora_modules)
    engine = with_adapters(engine or EngineConfig(), lora_modules)
    with _lock:
        if name in _deployments:
            raise RequestError(f"a deployment named {name!r} is already running; shut it down first "
                               f"or choose another name", param="name")
        _deployments[name] = None  # reserved while it starts
    try:
        pool = start_pool(engine, concurrency, max_engine_restarts, lora_modules)
    except BaseException:
        with _lock:
            del _deployments[name]
        raise
    deployment = Deployment(name, pool)
    with _lock:
        _deployments[name] = deployment
    return deployment


class _Borrowed:
    """A processor's use of a deployment's pool: its rows and its stages, but not its close."""

    def __init__(self, engines: EnginePool):
        self.engines = engines
        self.stages = engines.stages

    async def generate(self, request: RowRequest) -> Generated:
        return await self.engines.generate(request)

    async def pool(self, request: RowRequest) -> Pooled:
        return await self.engines.pool(request)

    async def close(self) -> None:
        pass


def get_deployment(name: str) -> Deployment:
    with _lock:
        deployment = _deployments.get(name)
        running = sorted(n for n, d in _deployments.items() if d is not None)
    if deployment is None:
        raise RequestError(f"no deployment named {name!r} is running (running: {running}); start it with "
                           f"gristmill.batch.deploy(EngineConfig(...), name={name!r})", param="deployment_name")
    return deployment
