"""Framing of the messages a client sends its engine core: each one pickled on its own,
behind the id of the request it carries, so a core that cannot unpickle one (a class
only the client's `__main__` defines, a mismatched install) still knows whose it was
and refuses that request instead of dropping it; and a message the client cannot
pickle ends only its own request, on the client's side."""

from __future__ import annotations

import pickle
import struct

from gristmill.errors import error_string

_TAG_LENGTH = struct.Struct("<I")


class Unreadable(Exception):
    """A frame whose message could not be unpickled; `request_id` when it carried one."""

    def __init__(self, request_id: str | None, reason: str):
        super().__init__(reason)
        self.request_id = request_id
        self.reason = reason


def encode(message) -> bytes:
    """`message` as one frame (raises what pickle raises for an unpicklable message)."""
    request_id = getattr(message, "request_id", None)
    tag = request_id.encode("utf-8", "surrogatepass") if isinstance(request_id, str) else b""
    return _TAG_LENGTH.pack(len(tag)) + tag + pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes):
    """The message of a frame; raises Unreadable."""
    try:
        (length,) = _TAG_LENGTH.unpack_from(frame)
        request_id = bytes(frame[4:4 + length]).decode("utf-8", "surrogatepass") if length else None
    except Exception as exc:  # noqa: BLE001 - a broken frame is unreadable, whatever broke it
        raise Unreadable(None, error_string(exc)) from None
    try:
        return pickle.loads(memoryview(frame)[4 + length:])
    except Exception as exc:  # noqa: BLE001 - as above
        raise Unreadable(request_id, error_string(exc)) from None
