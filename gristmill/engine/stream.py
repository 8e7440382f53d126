"""RequestStream: one request's outputs, as an async iterator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gristmill.outputs import RequestOutput


class RequestStream:
    """The outputs of one request (see `AsyncEngine.add_request`), on the event loop
    that made it.

    The engine pushes `RequestOutput` snapshots (the last one `finished`) or one
    exception, which the consumer's `async for` raises. `aclose()` hands the stream
    back to the engine, which aborts the request if it is unfinished.
    """

    def __init__(self, output: RequestOutput, child_ids: list[str], release: Callable[["RequestStream"], None]):
        #: The engine's view of the request; consumers read the pushed snapshots.
        self.output = output
        #: Engine request ids of its completions (one per `n`).
        self.child_ids = child_ids
        self._release = release
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.output.prompt_token_ids

    def push(self, item: RequestOutput | BaseException) -> None:
        try:
            self._queue.put_nowait(item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass

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
