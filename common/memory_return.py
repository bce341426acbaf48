"""Giving memory back after bursts of requests of a few megabytes each (issue 67's cache flood of 7 MB
data URLs; the figures: RELIABILITY.md, "Faults under load", and bench/experiments/flood_rss.py).

What such requests leave behind is mostly free memory glibc keeps in its arenas (common/freed_memory.py)
and some garbage in reference cycles (a failed request's exception, its traceback and the frames that
held the request's bytes), which only a full collection frees. A trim per request of 16 MiB or more
never runs for them, so the bytes add up here: a trim is due once `every` of them were let go since the
last one, and when a burst is over (nothing held) with at least `idle_min` let go, then after a full
collection, so that the cycles' bytes go too. The collection waits for the end of a burst because it
pauses the event loop (as Python's own full collections do, at times of their choosing).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from dataclasses import dataclass, field

from common.freed_memory import release_freed_memory

TRIM_EVERY_BYTES = 16 << 20
TRIM_IDLE_BYTES = 4 << 20
# After the request's handler has returned and its objects are garbage: a moment later, not at once.
TRIM_DELAY_S = 1.0


@dataclass
class MemoryReturn:
    """Counts the bytes requests let go and gives memory back (on the running event loop, `delay_s`
    later, at most one pending at a time) when that is due. `trims` and `collections` count what ran."""

    every: int = TRIM_EVERY_BYTES
    idle_min: int = TRIM_IDLE_BYTES
    delay_s: float = TRIM_DELAY_S
    trim: Callable[[], bool] = release_freed_memory
    since_trim: int = 0
    trims: int = 0
    collections: int = 0
    _pending: asyncio.TimerHandle | None = field(default=None, repr=False)
    _collect: bool = False

    def freed(self, nbytes: int, idle: bool) -> bool:
        """nbytes of a request's inputs were let go; `idle`: none of its kind is held any more (the burst
        is over). True when that made a trim due (scheduled: nothing happens without a running loop)."""
        self.since_trim += nbytes
        if self.since_trim >= self.every:
            due, collect = True, idle
        elif idle and self.since_trim >= self.idle_min:
            due, collect = True, True
        else:
            return False
        self.since_trim = 0
        self.soon(collect)
        return due

    def soon(self, collect: bool = False) -> None:
        """Trim `delay_s` from now (after a full collection when `collect`), unless one is pending (it
        then collects too when asked)."""
        self._collect |= collect
        if self._pending is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test of something else): nothing to give back then
            return
        self._pending = loop.call_later(self.delay_s, self._run)

    def _run(self) -> None:
        collect, self._collect, self._pending = self._collect, False, None
        if collect:
            gc.collect()
            self.collections += 1
        if self.trim():
            self.trims += 1
