"""Reading the engine core's pipe one whole message per system call.

`multiprocessing.Connection.recv` reads a message in pieces of what the socket buffer holds (~200 KiB),
taking the GIL back after each: a reader thread receiving a request's megabytes of image files while the
process's main thread runs Python (the engine's step, the front end's event loop) waits up to the switch
interval for every piece. `MessageReader` asks the kernel for all of a message's bytes at once
(`MSG_WAITALL`), with the GIL released throughout (BENCHMARKS.md has the two readers' times).

The wire format is the Connection's own (a 4-byte big-endian length, or -1 and an 8-byte length, then
the pickle), so the other end sends with `Connection.send` as before.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from multiprocessing.connection import Connection
from typing import Any


class MessageReader:
    """Receives the pickled messages of one Connection (a socketpair, as `Pipe()` makes on Linux); for
    a connection that is not a socket it reads through `Connection.recv`."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        try:
            self._sock: socket.socket | None = socket.socket(fileno=os.dup(conn.fileno()))
        except OSError:  # an os.pipe: no recv flags
            self._sock = None

    def recv(self) -> Any:
        """The next message; EOFError when the other end is gone."""
        if self._sock is None:
            return self._conn.recv()
        (size,) = struct.unpack("!i", self._read(4))
        if size == -1:
            (size,) = struct.unpack("!Q", self._read(8))
        return pickle.loads(self._read(size))

    def _read(self, size: int) -> bytearray:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:  # MSG_WAITALL returns short only on a signal or at EOF
            n = self._sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
            if n == 0:
                raise EOFError("the other end of the pipe is gone")
            got += n
        return buf

    def close(self) -> None:
        """Close this reader's descriptor (the Connection stays open)."""
        if self._sock is not None:
            self._sock.close()
