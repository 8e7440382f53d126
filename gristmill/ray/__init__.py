"""gristmill on Ray (the `gristmill[ray]` extra): processors on Ray Data, shared engines
as Ray Serve deployments.

    import ray
    from gristmill import EngineConfig
    from gristmill.batch import build_processor, EngineProcessorConfig, DeploymentProcessorConfig
    from gristmill.ray import deploy

    ds = ray.data.read_json("prompts.jsonl")
    out = build_processor(EngineProcessorConfig(engine=EngineConfig(), concurrency=2))(ds)  # a Dataset

    deploy(EngineConfig(), name="llm", app_name="llm")          # one engine, shared
    turn1 = build_processor(DeploymentProcessorConfig(deployment_name="llm", app_name="llm", method="chat"))
    turn2 = build_processor(DeploymentProcessorConfig(deployment_name="llm", app_name="llm", method="chat"))

See docs/ray.md for the defaults that keep a small cluster from deadlocking.
"""

from __future__ import annotations

from gristmill.ray.requirement import require_ray

require_ray()

from gristmill.ray.serve import EngineServer, deploy  # noqa: E402 - after the check, which says what to install

__all__ = ["deploy", "EngineServer", "require_ray"]
