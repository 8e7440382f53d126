"""AsyncEngine: request streams over an engine core running in a child process; an
asyncio face over an EngineClient (client.py), which does the rest.

Tokenizing, detokenizing and stop strings run here, in the client process, on the event
loop that made the requests; a failure in them ends only its request (GenerationError).
The core's outputs reach that loop from the CoreClient's reader thread through
`call_soon_threadsafe`, so no lock is shared between a thread and the loop. The core's
death or hang is seen by the CoreClient's monitor, which does nothing else, and fails
every in-flight request with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping

from gristmill import startup
from gristmill.config import EngineConfig
from gristmill.engine.client import OUTPUT_KINDS, EngineClient, EngineFace, in_child_process
from gristmill.engine.messages import Rejected, StatsQuery, StatsReply, StepOutputs
from gristmill.engine.stream import RequestStream
from gristmill.errors import EngineDeadError, GenerationError, GristmillError, RequestError
from gristmill.lora import LoRARequest, as_lora_request
from gristmill.outputs import POOLING_OUTPUT_CLASSES, PoolingRequestOutput, RequestOutput
from gristmill.pooling_params import PoolingParams
from gristmill.prompts import prompt_item
from gristmill.sampling import SamplingParams

logger = logging.getLogger(__name__)

#: Text prompts longer than this (characters) are tokenized on a worker thread by
#: `tokenize`: the Rust tokenizer releases the GIL (about 0.7 s per million characters on
#: one core), so a huge prompt never holds up the event loop, other streams or /health.
LONG_PROMPT_CHARS = 32_768


class AsyncEngine(EngineFace):
    """The engine behind the server and batch runners.

    >>> engine = AsyncEngine(EngineConfig(model=None))   # returns once the core is ready
    >>> async for out in engine.generate("Hi", SamplingParams(max_tokens=8), request_id="r1"):
    ...     print(out.delta_text, end="")

    Its requests belong to one event loop at a time: the loop of the first request made
    while none is in flight.
    """

    def __init__(self, config: EngineConfig | None = None, *, core_env: Mapping[str, str] | None = None,
                 **options):
        """Start an engine (returns once its core is ready); keywords are EngineConfig fields.
        `core_env`: environment variables for the engine-core process, over this one's (an
        engine pool gives each replica its GPU as CUDA_VISIBLE_DEVICES); kept for restarts."""
        started = time.monotonic()
        config = config or EngineConfig.from_kwargs(**options)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Open streams by request id: (a weak reference to it, its serial). A stream
        #: nobody holds any more is aborted (`_abandoned`).
        self._streams: dict[str, tuple[weakref.ref, int]] = {}
        self._serials = itertools.count()
        self._stats_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        self.num_errors = 0
        #: Times a new core replaced a dead one (`restart`).
        self.num_restarts = 0
        self._closed = False
        self._lock = threading.Lock()  # shutdown against a restart's swap of cores
        # The core's threads hold the engine weakly: an engine nobody holds any more is
        # collected, and its core process shut down with it (EngineClient.start_core).
        self.client = EngineClient(config, in_child_process(core_env, _weakly(self._on_core_message),
                                                            _weakly(self._on_core_death)),
                                   max_waiting_requests=config.max_waiting_requests)
        self.client.core.start()
        #: Seconds the engine took to start (converting, quantizing, compiling, loading).
        self.start_seconds = time.monotonic() - started
        startup.logger.info("engine ready in %.1f s", self.start_seconds)

    # -- public API --------------------------------------------------------------------

    @property
    def core_pid(self) -> int:
        return self.client.core.pid

    @property
    def errored(self) -> bool:
        return self.client.dead_error is not None

    def add_failure_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` (from the monitor thread) when the engine dies."""
        self._failure_callbacks.append(callback)

    async def check_health(self) -> None:
        self._raise_if_dead()

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, add_special_tokens: bool = True,
                       output_kind: str = "cumulative", token_times: bool = True,
                       chat_prompt: str | None = None, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has `finished` set. Raises RequestError,
        PromptTooLongError, GenerationError, EngineOverloadedError or EngineDeadError.
        Cancelling the consuming task (or leaving the loop early) aborts the request.
        `output_kind` (`client.OUTPUT_KINDS`): "cumulative" (each output holds everything
        so far), "delta" (only what is new) or "final" (one output, at the end; nothing
        copied per step; aborted, it ends with no text). `token_times`: with "final",
        `metrics.token_arrivals` holds each token's time (when the core knew it); False:
        the caller needs none (the arrivals are then one, at its end). `chat_prompt`: the
        rendered chat the prompt is; on a reasoning model its constraint applies after the
        reasoning, and `max_reasoning_tokens` bounds that. `lora_request`: the LoRA adapter
        it runs with (an engine started with enable_lora); one that cannot load ends the
        stream with LoRAAdapterError."""
        stream = self.add_request(prompt, sampling_params, request_id, add_special_tokens=add_special_tokens,
                                  output_kind=output_kind, token_times=token_times, chat_prompt=chat_prompt,
                                  lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, *, add_special_tokens: bool = True,
                    max_buffered: int | None = None, output_kind: str = "cumulative",
                    prompt_token_ids: list[int] | None = None, token_times: bool = True,
                    chat_prompt: str | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and submit a request now (errors raise here, before any output), and
        return its stream. Call it from a running event loop. The caller must `aclose()`
        the stream (that aborts the request if unfinished; so does dropping the stream).
        `max_buffered`: outputs that may wait unread before the request is aborted (a
        reader too slow for it) and the stream ends with GenerationError. `output_kind`,
        `token_times`, `chat_prompt`: see `generate`. `prompt_token_ids`: the text prompt's ids from
        `tokenize`, so it is not tokenized again here."""
        if output_kind not in OUTPUT_KINDS:
            raise RequestError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {output_kind!r}",
                               param="output_kind")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise RequestError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}; "
                               f"e.g. SamplingParams(**your_dict)", param="sampling_params")
        params = sampling_params or SamplingParams()
        return self._open_stream(prompt, request_id, max_buffered, lambda prompt, request_id: self.client.add(
            prompt, params, request_id, output_kind=output_kind, add_special_tokens=add_special_tokens,
            prompt_token_ids=prompt_token_ids, token_times=token_times, chat_prompt=chat_prompt,
            lora=as_lora_request(lora_request)))

    async def encode(self, prompt: str | list[int], pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, *, kind: str = "encode", text_pair: str | None = None,
                     add_special_tokens: bool = True, lora_request: LoRARequest | None = None
                     ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request (an engine whose task is embed, classify or score), as
        vLLM's AsyncLLM.encode: one output, when it ends. `kind` is what it holds
        (`outputs.pooled_output`): "embed" (`outputs.embedding`), "classify"
        (`outputs.probs`), "score" (`outputs.score` of the pair (`prompt`, `text_pair`) by a
        cross-encoder) or "encode" (`outputs.data`). Raises as `generate` does."""
        stream = self.add_pooling_request(prompt, pooling_params, request_id, kind=kind, text_pair=text_pair,
                                          add_special_tokens=add_special_tokens, lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def add_pooling_request(self, prompt: str | list[int], pooling_params: PoolingParams | None = None,
                            request_id: str | None = None, *, kind: str = "encode", text_pair: str | None = None,
                            add_special_tokens: bool = True, prompt_token_ids: list[int] | None = None,
                            token_type_ids: list[int] | None = None,
                            lora_request: LoRARequest | None = None) -> RequestStream:
        """`add_request` for a pooling request (see `encode`). `prompt_token_ids` (and a
        pair's `token_type_ids`): the prompt tokenized already (`inputs.tokenize_for_pooling`)."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise RequestError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}; "
                               f"e.g. PoolingParams(**your_dict)", param="pooling_params")
        if kind not in POOLING_OUTPUT_CLASSES:
            raise RequestError(f"kind must be one of {', '.join(POOLING_OUTPUT_CLASSES)}, got {kind!r}", param="kind")
        params = pooling_params or PoolingParams()
        return self._open_stream(prompt, request_id, None, lambda prompt, request_id: self.client.add_pooling(
            prompt, params, request_id, kind, pair=text_pair, add_special_tokens=add_special_tokens,
            prompt_token_ids=prompt_token_ids, token_type_ids=token_type_ids, lora=as_lora_request(lora_request)))

    def _open_stream(self, prompt, request_id: str | None, max_buffered: int | None, submit) -> RequestStream:
        """Check what every request shares, `submit(prompt, request_id)` it to the client
        and open its stream."""
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"request_id must be a string (or None for a generated one), got "
                               f"{type(request_id).__name__} {request_id!r}", param="request_id")
        prompt, invalid = prompt_item(prompt)  # (also vLLM's prompt dicts)
        if invalid is not None:
            raise invalid
        self._raise_if_dead()
        self._bind_loop()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use; use a unique id",
                               param="request_id")
        try:
            tracked = submit(prompt, request_id)
        except GenerationError:
            self.num_errors += 1
            raise
        serial = next(self._serials)
        stream = RequestStream(request_id, tracked.output.prompt_token_ids, self._release, max_buffered, serial)
        self._streams[request_id] = (weakref.ref(stream), serial)
        weakref.finalize(stream, _weakly(self._abandoned), request_id, serial).atexit = False
        return stream

    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, checked as `add_request` checks them; a text longer than
        LONG_PROMPT_CHARS is tokenized on a worker thread while the loop goes on."""
        try:
            if isinstance(prompt, str) and len(prompt) > LONG_PROMPT_CHARS:
                return await asyncio.to_thread(self.inputs.tokenize, prompt, add_special_tokens)
            return self.inputs.tokenize(prompt, add_special_tokens)
        except GenerationError:
            self.num_errors += 1
            raise

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish_reason "abort"); an unknown or
        finished id is ignored. May be called from another event loop or thread: the
        abort then runs on the engine's loop, which its streams wait on."""
        loop = self._loop
        if loop is not None and loop is not asyncio.get_running_loop() and loop.is_running():
            _call_threadsafe(loop, self._abort_now, request_id)
        else:
            self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        output = self.client.abort(request_id)
        stream = self._stream(request_id)
        if stream is not None and output is not None:
            stream.push(output)

    async def stats(self) -> dict:
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        token = next(self._tokens)
        self._stats_waiters[token] = (loop, future)
        try:
            self.client.core.send(StatsQuery(token))
            core_stats = await future
        finally:
            self._stats_waiters.pop(token, None)
        return {**core_stats, "num_live_requests": len(self._streams), "num_errors": self.num_errors}

    def abort_all(self, error: GristmillError) -> None:
        """End every open request now with (a copy of) `error` and free its KV blocks.
        Call it on the engine's event loop."""
        for tracked in self.client.abort_all():
            stream = self._stream(tracked.request_id)
            if stream is not None:
                stream.push(type(error)(error.message))

    def shutdown(self) -> None:
        """Stop the engine-core process (no child is left behind) and end open streams."""
        with self._lock:
            self._closed = True
        core = self.client.core
        core.shutdown()
        if core.dead_error is None:
            core.dead_error = EngineDeadError("the engine was shut down; create a new engine")
        self._fail_waiters(core.dead_error)
        self._on_loop(self._fail_streams, core.dead_error)

    def restart(self) -> None:
        """Replace the core with a new one of the same config, keeping this engine's
        tokenizer, failure callbacks and event loop. Blocks until the new core is ready
        (seconds: call it from a worker thread, as `gristmill.engine.restarts.restart`
        does). Requests of the old core end with EngineDeadError; new requests are
        refused with it until the new core is ready. Raises EngineDeadError (the engine
        stays dead) when the new core fails to start."""
        if self._closed:
            raise EngineDeadError("the engine was shut down; create a new engine")
        old = self.client.core
        old.shutdown()
        if old.dead_error is None:
            old.dead_error = EngineDeadError("the engine was restarted; send the request again")
        self._fail_waiters(old.dead_error)
        self._on_loop(self._drop_streams, old.dead_error)
        core = self.client.start_core()
        with self._lock:
            if self._closed:
                core.shutdown()
                raise EngineDeadError("the engine was shut down while it restarted; create a new engine")
            self.client.core = core  # from here on requests reach the new core
            self.num_restarts += 1
            core.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.shutdown()

    # -- streams (on the event loop) --------------------------------------------------

    def _stream(self, request_id: str) -> RequestStream | None:
        entry = self._streams.get(request_id)
        return None if entry is None else entry[0]()

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        old = self._loop
        if old is not None and old.is_running() and self._streams:
            raise RequestError("this AsyncEngine has requests in flight on another event loop; "
                               "use it from one event loop at a time (or one engine per loop)")
        # What a loop that is gone left open: nobody can read it any more.
        self.client.abort_all()
        self._streams.clear()
        self._loop = loop

    def _release(self, request_id: str, serial: int) -> None:
        """A stream was closed: abort what is unfinished of its request and forget it."""
        entry = self._streams.get(request_id)
        if entry is not None and entry[1] == serial:
            del self._streams[request_id]
            self.client.abort(request_id)

    def _abandoned(self, request_id: str, serial: int) -> None:
        """A stream nobody holds any more (never closed): release it on its loop. A loop
        that is closed already left it to `_bind_loop` (the next request's) or to the
        engine's end; until then the core runs it to its end."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is loop:
            self._release(request_id, serial)
        elif loop is not None and not loop.is_closed():
            _call_threadsafe(loop, self._release, request_id, serial)

    def _raise_if_dead(self) -> None:
        error = self.client.dead_error
        if error is not None:
            raise EngineDeadError(error.message)

    # -- outputs in -----------------------------------------------------------------------

    def _on_core_message(self, message) -> None:
        """On the CoreClient's reader thread: route a message, touching no request state."""
        if isinstance(message, StatsReply):
            waiter = self._stats_waiters.get(message.token)
            if waiter is not None:
                _call_threadsafe(waiter[0], _resolve, waiter[1], message.stats)
        elif isinstance(message, (StepOutputs, Rejected)):
            loop = self._loop
            if loop is not None and loop.is_closed() and isinstance(message, StepOutputs):
                # Its loop ended with streams left open (never closed): nobody can read
                # them, so stop generating for them now instead of to max_tokens (nothing
                # else touches the requests once their loop is closed).
                self.client.core.abort(self.client.child_ids())
            elif loop is not None:  # else no request was ever made: nothing to deliver
                _call_threadsafe(loop, self._on_outputs, message)

    def _on_outputs(self, message: StepOutputs | Rejected) -> None:
        """On the event loop: hand the core's updates to the streams."""
        for delivery in self.client.handle(message):
            stream = self._stream(delivery.tracked.request_id)
            if stream is None:
                continue
            if delivery.error is not None:
                self.num_errors += 1
                stream.push(delivery.error)
            elif stream.push(delivery.output):  # its reader fell too far behind
                self.num_errors += 1
                self.client.abort(delivery.tracked.request_id)

    def _on_core_death(self, error: EngineDeadError) -> None:
        """On the monitor thread."""
        if error is not self.client.dead_error:
            return  # a core that was already replaced
        # Owners hear first, so that by the time a request fails its owner already knows.
        for callback in list(self._failure_callbacks):
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                logger.exception("an engine failure callback raised")
        self._fail_waiters(error)
        loop = self._loop
        if loop is not None:
            _call_threadsafe(loop, self._fail_streams, error)

    def _fail_streams(self, error: EngineDeadError) -> None:
        for request_id in list(self._streams):
            stream = self._stream(request_id)
            if stream is not None:
                stream.push(EngineDeadError(error.message))

    def _drop_streams(self, error: EngineDeadError) -> None:
        """Fail and forget the streams of a core that was replaced (their owners may
        close them later; that changes nothing)."""
        self._fail_streams(error)
        self.client.abort_all()
        self._streams.clear()

    def _fail_waiters(self, error: EngineDeadError) -> None:
        for loop, future in list(self._stats_waiters.values()):
            _call_threadsafe(loop, _fail, future, EngineDeadError(error.message))

    def _on_loop(self, fn: Callable, *args) -> None:
        """Run `fn` on the engine's event loop: now if called from it, else soon."""
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(*args)
        else:
            _call_threadsafe(loop, fn, *args)


def _call_threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _weakly(method):
    """`method` (bound) called through a weak reference to its object: nothing once the
    object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return call
