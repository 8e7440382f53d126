"""RequestStream: one request's outputs, as an async iterator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gristmill.errors import GenerationError
from gristmill.outputs import RequestOutput

#: What the outputs of a request stream hold:
#: - "cumulative": every output holds all the text, tokens and logprobs so far, and
#:   `delta_text` what is new;
#: - "delta": only what is new since the previous output (`text` = `delta_text`);
#: - "final": one output, when the request finishes, with all of it (nothing is copied
#:   per step: for batch rows and whole HTTP responses).
OUTPUT_KINDS = ("cumulative", "delta", "final")


class RequestStream:
    """The outputs of one request (see `AsyncEngine.add_request`), on the event loop
    that made it.

    The engine pushes `RequestOutput` snapshots (the last one `finished`) or one
    exception, which the consumer's `async for` raises. `aclose()` hands the stream
    back to the engine, which aborts the request if it is unfinished.
    """

    def __init__(self, output: RequestOutput, child_ids: list[str], release: Callable[["RequestStream"], None],
                 max_buffered: int | None = None, output_kind: str = "cumulative"):
        #: The engine's view of the request; consumers read the pushed snapshots.
        self.output = output
        #: Engine request ids of its completions (one per `n`).
        self.child_ids = child_ids
        self._release = release
        #: Outputs that may wait unread (None: no limit); past it the stream fails.
        self.max_buffered = max_buffered
        #: What each pushed output holds (`OUTPUT_KINDS`).
        self.output_kind = output_kind
        #: Tokens of each completion handed out so far ("delta").
        self.sent = [0] * len(output.outputs)
        self.overflowed = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.output.prompt_token_ids

    def push(self, item: RequestOutput | BaseException) -> bool:
        """Queue an output (or the error that ends the stream). Returns True when this
        output found `max_buffered` others unread: the stream then ends with a
        GenerationError instead, and the caller aborts the request."""
        if self.overflowed:
            return False
        if (self.max_buffered is not None and not isinstance(item, BaseException)
                and self._queue.qsize() >= self.max_buffered):
            self.overflowed = True
            while not self._queue.empty():
                self._queue.get_nowait()
            item = GenerationError(
                f"the client read its stream too slowly: {self.max_buffered} outputs were waiting unread "
                f"(the server's --max-stream-buffer), so the request was aborted to free its resources; "
                f"read the stream as it arrives")
        try:
            self._queue.put_nowait(item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass
        return self.overflowed

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(self)
