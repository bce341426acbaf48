"""A loopback TCP proxy that a benchmark owns, to break the link between two services on purpose.

    proxy = FaultProxy(upstream_port).start()      # listens on 127.0.0.1:proxy.port
    proxy.mode = "delay"; proxy.delay_s = 0.3      # every chunk forwarded late
    proxy.mode = "blackhole"                       # connections stay open, nothing is forwarded
    proxy.reset_all()                              # every open connection ends with a TCP RST
    proxy.cut_answer_with = b"..."                  # once: the answer bearing these bytes is lost (below)
    proxy.hold_answer_with = b"..."                 # once: that answer's connection is held both ways
    proxy.mode = "pass"

It runs its own event loop on a thread, so a busy benchmark loop does not add delays of its own.
Loopback only: it listens on 127.0.0.1 and connects to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from dataclasses import dataclass, field

from common.startup import free_port

MODES = ("pass", "delay", "blackhole")


@dataclass
class FaultProxy:
    """Forwards 127.0.0.1:port to 127.0.0.1:upstream_port, with the fault of `mode`."""

    upstream_port: int
    port: int = field(default_factory=free_port)
    mode: str = "pass"
    delay_s: float = 0.2
    resets: int = 0            # connections ended with RST by reset_all()
    connections: int = 0       # accepted so far
    # Once: the first chunk from upstream that holds these bytes is dropped and the client's connection
    # ends with RST, while upstream's stays open (read and discarded): the server wrote its whole answer
    # and thinks it delivered; the client saw the link break. (Then the pattern is cleared.)
    cut_answer_with: bytes = b""
    answers_cut: int = 0
    # Once: the same, but the client's connection stays open too, nothing forwarded either way from then
    # on (a stalled link): the client waits for an answer that never comes, and what it sends on that
    # connection (a cancel, a Release) never arrives.
    hold_answer_with: bytes = b""
    answers_held: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _writers: set = field(default_factory=set)
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in list(self._writers):
                writer.close()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # upstream down: the client sees its connection closed, as a dead peer's
            writer.close()
            return
        self._writers.update((writer, up_writer))
        link = _Link()
        await asyncio.gather(self._pump(reader, up_writer, link), self._pump(up_reader, writer, link, True),
                             return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link,
                    answers: bool = False) -> None:
        try:
            while data := await reader.read(65536):
                if link.cut:
                    continue  # upstream's connection stays open; what it sends goes nowhere
                if answers and self.cut_answer_with and self.cut_answer_with in data:
                    self.cut_answer_with, link.cut = b"", True
                    self.answers_cut += 1
                    self._writers.discard(writer)
                    _abort(writer)
                    continue
                if answers and self.hold_answer_with and self.hold_answer_with in data:
                    self.hold_answer_with, link.cut = b"", True
                    self.answers_held += 1
                    continue
                while self.mode == "blackhole" and not writer.is_closing():
                    await asyncio.sleep(0.05)  # held: the peer sees a link that says nothing
                if self.mode == "delay":
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        finally:
            if not link.cut or answers:  # a cut link keeps upstream's side open until upstream closes it
                with contextlib.suppress(OSError, RuntimeError):
                    writer.close()

    def reset_all(self) -> int:
        """End every open connection with a TCP RST (SO_LINGER 0); returns how many were open."""
        done = threading.Event()
        count = [0]

        def reset() -> None:
            for writer in list(self._writers):
                _abort(writer)
                count[0] += 1
            self._writers.clear()
            done.set()

        self._loop.call_soon_threadsafe(reset)
        done.wait(10)
        self.resets += count[0]
        return count[0]

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


@dataclass
class _Link:
    """One proxied connection's state shared by its two directions."""

    cut: bool = False  # its answer was cut or held: nothing is forwarded, upstream's side is kept open


def _abort(writer: asyncio.StreamWriter) -> None:
    """End the connection with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
