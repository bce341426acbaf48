"""uvicorn's h11 protocol with a request-header deadline (slowloris).

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection that sends
half a request head is kept forever: thousands of them hold the server's connection slots and file
descriptors. Here a connection that has not completed a request head within `header_timeout_s` of its
first byte (or of its opening) is closed. The body's deadline is the app's (gateway/admission.py); the
connection cap is uvicorn's `limit_concurrency`.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request head takes longer than header_timeout_s."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a head still incomplete (or a new one started)
            self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if self.conn.their_state is h11.IDLE and not busy and not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn's `http=` setting, with this header deadline."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"header_timeout_s": header_timeout_s})
