"""Which transports the decoder asks each encoder for: its own readable ones, less those whose refs from
that encoder this process could not open lately (an SHM segment or GPU on another host, container or
Pod), and what to ask for instead of such a ref."""

from __future__ import annotations

import logging
import threading
import time

from common.pb import common_pb2

log = logging.getLogger("mmserve.decoder.encoders")

# An encoder whose SHM segment or GPU this process cannot open is not offered that transport again for
# this long: each ask would cost a second Encode. It is offered again afterwards, in case the encoder at
# that address has moved.
UNREADABLE_TTL_S = 300.0
LOCATION_TRANSPORTS = {"shm": common_pb2.TRANSPORT_SHM, "cuda_ipc": common_pb2.TRANSPORT_CUDA_IPC,
                       "nixl": common_pb2.TRANSPORT_NIXL}


class TransportChoice:
    """The transports to accept from each encoder, best first; thread-safe."""

    def __init__(self, accept: list[int]) -> None:
        self.accept = accept
        self._lock = threading.Lock()
        # encoder -> (transports whose refs this process could not open, until when)
        self._unreadable: dict[str, tuple[frozenset[int], float]] = {}

    def accept_for(self, encoder: str) -> list[int]:
        """The transports to ask `encoder` for, best first: ours, less those whose refs from it this
        process could not open lately."""
        with self._lock:
            entry = self._unreadable.get(encoder)
            if entry is not None and entry[1] <= time.monotonic():
                del self._unreadable[encoder]
                entry = None
        if entry is None:
            return self.accept
        return [t for t in self.accept if t not in entry[0]]

    def note_unreadable(self, encoder: str, ref: common_pb2.EmbeddingRef) -> None:
        """Remember for UNREADABLE_TTL_S that `encoder`'s refs of ref's kind cannot be opened here."""
        transport = LOCATION_TRANSPORTS.get(ref.WhichOneof("location") or "")
        if transport is None:
            return
        with self._lock:
            known, _ = self._unreadable.get(encoder, (frozenset(), 0.0))
            self._unreadable[encoder] = (known | {transport}, time.monotonic() + UNREADABLE_TTL_S)
        log.info("encoder %s offers a %s location this process cannot open: not asked for it for %.0f s",
                 encoder, ref.WhichOneof("location"), UNREADABLE_TTL_S)

    def across_hosts(self, ref: common_pb2.EmbeddingRef) -> list[int]:
        """What to ask for instead of a ref this process cannot open: NIXL (if accepted and not what
        failed) and inline."""
        nixl = [common_pb2.TRANSPORT_NIXL] if (common_pb2.TRANSPORT_NIXL in self.accept
                                               and ref.WhichOneof("location") != "nixl") else []
        return [*nixl, common_pb2.TRANSPORT_INLINE]
