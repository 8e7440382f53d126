"""ServeEngine: a processor's rows sent to a Ray Serve deployment through its handle.

What crosses the RPC boundary is sorted here, once:
- the replica raised a gristmill error (RayTaskError whose cause is a RequestError,
  GenerationError, ...): the row gets the cause itself, its type and message, never
  Ray's traceback text;
- the replica died, the deployment is unavailable (RayActorError, ActorDiedError,
  DeploymentUnavailableError ...): EngineDeadError, fatal, which stops the job;
- back-pressure (BackPressureError: the replicas' queues are full): retried with backoff
  a few times, then fatal too;
- anything else the replica raised: the row's GenerationError.
"""

from __future__ import annotations

import asyncio
import logging
import random

from gristmill.batch.openai_rows import generated_of, openai_request
from gristmill.batch.rows import Generated, RowRequest
from gristmill.batch.stages import REMOTE_STAGES
from gristmill.errors import EngineDeadError, GenerationError, GristmillError, is_fatal, last_line, root_cause

logger = logging.getLogger(__name__)
_BACKPRESSURE_RETRIES = 6
_BACKOFF_BASE_S = 0.25


class ServeEngine:
    #: The deployment applies its own chat template and tokenizer.
    stages = REMOTE_STAGES

    def __init__(self, deployment_name: str, app_name: str):
        from ray import serve

        self.where = f"deployment {deployment_name!r} of Serve app {app_name!r}"
        try:
            handle = serve.get_deployment_handle(deployment_name, app_name)
        except Exception as exc:  # noqa: BLE001 - Serve raises several kinds for a missing app
            raise EngineDeadError(f"{self.where} is not running ({type(exc).__name__}: {exc}); start it with "
                                  f"gristmill.ray.deploy(EngineConfig(...), name={deployment_name!r}, "
                                  f"app_name={app_name!r})") from None
        self.handle = handle.options(stream=True)

    async def generate(self, request: RowRequest) -> Generated:
        method, body = openai_request(request, None)
        body["return_token_ids"] = True  # gristmill's serving returns them: rows get generated_tokens
        for attempt in range(_BACKPRESSURE_RETRIES + 1):
            try:
                response = getattr(self.handle, method).remote(body)
                return generated_of(await response.__anext__(), self.where, request.tool_fields is not None)
            except Exception as exc:  # noqa: BLE001 - sorted: the row's error, or fatal
                if type(exc).__name__ == "BackPressureError" and attempt < _BACKPRESSURE_RETRIES:
                    delay = random.uniform(0, _BACKOFF_BASE_S * 2 ** attempt)
                    logger.warning("%s refused row %r (its queues are full); retrying in %.2f s", self.where,
                                   request.row_id, delay)
                    await asyncio.sleep(delay)
                    continue
                raise self._classified(exc) from None
        raise AssertionError("unreachable")

    def _classified(self, exc: Exception) -> Exception:
        cause = root_cause(exc)
        if isinstance(cause, GristmillError) and not type(cause).__name__.startswith("RayTaskError"):
            return cause  # what the replica raised (or generated_of), not Ray's traceback-text subclass
        summary = f"{type(exc).__name__}: {last_line(exc)}"
        if type(exc).__name__ == "BackPressureError":
            return EngineDeadError(f"{self.where} kept refusing requests (its queues are full) after "
                                   f"{_BACKPRESSURE_RETRIES} retries ({summary}); add replicas, raise "
                                   f"max_ongoing_requests, or lower batch_size / max_concurrent_batches")
        if is_fatal(exc):
            return EngineDeadError(f"{self.where} is gone: a replica died or the deployment is unavailable "
                                   f"({summary}); the rows it held are lost, run them again")
        cause = getattr(exc, "cause", None) or exc
        return GenerationError(f"{self.where} raised {type(cause).__name__}: {last_line(cause)}")

    async def close(self) -> None:
        pass
