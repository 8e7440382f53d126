"""Heartbeat: 8 bytes shared by the engine core and its client.

They hold the time (time.monotonic, the same clock in both processes) at which the
step running now started, or 0 between steps. The core writes; the client's monitor
reads, to tell a hung step from a long one. Backed by an unlinked temporary file whose
descriptor the core inherits.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time

_FORMAT = "d"
_SIZE = struct.calcsize(_FORMAT)


class Heartbeat:
    def __init__(self, fd: int):
        self.fd = fd
        self._map = mmap.mmap(fd, _SIZE)

    @classmethod
    def create(cls) -> "Heartbeat":
        fd, path = tempfile.mkstemp(prefix="gristmill-heartbeat-")
        os.unlink(path)
        os.ftruncate(fd, _SIZE)
        return cls(fd)

    def beat(self) -> None:
        """A step starts now."""
        struct.pack_into(_FORMAT, self._map, 0, time.monotonic())

    def rest(self) -> None:
        """No step is running."""
        struct.pack_into(_FORMAT, self._map, 0, 0.0)

    @property
    def step_started(self) -> float:
        """When the running step started (time.monotonic), or 0.0 between steps."""
        return struct.unpack_from(_FORMAT, self._map, 0)[0]

    def close(self) -> None:
        if not self._map.closed:
            self._map.close()
            os.close(self.fd)
