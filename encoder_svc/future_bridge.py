"""Awaiting the vision worker's futures on the event loop, one wake-up per burst of completions.

`asyncio.wrap_future` wakes the loop once per future (a `call_soon_threadsafe`: a lock, a write to the
loop's self-pipe, a pass of the selector). The tower thread completes a whole batch at once, so the
bridge collects the futures that finish while a wake-up is already pending and settles them all in
that one callback: a batch of 32 images costs the loop one wake-up instead of 32.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading


class FutureBridge:
    """Makes asyncio futures on `loop` out of concurrent futures resolved in other threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._done: list[tuple[cf.Future, asyncio.Future]] = []

    def wrap(self, fut: cf.Future) -> asyncio.Future:
        """An asyncio future on the bridge's loop that settles like fut (cancelling it leaves fut be).
        Call on the loop's thread."""
        waiter = self.loop.create_future()

        def on_done(f: cf.Future) -> None:
            with self._lock:
                self._done.append((f, waiter))
                first = len(self._done) == 1
            if first:  # later completions ride on this wake-up until it runs
                try:
                    self.loop.call_soon_threadsafe(self._settle)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass

        fut.add_done_callback(on_done)
        return waiter

    def _settle(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for fut, waiter in done:
            if waiter.done():  # its awaiting task was cancelled
                continue
            if fut.cancelled():
                waiter.cancel()
            elif fut.exception() is not None:
                waiter.set_exception(fut.exception())
            else:
                waiter.set_result(fut.result())
