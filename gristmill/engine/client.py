"""EngineClient: what every face of the engine shares, written once.

It owns the tokenizer, input processing (`InputProcessor`), output processing
(`OutputProcessor`) and a core, and follows each request from `add` to its end:

- `InprocCore`: the `EngineCore` in this process, stepped by the caller (`LLM`: no IPC,
  no threads; a step that raises leaves the engine dead).
- `CoreClient` (core_client.py): the core in a child process, watched by a monitor
  (`AsyncEngine`, and through it the server, batch jobs and Ray). Its messages reach the
  face's own thread or event loop, which hands them to `handle`.
- `SteppedChildCore` (core_client.py): a `CoreClient` stepped by its client's caller as
  `InprocCore` is (`LLM(core_process=True)`, what `gristmill generate` runs): each step
  waits for the core's next message.

Both take `add(requests) -> [Rejected]` (a request's completions; a child-process core
answers later), `abort(child_ids)` and `shutdown()`, and have `dead_error`. A face (`LLM`, `AsyncEngine`) adds only its signature, its threading
and how it hands outputs over; a new kind of request is added here once.

The client is not thread-safe: one thread (or event loop) at a time uses it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

from gristmill import faults
from gristmill.chat.reasoning import ReasoningParser, choose_reasoning_parser
from gristmill.chat.tool_calls import ToolCallParser, choose_tool_parser
from gristmill.config import EngineConfig
from gristmill.engine import builder
from gristmill.engine.core import EngineCore
from gristmill.engine.core_client import CoreClient, SteppedChildCore
from gristmill.engine.messages import AddRequest, Rejected, StepOutputs
from gristmill.engine.output_processor import OutputProcessor
from gristmill.lora import LoRARequest, as_lora_request
from gristmill.engine.processor import InputProcessor, check_pooling_request
from gristmill.errors import (EngineDeadError, EngineOverloadedError, GenerationError, GristmillError, RequestError,
                              error_from_string, error_string)
from gristmill.pooling_tasks import check_generates, check_task
from gristmill.outputs import (POOLING_OUTPUT_CLASSES, CompletionOutput, PoolingRequestOutput, RequestMetrics,
                               RequestOutput)
from gristmill.pooling_params import PoolingParams
from gristmill.sampling import SamplingParams, generation_config_defaults

#: What a request's outputs hold, by the `output_kind` it was added with (`make_output`):
#: - "cumulative": every output holds all the text, tokens and logprobs so far, and
#:   `delta_text` what is new;
#: - "delta": only what is new since the output before (`text` = `delta_text`);
#: - "final": one output, when the request finishes, with all of it. Nothing is copied
#:   per step, its text is decoded once, at its end, and unless it needs its tokens as
#:   they come (stop strings, logprobs) the core sends them once, at its end, too
#:   (`AddRequest.send_at_end`).
OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclasses.dataclass(eq=False)
class Tracked:
    """A request the client follows until it ends (or is aborted)."""

    #: The client's view of the request, updated in place; faces hand out `make_output`'s.
    output: RequestOutput
    #: Engine (core) request ids of its completions, one per `n`.
    child_ids: list[str]
    output_kind: str
    #: Tokens of each completion handed out so far ("delta").
    sent: list[int]

    @property
    def request_id(self) -> str:
        return self.output.request_id


@dataclasses.dataclass
class Delivery:
    """An output (by its request's output kind) that a face hands to its caller, and the
    error that ends the request when one does (the first completion's error, as the
    face raises it; None when the request goes on or ended well)."""

    tracked: Tracked
    output: RequestOutput
    error: GristmillError | None = None


def make_output(tracked: Tracked, output: RequestOutput) -> RequestOutput | None:
    """What the caller of a request is handed of `output` now, by its output kind; None:
    nothing yet. The one place output kinds are decided."""
    if isinstance(output, PoolingRequestOutput):  # (one output, at its end)
        return output if output.finished else None
    if tracked.output_kind == "final":
        if not output.finished:
            return None
        for completion in output.outputs:
            completion.delta_text = completion.text
        return output  # finished: nothing changes it any more
    if tracked.output_kind == "delta":
        pushed = _delta(output, tracked.sent)
    else:
        pushed = _snapshot(output)
    for completion in output.outputs:
        completion.delta_text = ""
    return pushed


def _snapshot(output: RequestOutput) -> RequestOutput:
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, [
        dataclasses.replace(c, token_ids=list(c.token_ids),
                            logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in output.outputs], output.metrics, output.prompt_logprobs)


def _delta(output: RequestOutput, sent: list[int]) -> RequestOutput:
    """What is new in `output` since `sent[i]` tokens of completion i were handed out."""
    completions = []
    for c in output.outputs:
        start, sent[c.index] = sent[c.index], len(c.token_ids)
        completions.append(dataclasses.replace(c, text=c.delta_text, token_ids=c.token_ids[start:],
                                               logprobs=None if c.logprobs is None else c.logprobs[start:]))
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, completions, output.metrics,
                         output.prompt_logprobs)


def rejection_error(error: str, param: str | None = None) -> GristmillError:
    """The error of a request the engine core refused (`Rejected`): a RequestError
    (naming `param`) when the core found the request invalid, which is the caller's to
    fix, as if it had been refused where it was made; else a GenerationError."""
    name, _, text = error.partition(": ")
    if name == "RequestError":
        return RequestError(text, param=param)
    return GenerationError(f"the engine core refused the request: {error}")


class InprocCore:
    """The engine core in this process, stepped by its client's caller."""

    def __init__(self, core: EngineCore):
        self.engine_core = core
        self.dead_error: EngineDeadError | None = None

    def add(self, requests: list[AddRequest]) -> list[Rejected]:
        """Add a request's completions; returns the refusals."""
        refused = []
        for request in requests:
            error = self.engine_core.add_request(request)
            if error is not None:
                refused.append(Rejected(request.request_id, error_string(error), error.param))
        return refused

    def abort(self, child_ids: list[str]) -> None:
        if child_ids and self.dead_error is None:
            self.engine_core.abort(child_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.dead_error is None and self.engine_core.has_unfinished

    def step(self) -> StepOutputs:
        """One engine step. A step that raises leaves the engine dead (EngineDeadError):
        its state can no longer be trusted."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error.message)
        try:
            updates = self.engine_core.step()
        except Exception as exc:
            self.dead_error = EngineDeadError(
                f"the engine failed during a step and its state can no longer be trusted: "
                f"{error_string(exc)}; create a new LLM")
            raise self.dead_error from exc
        return StepOutputs(self.engine_core.num_steps, updates)

    def shutdown(self) -> None:
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down; create a new engine")


class EngineClient:
    """Starts an engine (a core in this process or in a child process) and follows its
    requests. `core_factory(config) -> CoreClient` starts a child-process core; None
    builds the core in this process."""

    def __init__(self, config: EngineConfig,
                 core_factory: Callable[[EngineConfig], CoreClient] | None = None,
                 max_waiting_requests: int | None = None, tokenizer_beside_core: bool = False):
        """`max_waiting_requests`: completions that may wait beyond the `max_num_seqs`
        running before `add` refuses more (EngineOverloadedError); None: no limit.
        `tokenizer_beside_core` (a child-process core): load the tokenizer on a thread
        while the core starts, not before it; see `_start_beside_tokenizer`."""
        faults.load()  # a malformed GRISTMILL_FAULTS fails here, before anything starts
        builder.start_kernels(config)  # a first start on a CPU compiles them meanwhile
        #: The HF directory the model is loaded from (a GGUF file's converted copy: a
        #: GGUF is converted once, here, so a core never converts).
        self.core_config = builder.resolve_config(config)
        self.model_dir = Path(self.core_config.model)
        #: What the engine runs: "generate", or a pooling task ("embed", "classify", "score").
        self.task = self.core_config.task
        #: The SamplingParams fields the model's generation_config.json sets (read once).
        self.generation_defaults = generation_config_defaults(self.model_dir)
        config = dataclasses.replace(config, task=self.task)
        self._core_factory = core_factory
        if core_factory is None:
            # The tokenizer loads on a thread while the model loads (each takes seconds;
            # only the tokenizer imports transformers).
            pool = concurrent.futures.ThreadPoolExecutor(1, "gristmill-tokenizer")
            loading = pool.submit(builder.load_tokenizer, self.model_dir, config.cache_dir)
            pool.shutdown(wait=False)
            core = builder.build_core(self.core_config, self.model_dir)
            self.core = InprocCore(core)
            self.tokenizer, eos_token_ids = loading.result()
            capacity = core.capacity
        elif tokenizer_beside_core:
            self.tokenizer, eos_token_ids = self._start_beside_tokenizer(config.cache_dir)
            capacity = self.core.capacity
        else:
            # Before the core starts, not beside it: loading a tokenizer holds the GIL for
            # a second at a time (the Rust tokenizer's parse of a 262k vocabulary), which
            # would hold up seeing a core that dies while it starts.
            self.tokenizer, eos_token_ids = builder.load_tokenizer(self.model_dir, config.cache_dir)
            self.core = self.start_core()
            capacity = self.core.capacity
        self.capacity = capacity
        #: What keeps a chat's reasoning apart from its answer (EngineConfig.reasoning_parser,
        #: or the model's chat template's), or None.
        self.reasoning_parser = choose_reasoning_parser(config.reasoning_parser,
                                                        getattr(self.tokenizer, "chat_template", None))
        #: What reads a chat's tool calls (EngineConfig.tool_call_parser, or the model's chat
        #: template's), or None: requests with tools are refused.
        self.tool_parser = choose_tool_parser(config.tool_call_parser, getattr(self.tokenizer, "chat_template", None))
        #: The config as the core runs it: step limits left None are its device's defaults.
        self.config = dataclasses.replace(config, max_num_seqs=capacity.max_num_seqs,
                                          max_num_batched_tokens=capacity.max_num_batched_tokens)
        self.inputs = InputProcessor(self.tokenizer, eos_token_ids, capacity, self.reasoning_parser)
        self.outputs = OutputProcessor(self.tokenizer, eos_token_ids=eos_token_ids)
        self._tracked: dict[str, Tracked] = {}
        self._by_child: dict[str, Tracked] = {}
        self.max_waiting_requests = max_waiting_requests

    # -- the core ---------------------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.core.dead_error

    def start_core(self, meanwhile: Callable[[], None] | None = None) -> CoreClient:
        """A new child-process core of the same config, ready (its `capacity` set); the
        caller puts it in place of `core` (a restart). Blocks until it is ready, running
        `meanwhile()` once the process is started; raises EngineDeadError when it fails to
        start. It is killed when this client is collected: an engine nobody holds any
        more (a script that forgot shutdown(), a notebook cell run again) leaves no
        process behind."""
        core = self._core_factory(self.core_config)
        weakref.finalize(self, core.abandon)
        try:
            if meanwhile is not None:
                meanwhile()
            core.capacity = core.wait_ready().capacity
        except BaseException:
            core.shutdown()
            raise
        return core

    def _start_beside_tokenizer(self, cache_dir: str | None) -> tuple[object, frozenset[int]]:
        """Start the core and, while it imports torch and loads the model (in its process,
        on the other core of a 2-core machine), load the tokenizer here on a thread; each
        takes seconds on a warm start. A core that dies meanwhile is reported once the
        tokenizer's thread lets go of the GIL (it holds it for up to about a second,
        building the Rust tokenizer), not at once as with the tokenizer loaded first: a
        trade a face that must see a death at once (a server, which restarts it) does not
        make. The thread is a daemon: a start that fails does not wait for it."""
        loading: concurrent.futures.Future = concurrent.futures.Future()

        def load() -> None:
            try:
                loading.set_result(builder.load_tokenizer(self.model_dir, cache_dir))
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                loading.set_exception(exc)

        self.core = self.start_core(
            lambda: threading.Thread(target=load, name="gristmill-tokenizer", daemon=True).start())
        try:
            return loading.result()
        except BaseException:
            self.core.shutdown()
            raise

    def shutdown(self) -> None:
        self.core.shutdown()

    # -- requests in --------------------------------------------------------------------

    def child_ids(self) -> list[str]:
        """Engine request ids of every completion in flight."""
        return list(self._by_child)

    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
            output_kind: str = "cumulative", add_special_tokens: bool = True,
            prompt_token_ids: list[int] | None = None, token_times: bool = True,
            chat_prompt: str | None = None, lora: LoRARequest | None = None) -> Tracked:
        """Validate, tokenize and submit a request (`prompt_token_ids`: a text prompt's
        ids, tokenized already; `chat_prompt`: the rendered chat the prompt is, whose
        constraint on a reasoning model applies after the reasoning). Raises RequestError or GenerationError (nothing of it is
        kept then), EngineOverloadedError (past `max_waiting_requests`) or
        EngineDeadError. A request the core refuses at once (one in this process) comes
        back ended, with its error. `token_times`: with "final", the core
        notes when each token became known (for latency metrics). `lora`: the LoRA
        adapter it runs with (an engine with enable_lora)."""
        if self.core.dead_error is not None:
            raise EngineDeadError(self.core.dead_error.message)
        self.check_lora(lora)
        check_generates(self.capacity, "generate")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = prompt_token_ids
        if token_ids is None:
            token_ids = self.inputs.tokenize(prompt, add_special_tokens)
        params = self.inputs.keeping_call_markers(params)
        requests = self.inputs.make_requests(request_id, token_ids, params, prompt_text,
                                             send_at_end=output_kind == "final", token_times=token_times,
                                             chat_prompt=chat_prompt)
        for request in requests:
            request.lora = lora
        child_ids = [r.request_id for r in requests]
        if request_id in self._tracked or any(c in self._by_child for c in child_ids):
            raise RequestError(f"request id {request_id!r} is already in use; use a unique id",
                               param="request_id")
        self._admit(len(requests))
        output = RequestOutput(request_id, prompt_text, token_ids, [CompletionOutput(i) for i in range(params.n)],
                               RequestMetrics(time.monotonic()))
        # A "final" output is read only once it ends: its text is decoded then, once.
        self.outputs.add(output, child_ids, params, incremental=output_kind != "final")
        return self._submit(Tracked(output, child_ids, output_kind, [0] * params.n), requests)

    def add_pooling(self, prompt: str | list[int], params: PoolingParams, request_id: str, kind: str, *,
                    pair: str | None = None, add_special_tokens: bool = True,
                    prompt_token_ids: list[int] | None = None, token_type_ids: list[int] | None = None,
                    lora: LoRARequest | None = None) -> Tracked:
        """Validate, tokenize and submit a pooling request (an engine whose task is embed,
        classify or score): `kind` is what its caller gets (`outputs.pooled_output`), `pair`
        the second text of a pair a cross-encoder scores. Its one output comes when it
        ends. Raises as `add` does."""
        if self.core.dead_error is not None:
            raise EngineDeadError(self.core.dead_error.message)
        self.check_lora(lora)
        check_task(kind, self.capacity, pair=pair is not None)
        check_pooling_request(params, self.capacity)  # (once, here: before its prompt is tokenized)
        prompt_text = prompt if isinstance(prompt, str) else None
        token_types = token_type_ids
        if prompt_token_ids is not None:
            token_ids = prompt_token_ids
        else:
            token_ids, token_types = self.inputs.tokenize_for_pooling(prompt, params, add_special_tokens, pair)
        request = self.inputs.make_pooling_request(request_id, token_ids, params, prompt_text, token_types)
        request.lora = lora
        if request_id in self._tracked or request_id in self._by_child:
            raise RequestError(f"request id {request_id!r} is already in use; use a unique id",
                               param="request_id")
        self._admit(1)
        output = POOLING_OUTPUT_CLASSES[kind](request_id, prompt_text, token_ids,
                                              metrics=RequestMetrics(time.monotonic()))
        self.outputs.add_pooled(output, kind)
        return self._submit(Tracked(output, [request_id], "final", [0]), [request])

    def _submit(self, tracked: Tracked, requests: list[AddRequest]) -> Tracked:
        """Follow `tracked` and send its requests to the core (in one message: scheduled
        in one step); a request the core refuses at once ends with its error."""
        self._tracked[tracked.request_id] = tracked
        self._by_child.update((child, tracked) for child in tracked.child_ids)
        try:
            refused = self.core.add(requests)
        except EngineDeadError:
            self.abort(tracked.request_id)
            raise
        for rejected in refused:
            self.handle(rejected)
        return tracked

    def check_lora(self, lora: LoRARequest | None) -> None:
        """RequestError unless `lora` is None or a LoRARequest this engine can take (one
        started with enable_lora). Whether the adapter runs on the model is found when the
        core loads it: a LoRAAdapterError of the requests naming it."""
        if as_lora_request(lora) is not None and not self.config.enable_lora:
            raise RequestError(f"lora_request names adapter {lora.lora_name!r}, but this engine was started "
                               f"without LoRA; start it with enable_lora=True (and max_loras, max_lora_rank)",
                               param="lora_request")

    def check_pooling(self, kind: str) -> None:
        """RequestError unless this engine runs a pooling task whose model gives what a
        call of `kind` ("embed", "classify", "score", "encode") returns."""
        check_task(kind, self.capacity)

    def _admit(self, count: int) -> None:
        limit = self.max_waiting_requests
        in_flight = len(self._by_child)
        if limit is not None and in_flight + count - self.config.max_num_seqs > limit:
            raise EngineOverloadedError(
                f"the engine is overloaded: {in_flight} requests are in flight and at most "
                f"{limit} may wait beyond the {self.config.max_num_seqs} running; retry later")

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request's unfinished completions ("abort"), free them in the core and
        forget it. Returns what its caller is handed of it now (None: an unknown id, or
        nothing new)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        for child in tracked.child_ids:
            if self._by_child.get(child) is tracked:
                del self._by_child[child]
        self.core.abort([c for c in tracked.child_ids if self.outputs.finish(c, "abort") is not None])
        return make_output(tracked, tracked.output)

    def abort_all(self) -> list[Tracked]:
        """Abort every request (see `abort`); returns them."""
        every = list(self._tracked.values())
        for tracked in every:
            self.abort(tracked.request_id)
        return every

    # -- outputs in -------------------------------------------------------------------

    def step(self) -> list[Delivery]:
        """One step of a core in this process, handled."""
        return self.handle(self.core.step())

    @property
    def has_unfinished(self) -> bool:
        return bool(self._tracked) and self.core.has_unfinished

    def handle(self, message: StepOutputs | Rejected) -> list[Delivery]:
        """The core's updates (or its refusal of a request), as outputs to hand out. A
        request that finishes is forgotten; its completions that a stop string or a
        failure here ended are freed in the core."""
        refused = None
        if isinstance(message, Rejected):
            refused = rejection_error(message.error, message.param)
            parent = self.outputs.fail(message.request_id, refused)
            changed, to_finish = ([parent] if parent is not None else []), []
        else:
            changed, to_finish = self.outputs.process(message.updates, message.step)
        # Freed before any final output is handed out, so a caller that reuses an id
        # after seeing it finish can never overtake this abort.
        self.core.abort(to_finish)
        deliveries = []
        for output in changed:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            finished = output.finished
            pushed = make_output(tracked, output)
            if finished:
                self._forget(tracked)
            if pushed is None:
                continue
            error = None
            if finished and output.error is not None:
                error = refused or error_from_string(output.error)
            deliveries.append(Delivery(tracked, pushed, error))
        return deliveries

    def _forget(self, tracked: Tracked) -> None:
        if self._tracked.get(tracked.request_id) is tracked:
            del self._tracked[tracked.request_id]
        for child in tracked.child_ids:
            if self._by_child.get(child) is tracked:
                del self._by_child[child]


class EngineFace:
    """What every face (`LLM`, `AsyncEngine`) shows of its `client`, written once."""

    client: EngineClient

    @property
    def config(self) -> EngineConfig:
        """The config as the engine runs it: step limits left None are its device's defaults."""
        return self.client.config

    @property
    def model_dir(self):
        """The HF directory the model was loaded from (a GGUF file's converted copy)."""
        return self.client.model_dir

    @property
    def capacity(self):
        return self.client.capacity

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def inputs(self) -> InputProcessor:
        return self.client.inputs

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        """What splits a chat's reasoning from its answer (None: no split)."""
        return self.client.reasoning_parser

    @property
    def tool_parser(self) -> ToolCallParser | None:
        """What reads a chat's tool calls (None: the model has no call format)."""
        return self.client.tool_parser

    @property
    def outputs(self) -> OutputProcessor:
        return self.client.outputs

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.client.dead_error

    @property
    def max_model_len(self) -> int:
        return self.client.capacity.max_model_len

    def max_new_tokens(self, prompt: str | list[int] | int) -> int:
        """Most tokens a request with this prompt can generate (context length and KV
        cache): `prompt` is its text, its token ids, or its number of tokens."""
        return self.client.inputs.max_new_tokens(self.client.inputs.num_prompt_tokens(prompt))


def in_child_process(core_env: Mapping[str, str] | None, on_message: Callable,
                     on_death: Callable[[EngineDeadError], None]) -> Callable[[EngineConfig], CoreClient]:
    """A core factory for `EngineClient`: each core a child process (`CoreClient`) with
    `core_env` over this process's environment, reporting to these callbacks."""
    def start(config: EngineConfig):
        return CoreClient(config, on_message, on_death, core_env)
    return start


def stepped_in_child_process(core_env: Mapping[str, str] | None = None) -> Callable[[EngineConfig], SteppedChildCore]:
    """A core factory for `EngineClient`: each core a child process its client's caller
    steps (`SteppedChildCore`), with `core_env` over this process's environment."""
    def start(config: EngineConfig):
        return SteppedChildCore(config, core_env)
    return start
