"""EnginePool: supervised AsyncEngine replicas on the batch runtime, the engine of an
EngineProcessorConfig and of a shared deployment (deployment.py).

`EnginePool` owns `concurrency` AsyncEngine replicas and sends each row to the least
busy one. When a replica's engine dies, the rows it had in flight wait while it is
restarted (within the pool's `max_engine_restarts`), then run again on their own; if
they kill the engine again they are split in halves and run again, until the row that
kills it every time is alone: that row ends as an error row and the others complete.
Deaths while isolating one culprit are not charged to the budget (one half of each split
dies: about log2(rows in flight) of them); a split whose two halves both die is charged
(several culprits, or an engine that dies whatever it runs). Past the budget the job
fails with EngineDeadError naming the rows in flight at each death.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from gristmill import gpus
from gristmill.batch import runtime
from gristmill.batch.adapters import RowAdapters
from gristmill.batch.rows import Generated, Pooled, RowRequest
from gristmill.batch.stages import LocalStages
from gristmill.chat.answer import read_answer
from gristmill.config import EngineConfig
from gristmill.engine import restarts
from gristmill.engine.async_engine import AsyncEngine
from gristmill.engine.restarts import RestartBudget
from gristmill.errors import EngineDeadError, RequestError
from gristmill.pooling_params import PoolingParams
from gristmill.pooling_tasks import POOLING_TASKS, cosine
from gristmill.tokenizer import render_chat

logger = logging.getLogger(__name__)

# Longest wait for the other requests of a dead engine to fail (they fail within a second).
_SETTLE_TIMEOUT_S = 10.0


def prompt_logprobs_of(out) -> list[float | None] | None:
    """Each prompt token's own logprob (None for the first), of an output that has them."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else entry[token].logprob
            for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]


class RowFailed(Exception):
    """A row's own error that would otherwise count as fatal (a poison row's
    EngineDeadError): the processor makes it an error row and goes on."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class EnginePool:
    """A RowEngine of `concurrency` supervised AsyncEngine replicas; `start_pool` starts one."""

    def __init__(self, config: EngineConfig, concurrency: int = 1, max_engine_restarts: int = 0,
                 lora_modules: dict[str, str] | None = None):
        #: The chat template and tokenizer run here, before the engine, with its tokenizer.
        self.stages = LocalStages(self)
        #: The LoRA adapters rows may name (each row's own, resolved as it runs).
        self.adapters = RowAdapters(config, lora_modules)
        self.config = config
        self.concurrency = concurrency
        self.max_engine_restarts = max_engine_restarts
        self.budget = RestartBudget(max_engine_restarts)
        self.deaths: list[str] = []
        self.fatal: EngineDeadError | None = None
        self.replicas: list[_Replica] = []
        #: `close` began: the rows still in flight fail with their engines, no death is
        #: recorded and no engine restarted.
        self.closing = False

    async def start(self) -> None:
        """Start every replica: on a machine with several GPUs, one on each in turn; those
        sharing a GPU split its memory and start one after another (`gristmill.gpus`)."""
        loop = asyncio.get_running_loop()
        self.adapters.check()  # (before the model loads: a bad adapter given stops the start, named)
        placements = [gpus.Placement(self.config)] * self.concurrency
        if self.concurrency > 1 and self.config.device != "cpu":
            placements = gpus.place_replicas(self.config, self.concurrency, gpus.visible_gpus())
            if placements[0].config is not self.config:
                logger.info("engine replicas: %s", ", ".join(
                    f"GPU {p.visible_devices or p.config.device} (gpu_memory_utilization="
                    f"{p.config.gpu_memory_utilization:.3g})" for p in placements))

        def start(placement: gpus.Placement) -> AsyncEngine:
            return AsyncEngine(placement.config, core_env=placement.core_env)

        engines: list[AsyncEngine | BaseException | None] = [None] * len(placements)
        for wave in gpus.start_waves(placements):
            started = await asyncio.gather(*(loop.run_in_executor(None, start, placements[i]) for i in wave),
                                           return_exceptions=True)
            for i, engine in zip(wave, started):
                engines[i] = engine
            if any(isinstance(e, BaseException) for e in started):
                break
        errors = [e for e in engines if isinstance(e, BaseException)]
        if errors:
            for engine in engines:
                if isinstance(engine, AsyncEngine):
                    engine.shutdown()
            raise errors[0]
        self.replicas = [_Replica(self, engine) for engine in engines]

    @property
    def tokenizer(self):
        return self.replicas[0].engine.tokenizer

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt=True, template_kwargs=template_kwargs,
                           tools=tools)

    @property
    def tool_parser(self):
        return self.replicas[0].engine.tool_parser

    def tokenize(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return self.replicas[0].engine.inputs.tokenize(prompt, add_special_tokens)

    @property
    def task(self) -> str:
        """The task the engines run (their config's, resolved from the model)."""
        return self.replicas[0].engine.capacity.task

    def check_task(self, task: str) -> None:
        """RequestError (param "task") unless the engines run `task`."""
        if task != self.task:
            raise RequestError(f"the processor runs task {task!r} but the engine runs task {self.task!r}; give "
                               f"the processor task={self.task!r}, or deploy an engine with task={task!r}",
                               param="task")

    async def generate(self, request: RowRequest) -> Generated:
        return await self._run(request)

    async def pool(self, request: RowRequest) -> Pooled:
        return await self._run(request)

    async def _run(self, request: RowRequest):
        if self.fatal is not None:
            raise self.fatal
        replica = min(self.replicas, key=lambda r: (not r.open.is_set(), len(r.in_flight)))
        return await replica.run(request)

    async def close(self) -> None:
        self.closing = True
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, r.engine.shutdown) for r in self.replicas))

    @property
    def core_pids(self) -> list[int]:
        return [r.engine.core_pid for r in self.replicas]

    # -- deaths ---------------------------------------------------------------------

    def record_death(self, error: EngineDeadError, row_ids: list) -> None:
        self.deaths.append(f"death {len(self.deaths) + 1}: {error.message} (rows in flight: {_ids(row_ids)})")
        logger.error("engine died with rows %s in flight: %s", _ids(row_ids), error.message)

    def take_restart(self) -> bool:
        if self.budget.take():
            return True
        self.fatal = EngineDeadError(
            f"the engine died more often than max_engine_restarts={self.max_engine_restarts} allows; "
            f"{'; '.join(self.deaths)}; raise max_engine_restarts (--max-engine-restarts) or "
            f"fix what kills it")
        return False


def start_pool(config: EngineConfig, concurrency: int = 1, max_engine_restarts: int = 0,
               lora_modules: dict[str, str] | None = None) -> EnginePool:
    """A pool, started on the batch runtime (returns once every replica is up)."""
    pool = EnginePool(config, concurrency, max_engine_restarts, lora_modules)
    runtime.call(pool.start())
    return pool


class _Replica:
    def __init__(self, pool: EnginePool, engine: AsyncEngine):
        self.pool = pool
        self.engine = engine
        self.in_flight: dict[str, object] = {}  # engine request id -> row id
        self.open = asyncio.Event()  # cleared while recovering from a death
        self.open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._suspects: list[tuple[RowRequest, asyncio.Future]] = []
        self._recovery: asyncio.Task | None = None

    async def run(self, request: RowRequest) -> Generated | Pooled:
        await self.open.wait()
        if self.pool.fatal is not None:
            raise self.pool.fatal
        try:
            return await self._run(request)
        except EngineDeadError as exc:
            if self.pool.closing:  # shut down on purpose (the job stopped): not a death
                raise
            future = asyncio.get_running_loop().create_future()
            self._suspects.append((request, future))
            if self._recovery is None:
                self._recovery = asyncio.create_task(self._recover(exc))
            return await future

    async def _run(self, request: RowRequest) -> Generated | Pooled:
        lora = self.pool.adapters.lora_of(request.model)  # (a name not given: the row's RequestError)
        if request.task != "generate":
            return await self._pool(request, lora)
        request_id = self._enter(request.row_id)
        try:
            prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
            out = None
            # A row reads its output once, at its end, and no time of its tokens: the
            # core sends them then, not every step.
            async for out in self.engine.generate(prompt, request.sampling_params, request_id, output_kind="final",
                                                  token_times=False, add_special_tokens=request.add_special_tokens,
                                                  chat_prompt=request.prompt if request.chat else None,
                                                  lora_request=lora):
                pass
            generated = Generated(out.text, list(out.token_ids), len(out.prompt_token_ids), len(out.token_ids),
                                  out.finish_reason, prompt_logprobs_of(out))
            parser = self.engine.reasoning_parser if request.chat else None
            if parser is not None or request.tools is not None:
                answer = read_answer(out.text, out.finish_reason, parser, request.prompt, request.tools)
                generated.text, generated.finish_reason = answer.content, answer.finish_reason
                if parser is not None:
                    generated.reasoning, generated.reasoned = answer.reasoning, True
                if request.tools is not None:
                    generated.tool_calls = [{"name": c.name, "arguments": c.arguments} for c in answer.calls]
            return generated
        finally:
            self._leave(request_id)

    async def _pool(self, request: RowRequest, lora) -> Pooled:
        """A pooling row: one request, or for a score row on an embedding model (no
        cross-encoder) two embeddings, scored by their cosine."""
        prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
        if request.task == "score" and self.engine.capacity.pooler.head == "embed":
            params = request.pooling_params.clone(normalize=True)
            first, second = await asyncio.gather(self._encode(request.row_id, prompt, params, "embed", lora=lora),
                                                 self._encode(request.row_id, request.text_pair, params, "embed",
                                                              lora=lora))
            return Pooled(cosine(first.outputs.embedding, second.outputs.embedding),
                          len(first.prompt_token_ids) + len(second.prompt_token_ids))
        out = await self._encode(request.row_id, prompt, request.pooling_params, request.task, request.text_pair,
                                 lora)
        value = getattr(out.outputs, POOLING_TASKS[request.task].output)
        return Pooled(value, len(out.prompt_token_ids))

    async def _encode(self, row_id, prompt, params: PoolingParams, kind: str, text_pair: str | None = None,
                      lora=None):
        request_id = self._enter(row_id)
        try:
            out = None
            async for out in self.engine.encode(prompt, params, request_id, kind=kind, text_pair=text_pair,
                                                lora_request=lora):
                pass
            return out
        finally:
            self._leave(request_id)

    def _enter(self, row_id) -> str:
        """A new engine request id for the row `row_id`, in flight until `_leave`."""
        request_id = uuid.uuid4().hex
        self.in_flight[request_id] = row_id
        self._idle.clear()
        return request_id

    def _leave(self, request_id: str) -> None:
        del self.in_flight[request_id]
        if not self.in_flight:
            self._idle.set()

    # -- after a death (one recovery at a time; new rows wait) ------------------------

    async def _recover(self, error: EngineDeadError) -> None:
        self.open.clear()
        suspects: list[tuple[RowRequest, asyncio.Future]] = []
        try:
            try:
                await asyncio.wait_for(self._idle.wait(), _SETTLE_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
            suspects, self._suspects = self._suspects, []
            self.pool.record_death(error, [r.row_id for r, _ in suspects])
            if not self.pool.take_restart():
                raise self.pool.fatal
            await self._restart()
            while suspects:  # rows that reached the dead engine late join the next round
                await self._retry_apart(suspects)
                suspects, self._suspects = self._suspects, []
        except BaseException as exc:  # noqa: BLE001 - every waiting row hears of it
            fatal = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
                f"restarting the engine failed: {type(exc).__name__}: {exc}")
            self.pool.fatal = self.pool.fatal or fatal
            for _, future in suspects + self._suspects:
                _settle(future, error=self.pool.fatal)
        finally:
            self._recovery = None
            self.open.set()

    async def _retry_apart(self, rows: list[tuple[RowRequest, asyncio.Future]]) -> None:
        """Run the rows a death caught in flight again, each half alone; a half the engine
        dies on again is split in turn, until the row that kills it alone is set aside.
        One poison row kills one half of each split. When both halves die, it is not one
        row (a broken engine, or several poison rows): that death is charged to the
        budget, so an engine that dies on every step fails the job instead of turning
        every row into an error row."""
        parts = [rows] if len(rows) == 1 else [rows[:len(rows) // 2], rows[len(rows) // 2:]]
        died: list[tuple[list, EngineDeadError]] = []
        for part in parts:
            dead, error = await self._run_group(part)
            if not dead:
                continue
            self.pool.record_death(error, [r.row_id for r, _ in dead])
            if died and not self.pool.take_restart():
                raise self.pool.fatal
            await self._restart()
            died.append((dead, error))
        for dead, error in died:
            if len(dead) > 1:
                await self._retry_apart(dead)
                continue
            (request, future), = dead
            _settle(future, error=RowFailed(EngineDeadError(
                f"row {request.row_id!r} killed the engine each time it ran, so it was set aside "
                f"({error.message})")))

    async def _run_group(self, group: list[tuple[RowRequest, asyncio.Future]]) -> tuple[list, EngineDeadError | None]:
        """Run `group` alone and settle the rows that end; returns the rows the engine's
        death ended, and that death."""
        results = await asyncio.gather(*(self._run(r) for r, _ in group), return_exceptions=True)
        dead, death = [], None
        for (request, future), result in zip(group, results):
            if isinstance(result, EngineDeadError):
                dead.append((request, future))
                death = death or result
            elif isinstance(result, BaseException):
                _settle(future, error=result)
            else:
                _settle(future, result=result)
        return dead, death

    async def _restart(self) -> None:
        seconds = await restarts.restart(self.engine)
        logger.info("engine restarted in %.1f s", seconds)


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """Give a waiting row its result or error, unless it stopped waiting (its job ended
    and cancelled it): a cancelled row is no failure of the engine."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _ids(row_ids: list) -> str:
    shown = ", ".join(repr(i) for i in row_ids[:20])
    return f"[{shown}{', ...' if len(row_ids) > 20 else ''}]"
