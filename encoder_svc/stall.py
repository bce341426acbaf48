"""The encoder's watchdog: a vision tower that stops making progress makes the encoder exit, not hang.

A tower batch takes well under a second. A tower that owes work and takes no step for `--stall-exit`
seconds (a batch waiting on something that will never come: a device that stopped, a lost preparation;
or a tower thread that no longer takes batches) leaves every later image queued while the service still
answers cache hits and health checks; its decoders would hold their requests until their deadlines. So
the encoder logs every thread's Python stack (what it was waiting on), says NOT_SERVING and exits with
code 1: its decoders see it gone and fail over, retry or fail cleanly, and a supervisor restarts it.
Seen once on the H200 in a 96-client soak (docs/benchmarks/h200-2026-12-03f-*): the tower thread took
empty batches in a loop (fixed in worker.py); this is the net for what is not known yet.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger("mmserve.encoder")

STUCK_EXIT_CODE = 1


async def watch_tower(stalled_for_s: Callable[[], float], stall_exit_s: float,
                      on_stuck: Callable[[], None] | None = None,
                      exit_process: Callable[[int], None] = os._exit) -> None:
    """Check the tower every stall_exit_s / 4 seconds (at most 10); when it has owed work without a step
    for more than stall_exit_s (VisionWorker.stalled_for_s): log it with every thread's stack, call
    on_stuck (health NOT_SERVING), exit."""
    interval = min(10.0, stall_exit_s / 4)
    while True:
        await asyncio.sleep(interval)
        stalled = stalled_for_s()
        if stalled <= stall_exit_s:
            continue
        log.error("the vision tower has owed work for %.0f s without a step (--stall-exit %.0f s): the "
                  "encoder is stuck and exits so that its decoders fail over; every thread's stack follows",
                  stalled, stall_exit_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if on_stuck is not None:
            on_stuck()
        exit_process(STUCK_EXIT_CODE)  # not a clean stop: the stuck thread would hold it up
        return
