"""AsyncEngine: request streams over an engine core running in a child process.

Tokenizing, detokenizing and stop strings run here, in the client process; a failure
in them ends only its request (GenerationError). The core's death or hang is seen by
the CoreClient monitor and fails every in-flight request with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gristmill.config import EngineConfig
from gristmill.engine import faults
from gristmill.engine.core_client import CoreClient
from gristmill.engine.core_process import Abort, AddRequests, StatsQuery, StatsReply, StepOutputs
from gristmill.engine.output_processor import OutputProcessor
from gristmill.engine.processor import InputProcessor
from gristmill.errors import (EngineDeadError, EngineOverloadedError, GenerationError, RequestError)
from gristmill.outputs import CompletionOutput, RequestOutput
from gristmill.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    output: RequestOutput
    child_ids: list[str] = field(default_factory=list)

    def push(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """The engine behind the server and batch runners.

    >>> engine = AsyncEngine(EngineConfig(model=None))   # returns once the core is ready
    >>> async for out in engine.generate("Hi", SamplingParams(max_tokens=8), request_id="r1"):
    ...     print(out.delta_text, end="")
    """

    def __init__(self, config: EngineConfig | None = None, **options):
        from gristmill.model.loader import load_config, resolve_model
        from gristmill.model.tokenizer import eos_token_ids, load_tokenizer

        faults.load()  # a malformed GRISTMILL_FAULTS fails here, before any process starts
        config = config or EngineConfig.from_kwargs(**options)
        self.config = config
        model_dir = resolve_model(config.model, config.cache_dir)  # converts a GGUF once, here
        self._lock = threading.RLock()
        self._streams: dict[str, _Stream] = {}
        self._by_child: dict[str, _Stream] = {}
        self._stats_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        self.num_errors = 0
        self._client = CoreClient(dataclasses.replace(config, model=str(model_dir)),
                                  self._on_core_message, self._on_core_death)
        try:
            hf_config = load_config(model_dir)
            self.tokenizer = load_tokenizer(model_dir, hf_config.model_type)
            ready = self._client.wait_ready()
        except BaseException:
            self._client.shutdown()
            raise
        self.max_model_len = ready.max_model_len
        self.inputs = InputProcessor(self.tokenizer, eos_token_ids(self.tokenizer, model_dir, hf_config),
                                     ready.vocab_size, ready.max_model_len, config.block_size,
                                     ready.num_total_blocks)
        self.outputs = OutputProcessor(self.tokenizer)
        self._client.start_monitor()

    # -- public API --------------------------------------------------------------------

    @property
    def core_pid(self) -> int:
        return self._client.pid

    @property
    def errored(self) -> bool:
        return self._client.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._client.dead_error

    def add_failure_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` (from the monitor thread) when the engine dies."""
        self._failure_callbacks.append(callback)

    async def check_health(self) -> None:
        self._raise_if_dead()

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, add_special_tokens: bool = True
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has `finished` set. Raises RequestError,
        PromptTooLongError, GenerationError, EngineOverloadedError or EngineDeadError.
        Cancelling the consuming task (or leaving the loop early) aborts the request."""
        stream = self.add_request(prompt, sampling_params, request_id, add_special_tokens=add_special_tokens)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, *, add_special_tokens: bool = True) -> "RequestStream":
        """Validate and submit a request now (errors raise here, before any output), and
        return its stream. The caller must `aclose()` it (that aborts it if unfinished)."""
        return RequestStream(self, self._open(prompt, sampling_params or SamplingParams(), request_id,
                                              add_special_tokens))

    async def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            self._abort_stream(stream)

    async def stats(self) -> dict:
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        token = next(self._tokens)
        self._stats_waiters[token] = (loop, future)
        try:
            self._client.send(StatsQuery(token))
            core_stats = await future
        finally:
            self._stats_waiters.pop(token, None)
        with self._lock:
            return {**core_stats, "num_live_requests": len(self._streams), "num_errors": self.num_errors}

    def shutdown(self) -> None:
        """Stop the engine-core process (no child is left behind) and end open streams."""
        self._client.shutdown()
        error = EngineDeadError("the engine was shut down; create a new engine")
        if self._client.dead_error is None:
            self._client.dead_error = error
        self._fail_all(error)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.shutdown()

    # -- requests in ----------------------------------------------------------------------

    def _open(self, prompt, params: SamplingParams, request_id: str | None, add_special_tokens: bool) -> _Stream:
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        prompt_text = prompt if isinstance(prompt, str) else None
        try:
            token_ids = self.inputs.tokenize(prompt, add_special_tokens)
            requests = self.inputs.make_requests(request_id, token_ids, params, prompt_text)
        except GenerationError:
            self._count_error()
            raise
        output = RequestOutput(request_id, prompt_text, token_ids, [CompletionOutput(i) for i in range(params.n)])
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), output, [r.request_id for r in requests])
        with self._lock:
            if request_id in self._streams or any(c in self._by_child for c in stream.child_ids):
                raise RequestError(f"request id {request_id!r} is already in use; use a unique id",
                                   param="request_id")
            self._check_capacity(len(requests))
            try:
                self.outputs.add(output, stream.child_ids, params)
            except GenerationError:
                self._count_error()
                raise
            self._streams[request_id] = stream
            self._by_child.update((child, stream) for child in stream.child_ids)
        try:
            self._client.send(AddRequests(requests))
        except EngineDeadError:
            self._close(stream)
            raise
        return stream

    def _check_capacity(self, count: int) -> None:
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        waiting = len(self._by_child) + count - self.config.max_num_seqs
        if waiting > limit:
            raise EngineOverloadedError(
                f"the engine is overloaded: {len(self._by_child)} requests are in flight and at most "
                f"{limit} may wait beyond the {self.config.max_num_seqs} running; retry later")

    def _abort_stream(self, stream: _Stream) -> None:
        with self._lock:
            live = [c for c in stream.child_ids if self.outputs.finish(c, "abort") is not None]
        if live and not self.errored:
            try:
                self._client.send(Abort(live))
            except EngineDeadError:
                pass
        stream.push(_snapshot(stream.output))

    def _close(self, stream: _Stream) -> None:
        with self._lock:
            if self._streams.get(stream.output.request_id) is stream:
                del self._streams[stream.output.request_id]
            for child in stream.child_ids:
                self.outputs.fail(child, GenerationError("the request stream was closed"))
                self._by_child.pop(child, None)

    def _raise_if_dead(self) -> None:
        error = self._client.dead_error
        if error is not None:
            raise EngineDeadError(error.message)

    def _count_error(self) -> None:
        with self._lock:
            self.num_errors += 1

    # -- outputs in (monitor thread) ------------------------------------------------------

    def _on_core_message(self, message) -> None:
        if isinstance(message, StepOutputs):
            self._on_step_outputs(message.updates, message.step)
        elif isinstance(message, StatsReply):
            waiter = self._stats_waiters.get(message.token)
            if waiter is not None:
                loop, future = waiter
                loop.call_soon_threadsafe(_resolve, future, message.stats)

    def _on_step_outputs(self, updates, step: int) -> None:
        with self._lock:
            changed, to_finish = self.outputs.process(updates, step)
            if to_finish:
                # Queued before any final output is pushed, so a caller that reuses an id
                # after seeing it finish can never overtake this abort.
                try:
                    self._client.send(Abort(to_finish))
                except EngineDeadError:
                    pass
            for output in changed:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                snapshot = _snapshot(output)
                for completion in output.outputs:
                    completion.delta_text = ""
                errors = [c.error for c in snapshot.outputs if c.finish_reason == "error"]
                if errors and snapshot.finished:
                    self.num_errors += 1
                    stream.push(GenerationError(errors[0].split(": ", 1)[-1]))
                else:
                    stream.push(snapshot)

    def _on_core_death(self, error: EngineDeadError) -> None:
        # Owners hear first, so that by the time a request fails its owner already knows.
        for callback in list(self._failure_callbacks):
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                logger.exception("an engine failure callback raised")
        self._fail_all(error)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            streams = list(self._streams.values())
            waiters = list(self._stats_waiters.values())
        for stream in streams:
            stream.push(EngineDeadError(error.message))
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_fail, future, EngineDeadError(error.message))
            except RuntimeError:  # that event loop is closed
                pass


class RequestStream:
    """Async iterator over one request's outputs (see AsyncEngine.add_request)."""

    def __init__(self, engine: AsyncEngine, stream: _Stream):
        self._engine = engine
        self._stream = stream
        self._done = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._stream.output.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._stream.output.prompt_token_ids

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._done:
            self._engine._abort_stream(self._stream)
        self._engine._close(self._stream)


def _snapshot(output: RequestOutput) -> RequestOutput:
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, [
        dataclasses.replace(c, token_ids=list(c.token_ids),
                            logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in output.outputs])


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
