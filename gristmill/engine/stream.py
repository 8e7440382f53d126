"""RequestStream: one request's outputs, as an async iterator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gristmill.errors import GenerationError
from gristmill.outputs import RequestOutput


class RequestStream:
    """The outputs of one request (see `AsyncEngine.add_request`), on the event loop
    that made it.

    The engine pushes `RequestOutput`s (by the request's output kind, the last one
    `finished`) or one exception, which the consumer's `async for` raises. `aclose()`
    hands the stream back to the engine, which aborts the request if it is unfinished;
    so does dropping the last reference to it (the engine holds streams weakly).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], release: Callable[[str, int], None],
                 max_buffered: int | None = None, serial: int = 0):
        self.request_id = request_id
        #: Tells this stream from a later one under the same request id.
        self.serial = serial
        self.prompt_token_ids = prompt_token_ids
        self._release = release
        #: Outputs that may wait unread (None: no limit); past it the stream fails.
        self.max_buffered = max_buffered
        self.overflowed = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._closed = False

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
            self._release(self.request_id, self.serial)
