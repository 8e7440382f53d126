"""Framing of the messages a client sends its engine core: each one pickled on its own,
behind the ids of the requests it carries, so a core that cannot unpickle one (a class
only the client's `__main__` defines, a mismatched install) still knows whose it was
and refuses that request instead of dropping it; and a message the client cannot
pickle ends only its own request, on the client's side."""

from __future__ import annotations

import pickle
import struct

from gristmill.engine.messages import request_ids_of
from gristmill.errors import error_string

_TAG_LENGTH = struct.Struct("<I")


class Unreadable(Exception):
    """A frame whose message could not be unpickled; `request_ids`: of the requests it
    carried (none for other messages)."""

    def __init__(self, request_ids: list[str], reason: str):
        super().__init__(reason)
        self.request_ids = request_ids
        self.reason = reason


def encode(message) -> bytes:
    """`message` as one frame (raises what pickle raises for an unpicklable message)."""
    request_ids = request_ids_of(message)
    tag = pickle.dumps([str(i) for i in request_ids], pickle.HIGHEST_PROTOCOL) if request_ids else b""
    return _TAG_LENGTH.pack(len(tag)) + tag + pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes):
    """The message of a frame; raises Unreadable."""
    try:
        (length,) = _TAG_LENGTH.unpack_from(frame)
        request_ids = pickle.loads(memoryview(frame)[4:4 + length]) if length else []
    except Exception as exc:  # noqa: BLE001 - a broken frame is unreadable, whatever broke it
        raise Unreadable([], error_string(exc)) from None
    try:
        return pickle.loads(memoryview(frame)[4 + length:])
    except Exception as exc:  # noqa: BLE001 - as above
        raise Unreadable(request_ids, error_string(exc)) from None
