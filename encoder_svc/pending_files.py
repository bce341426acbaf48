"""Image files being decoded, by content hash: a hash-only ask for one waits for it, not NOT_FOUND.

A decoder's front end sends a new file ahead (a Prefetch with its bytes) as soon as its request arrives;
the decoder's engine asks for it by hash moments later, possibly while this encoder is still receiving or
decoding the file. Without this registry that ask would find no cache entry, answer NOT_FOUND, and the
decoder would send the same megabytes again (to be decoded twice). A file's content hash is the hash of
its bytes (common/hashing.py), known before any decoding: the file is registered under it from then until
its cache entry exists (or its decoding failed), and a hash-only ask waits for that moment, bounded.
An ask that says the file was sent ahead (`await_file_ms`) but finds it neither here nor cached waits,
bounded too, for it to arrive (`wait_arrival`): the small ask often overtakes the megabytes.

Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

Key = tuple[str, str]  # (cache salt, content hash)


class PendingFiles:
    """Files between 'bytes received' and 'cache entry made'."""

    def __init__(self) -> None:
        self._events: dict[Key, tuple[asyncio.Event, int]] = {}
        self._arrivals: dict[Key, tuple[asyncio.Event, int]] = {}  # awaited files: (event, waiters)

    def begin(self, keys: Iterable[Key]) -> list[Key]:
        """Register files about to be decoded; returns what to pass to `end`."""
        keys = list(keys)
        for key in keys:
            event, count = self._events.get(key, (None, 0))
            self._events[key] = (event or asyncio.Event(), count + 1)
            arrival = self._arrivals.get(key)
            if arrival is not None:
                arrival[0].set()
        return keys

    def end(self, keys: list[Key]) -> None:
        """The files' entries exist (or their decoding failed): wake their waiters. Idempotent per list:
        the list is emptied."""
        for key in keys:
            event, count = self._events.pop(key, (None, 0))
            if event is None:
                continue
            if count > 1:
                self._events[key] = (event, count - 1)
            else:
                event.set()
        keys.clear()

    async def wait(self, keys: Iterable[Key], timeout: float) -> None:
        """Return once none of keys is pending, or after timeout seconds in all."""
        events = [self._events[k][0] for k in keys if k in self._events]
        if events:
            try:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout)
            except TimeoutError:
                pass

    def is_pending(self, key: Key) -> bool:
        """True while a file with this key is being decoded here."""
        return key in self._events

    async def wait_arrival(self, keys: Iterable[Key], timeout: float) -> None:
        """Return once every one of keys has been registered by `begin` (a file with it arrived), or
        after timeout seconds in all."""
        keys = [k for k in keys if k not in self._events]
        events = []
        for key in keys:
            event, count = self._arrivals.get(key, (None, 0))
            event = event or asyncio.Event()
            self._arrivals[key] = (event, count + 1)
            events.append(event)
        try:
            if events:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout)
        except TimeoutError:
            pass
        finally:
            for key in keys:
                event, count = self._arrivals.pop(key)
                if count > 1:
                    self._arrivals[key] = (event, count - 1)

    def __len__(self) -> int:
        return len(self._events)
