"""The Ray cluster the gristmill[ray] faces run on: connecting to it (`connect`, failing in
seconds where no cluster answers), and what it can hold (`check_fits`, `largest_node`,
`actors_in`, `engine_gpus`), checked before a job or a deployment waits for CPUs or GPUs
Ray would wait for silently, for ever."""

from __future__ import annotations

import dataclasses
import os
import socket

from gristmill.config import EngineConfig
from gristmill.errors import EngineDeadError, RequestError


def engine_gpus(engine: EngineConfig, options: dict, cluster_gpus: float) -> tuple[EngineConfig, dict]:
    """The engine config and Ray options of actors (or Serve replicas) that each own an
    engine, with GPUs in mind. Ray hides the GPUs from an actor that asks for none, so an
    engine on "cuda" or "auto" asks for one GPU (`num_gpus=1`) unless `options` say how
    many, when the cluster has any ("auto" would otherwise run on the CPU). An actor given
    a fraction of a GPU gets that fraction of `gpu_memory_utilization`: actors sharing a
    GPU then fit on it together. An engine on "cuda" whose actors get no GPU is refused,
    saying what to set."""
    if engine.device == "cpu":
        return engine, options
    if "num_gpus" not in options and cluster_gpus > 0:
        options = {**options, "num_gpus": 1}
    share = float(options.get("num_gpus") or 0)
    if share == 0:
        if engine.device != "auto":
            why = "the Ray cluster has none" if not cluster_gpus else "ray_actor_options has num_gpus=0"
            raise RequestError(
                f"the engine's device is {engine.device!r} but its actors get no GPU ({why}), and Ray hides "
                f"the GPUs from an actor that asks for none: set ray_actor_options={{'num_gpus': 1}} (or a "
                f"fraction, to share a GPU), add GPUs to the cluster, or use device='cpu'",
                param="ray_actor_options")
        return engine, options
    index = engine.device.partition(":")[2]
    if index and int(index) >= max(1, int(share)):
        raise RequestError(
            f"the engine's device is {engine.device!r}, but an actor sees only the {max(1, int(share))} GPU(s) Ray "
            f"gives it, as cuda:0 and up: use device='cuda' (Ray picks the GPU)", param="device")
    if share < 1:
        engine = dataclasses.replace(engine, gpu_memory_utilization=engine.gpu_memory_utilization * share)
    return engine, options


def actors_in(dataset) -> dict:
    """{"CPU": n, "GPU": n} that the actor pools already in `dataset`'s plan (an earlier
    processor's engine actors, a stage of the user's own) hold while it runs: they run at
    the same time as the stages appended to it."""
    held = {"CPU": 0.0, "GPU": 0.0}
    try:
        from ray.data import ActorPoolStrategy

        operators = list(dataset._logical_plan.dag.post_order_iter())
    except Exception:  # noqa: BLE001 - a Ray whose plan reads otherwise: this processor's actors only
        return held
    for operator in operators:
        compute = getattr(operator, "compute", None)
        if not isinstance(compute, ActorPoolStrategy):
            continue
        args = getattr(operator, "ray_remote_args", None) or {}
        cpus = args.get("num_cpus", 1)  # Ray Data's default for a map stage's workers
        held["CPU"] += compute.min_size * float(cpus or 0)
        held["GPU"] += compute.min_size * float(args.get("num_gpus") or 0)
    return held


def check_fits(actors: int, options: dict, task_cpus: float, held: dict | None = None) -> None:
    """Fail now, saying what to change, when the stage's actors and one map task can never
    run at once on this cluster, beside the actor pools `held` of the stages before them
    (see actors_in): Ray would wait for the CPUs (or GPUs) for ever, silently."""
    held = held or {}
    resources = connect().cluster_resources()
    total = resources.get("CPU", 0.0)
    earlier = held.get("CPU", 0.0)
    need = actors * float(options.get("num_cpus") or 0) + task_cpus + earlier
    if need > total:
        before = (f" + {earlier:g} held by the actors of this Dataset's earlier stages (another processor's: "
                  f"they run at the same time)" if earlier else "")
        shared = ("; processors in a chain can share one engine instead: gristmill.ray.deploy it and use "
                  "DeploymentProcessorConfig(app_name=...)" if earlier else "")
        raise RequestError(
            f"this processor needs {need:g} CPUs at once on Ray ({actors} actor(s) x num_cpus="
            f"{options.get('num_cpus')} + {task_cpus:g} for a map task{before}) but the cluster has {total:g}; "
            f"lower concurrency, set ray_actor_options={{'num_cpus': ...}} (and num_cpus in preprocess_map_kwargs / "
            f"postprocess_map_kwargs), or add CPUs{shared}", param="ray_actor_options")
    gpus = actors * float(options.get("num_gpus") or 0)
    if gpus:
        earlier = held.get("GPU", 0.0)
        if gpus + earlier > resources.get("GPU", 0.0):
            before = f" + {earlier:g} held by the actors of this Dataset's earlier stages" if earlier else ""
            raise RequestError(
                f"this processor needs {gpus + earlier:g} GPUs at once on Ray ({actors} actor(s) x num_gpus="
                f"{options.get('num_gpus')}{before}) but the cluster has {resources.get('GPU', 0.0):g}; lower "
                f"concurrency or ray_actor_options['num_gpus'], or add GPUs", param="ray_actor_options")
    for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        each = float(options.get(key) or 0)
        largest = largest_node(resource)
        if each > largest:  # the cluster's total may be enough, but an actor runs on one node
            raise RequestError(
                f"each actor of this processor needs {key}={options.get(key)} on one node, but the largest node "
                f"of the Ray cluster has {largest:g} {resource}s; lower ray_actor_options[{key!r}]",
                param="ray_actor_options")


def largest_node(resource: str) -> float:
    """The most of `resource` ("CPU", "GPU") that one alive node of the cluster has."""
    import ray

    try:
        return max((node["Resources"].get(resource, 0.0) for node in ray.nodes() if node.get("Alive")), default=0.0)
    except Exception:  # noqa: BLE001 - a Ray that reports nodes otherwise: the cluster's total is checked
        return float("inf")


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
    shown = address
    if address and address.startswith("ray://"):  # Ray Client: its server answers at host:port too
        address = address[len("ray://"):].rstrip("/")
    if not address or address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        raise EngineDeadError(f"no Ray cluster answers at {shown} ({type(exc).__name__}: {exc}); start one "
                              f"with `ray start --head` and pass the address it prints, or leave the address "
                              f"out to start a local cluster") from None
