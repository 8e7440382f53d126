"""AsyncEngine: request streams over an engine core running in a child process.

Tokenizing, detokenizing and stop strings run here, in the client process, on the event
loop that made the requests; a failure in them ends only its request (GenerationError).
The core's outputs reach that loop from the CoreClient's reader thread through
`call_soon_threadsafe`, so no lock is shared between a thread and the loop. The core's
death or hang is seen by the CoreClient's monitor, which does nothing else, and fails
every in-flight request with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping

from gristmill import faults, startup
from gristmill.config import EngineConfig
from gristmill.engine import builder
from gristmill.engine.core_client import CoreClient
from gristmill.engine.messages import Abort, Ready, Rejected, StatsQuery, StatsReply, StepOutputs
from gristmill.engine.output_processor import OutputProcessor
from gristmill.engine.processor import InputProcessor
from gristmill.engine.stream import OUTPUT_KINDS, RequestStream
from gristmill.errors import (EngineDeadError, EngineOverloadedError, GenerationError, GristmillError,
                             RequestError)
from gristmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from gristmill.prompts import prompt_item
from gristmill.sampling import SamplingParams

logger = logging.getLogger(__name__)

#: Text prompts longer than this (characters) are tokenized on a worker thread by
#: `tokenize`: the Rust tokenizer releases the GIL (about 0.7 s per million characters on
#: one core), so a huge prompt never holds up the event loop, other streams or /health.
LONG_PROMPT_CHARS = 32_768


class AsyncEngine:
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
        self._core_env = dict(core_env) if core_env else None
        faults.load()  # a malformed GRISTMILL_FAULTS fails here, before any process starts
        self.config = config = config or EngineConfig.from_kwargs(**options)
        builder.start_kernels(self.config)  # a first start compiles them meanwhile
        model_dir = builder.resolve_model_dir(config)  # converts a GGUF once, here
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._by_child: dict[str, RequestStream] = {}
        self._stats_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        self.num_errors = 0
        #: Times a new core replaced a dead one (`restart`).
        self.num_restarts = 0
        self._core_config = dataclasses.replace(config, model=str(model_dir))
        self._closed = False
        self._lock = threading.Lock()  # shutdown against a restart's swap of cores
        # Before the core starts, not beside it: loading a tokenizer holds the GIL for a
        # second at a time (the Rust tokenizer's parse of a 262k vocabulary, even from the
        # kept copy), which would hold up seeing a core that dies while it starts.
        self.tokenizer, eos_token_ids = builder.load_tokenizer(model_dir, config.cache_dir)
        self._client, ready = self._start_core()
        self.capacity = capacity = ready.capacity
        #: The config as the core runs it: step limits left None are its device's defaults.
        self.config = dataclasses.replace(config, max_num_seqs=capacity.max_num_seqs,
                                          max_num_batched_tokens=capacity.max_num_batched_tokens)
        self.inputs = InputProcessor(self.tokenizer, eos_token_ids, self.capacity)
        self.outputs = OutputProcessor(self.tokenizer, eos_token_ids=eos_token_ids)
        self._client.start()
        #: Seconds the engine took to start (converting, quantizing, compiling, loading).
        self.start_seconds = time.monotonic() - started
        startup.logger.info("engine ready in %.1f s", self.start_seconds)

    def _start_core(self) -> tuple[CoreClient, Ready]:
        # The client's threads hold the engine weakly: an engine nobody holds any more (a
        # script that forgot shutdown(), a notebook cell run again) is collected, and its
        # core process shut down with it.
        client = CoreClient(self._core_config, _weakly(self._on_core_message), _weakly(self._on_core_death),
                            self._core_env)
        weakref.finalize(self, client.abandon)
        try:
            return client, client.wait_ready()
        except BaseException:
            client.shutdown()
            raise

    # -- public API --------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.capacity.max_model_len

    @property
    def core_pid(self) -> int:
        return self._client.pid

    @property
    def errored(self) -> bool:
        return self._client.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._client.dead_error

    def max_new_tokens(self, prompt: str | list[int] | int) -> int:
        """Most tokens a request with this prompt can generate (context length and KV
        cache): `prompt` is its text, its token ids, or its number of tokens."""
        return self.inputs.max_new_tokens(self.inputs.num_prompt_tokens(prompt))

    def add_failure_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` (from the monitor thread) when the engine dies."""
        self._failure_callbacks.append(callback)

    async def check_health(self) -> None:
        self._raise_if_dead()

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, add_special_tokens: bool = True,
                       output_kind: str = "cumulative", token_times: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has `finished` set. Raises RequestError,
        PromptTooLongError, GenerationError, EngineOverloadedError or EngineDeadError.
        Cancelling the consuming task (or leaving the loop early) aborts the request.
        `output_kind`: "cumulative" (each output holds everything so far), "delta" (only
        what is new) or "final" (one output, at the end; nothing copied per step).
        A "final" request without stop strings or logprobs gets its tokens from the engine
        core once, at its end, instead of every step (less work per step in both
        processes; aborted, it ends with no text). `token_times`: `metrics.token_arrivals`
        holds each token's time (for such a request, when the core knew it); False: the
        caller needs none (a final-only request's arrivals are then one, at its end)."""
        stream = self.add_request(prompt, sampling_params, request_id, add_special_tokens=add_special_tokens,
                                  output_kind=output_kind, token_times=token_times)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, *, add_special_tokens: bool = True,
                    max_buffered: int | None = None, output_kind: str = "cumulative",
                    prompt_token_ids: list[int] | None = None, token_times: bool = True) -> RequestStream:
        """Validate and submit a request now (errors raise here, before any output), and
        return its stream. Call it from a running event loop. The caller must `aclose()`
        the stream (that aborts the request if unfinished). `max_buffered`: outputs that
        may wait unread before the request is aborted (a reader too slow for it) and the
        stream ends with GenerationError. `output_kind`, `token_times`: see `generate`.
        `prompt_token_ids`: the text prompt's ids from `tokenize`, so it is not tokenized
        again here."""
        if output_kind not in OUTPUT_KINDS:
            raise RequestError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {output_kind!r}",
                               param="output_kind")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise RequestError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}; "
                               f"e.g. SamplingParams(**your_dict)", param="sampling_params")
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"request_id must be a string (or None for a generated one), got "
                               f"{type(request_id).__name__} {request_id!r}", param="request_id")
        prompt, invalid = prompt_item(prompt)  # (also vLLM's prompt dicts)
        if invalid is not None:
            raise invalid
        return self._open(prompt, sampling_params or SamplingParams(), request_id, add_special_tokens,
                          max_buffered, output_kind, prompt_token_ids, token_times)

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
        stream = self._streams.get(request_id)
        if stream is not None:
            self._abort(stream)
            stream.push(_outgoing(stream, stream.output))

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
        return {**core_stats, "num_live_requests": len(self._streams), "num_errors": self.num_errors}

    def abort_all(self, error: GristmillError) -> None:
        """End every open request now with (a copy of) `error` and free its KV blocks.
        Call it on the engine's event loop."""
        for stream in list(self._streams.values()):
            stream.push(type(error)(error.message))
            self._abort(stream)

    def shutdown(self) -> None:
        """Stop the engine-core process (no child is left behind) and end open streams."""
        with self._lock:
            self._closed = True
        self._client.shutdown()
        if self._client.dead_error is None:
            self._client.dead_error = EngineDeadError("the engine was shut down; create a new engine")
        self._fail_waiters(self._client.dead_error)
        self._on_loop(self._fail_streams, self._client.dead_error)

    def restart(self) -> None:
        """Replace the core with a new one of the same config, keeping this engine's
        tokenizer, failure callbacks and event loop. Blocks until the new core is ready
        (seconds: call it from a worker thread, as `gristmill.engine.restarts.restart`
        does). Requests of the old core end with EngineDeadError; new requests are
        refused with it until the new core is ready. Raises EngineDeadError (the engine
        stays dead) when the new core fails to start."""
        if self._closed:
            raise EngineDeadError("the engine was shut down; create a new engine")
        old = self._client
        old.shutdown()
        if old.dead_error is None:
            old.dead_error = EngineDeadError("the engine was restarted; send the request again")
        self._fail_waiters(old.dead_error)
        self._on_loop(self._drop_streams, list(self._streams.values()), old.dead_error)
        client, _ = self._start_core()
        with self._lock:
            if self._closed:
                client.shutdown()
                raise EngineDeadError("the engine was shut down while it restarted; create a new engine")
            self._client = client  # from here on requests reach the new core
            self.num_restarts += 1
            client.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.shutdown()

    # -- requests in (on the event loop) ------------------------------------------------

    def _open(self, prompt, params: SamplingParams, request_id: str | None, add_special_tokens: bool,
              max_buffered: int | None, output_kind: str, token_ids: list[int] | None,
              token_times: bool = True) -> RequestStream:
        self._raise_if_dead()
        self._bind_loop()
        request_id = request_id or uuid.uuid4().hex
        prompt_text = prompt if isinstance(prompt, str) else None
        try:
            if token_ids is None:
                token_ids = self.inputs.tokenize(prompt, add_special_tokens)
            requests = self.inputs.make_requests(request_id, token_ids, params, prompt_text,
                                                 final_only=output_kind == "final", token_times=token_times)
        except GenerationError:
            self.num_errors += 1
            raise
        child_ids = [r.request_id for r in requests]
        if request_id in self._streams or any(c in self._by_child for c in child_ids):
            raise RequestError(f"request id {request_id!r} is already in use; use a unique id",
                               param="request_id")
        self._check_capacity(len(requests))
        output = RequestOutput(request_id, prompt_text, token_ids, [CompletionOutput(i) for i in range(params.n)],
                               RequestMetrics(time.monotonic()))
        try:
            # A "final" output is read only once it ends: its text is decoded then, once.
            self.outputs.add(output, child_ids, params, incremental=output_kind != "final")
        except GenerationError:
            self.num_errors += 1
            raise
        stream = RequestStream(output, child_ids, self._release, max_buffered, output_kind)
        self._streams[request_id] = stream
        self._by_child.update((child, stream) for child in child_ids)
        try:
            for request in requests:
                self._client.send(request)
        except EngineDeadError:
            self._release(stream)
            raise
        return stream

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        old = self._loop
        if old is not None and old.is_running() and self._streams:
            raise RequestError("this AsyncEngine has requests in flight on another event loop; "
                               "use it from one event loop at a time (or one engine per loop)")
        for stream in list(self._streams.values()):  # left open by a loop that is gone
            self._release(stream)
        self._loop = loop

    def _check_capacity(self, count: int) -> None:
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        waiting = len(self._by_child) + count - self.config.max_num_seqs
        if waiting > limit:
            raise EngineOverloadedError(
                f"the engine is overloaded: {len(self._by_child)} requests are in flight and at most "
                f"{limit} may wait beyond the {self.config.max_num_seqs} running; retry later")

    def _abort(self, stream: RequestStream) -> None:
        """End the stream's unfinished completions ("abort") and free them in the core."""
        self._send_abort([c for c in stream.child_ids if self.outputs.finish(c, "abort") is not None])

    def _send_abort(self, child_ids: list[str]) -> None:
        """Free these requests in the core; a dead core has nothing left to free."""
        if child_ids and not self.errored:
            try:
                self._client.send(Abort(child_ids))
            except EngineDeadError:  # it died since
                pass

    def _release(self, stream: RequestStream) -> None:
        """The stream was closed: abort what is unfinished and forget it."""
        self._abort(stream)
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        for child in stream.child_ids:
            if self._by_child.get(child) is stream:
                del self._by_child[child]

    def _raise_if_dead(self) -> None:
        error = self._client.dead_error
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
                # them, so stop generating for them now instead of to max_tokens. All of
                # them, not only those in this message: a final_only request is heard of
                # only every FINAL_ONLY_PULSE tokens. (A stream closed earlier was aborted
                # then and left `_by_child`.)
                self._send_abort(list(self._by_child))
            elif loop is not None:  # else no request was ever made: nothing to deliver
                _call_threadsafe(loop, self._on_outputs, message)

    def _on_outputs(self, message: StepOutputs | Rejected) -> None:
        """On the event loop: turn the core's updates into stream outputs."""
        refused = None
        if isinstance(message, Rejected):
            refused = rejection_error(message.error, message.param)
            parent = self.outputs.fail(message.request_id, refused)
            changed, to_finish = ([parent] if parent is not None else []), []
        else:
            changed, to_finish = self.outputs.process(message.updates, message.step)
        # Queued before any final output is pushed, so a caller that reuses an id after
        # seeing it finish can never overtake this abort.
        self._send_abort(to_finish)
        for output in changed:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            pushed = _outgoing(stream, output)
            if pushed is None:
                continue
            errors = [c.error for c in output.outputs if c.finish_reason == "error"]
            if errors and output.finished:
                self.num_errors += 1
                stream.push(refused or GenerationError(errors[0].split(": ", 1)[-1]))
            elif stream.push(pushed):  # its reader fell too far behind
                self.num_errors += 1
                self._abort(stream)

    def _on_core_death(self, error: EngineDeadError) -> None:
        """On the monitor thread."""
        if error is not self._client.dead_error:
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
        for stream in list(self._streams.values()):
            stream.push(EngineDeadError(error.message))

    def _drop_streams(self, streams: list[RequestStream], error: EngineDeadError) -> None:
        """Fail and forget the streams of a core that was replaced (their owners may
        close them later; that changes nothing)."""
        for stream in streams:
            stream.push(EngineDeadError(error.message))
            self._release(stream)

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


def _outgoing(stream: RequestStream, output: RequestOutput) -> RequestOutput | None:
    """What `stream` is handed of `output` now, by its output kind (None: nothing yet)."""
    if stream.output_kind == "final":
        if not output.finished:
            return None
        for completion in output.outputs:
            completion.delta_text = completion.text
        return output  # finished: nothing changes it any more
    pushed = _delta(output, stream.sent) if stream.output_kind == "delta" else _snapshot(output)
    for completion in output.outputs:
        completion.delta_text = ""
    return pushed


def _snapshot(output: RequestOutput) -> RequestOutput:
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, [
        dataclasses.replace(c, token_ids=list(c.token_ids),
                            logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in output.outputs], output.metrics)


def _delta(output: RequestOutput, sent: list[int]) -> RequestOutput:
    """What is new in `output` since `sent[i]` tokens of completion i were handed out."""
    completions = []
    for c in output.outputs:
        start, sent[c.index] = sent[c.index], len(c.token_ids)
        completions.append(dataclasses.replace(c, text=c.delta_text, token_ids=c.token_ids[start:],
                                               logprobs=None if c.logprobs is None else c.logprobs[start:]))
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, completions, output.metrics)


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


def rejection_error(error: str, param: str | None = None) -> GristmillError:
    """The error of a request the engine core refused (`Rejected`): a RequestError
    (naming `param`) when the core found the request invalid, which is the caller's to
    fix, as if it had been refused where it was made; else a GenerationError."""
    name, _, text = error.partition(": ")
    if name == "RequestError":
        return RequestError(text, param=param)
    return GenerationError(f"the engine core refused the request: {error}")


def _weakly(method):
    """`method` (bound) called through a weak reference to its object: nothing once the
    object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return call
