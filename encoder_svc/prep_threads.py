"""Threads that run images' host-side preprocessing, fed from the event loop at the least cost to it.

`concurrent.futures.ThreadPoolExecutor` was measured doing worse here: each `submit` takes the pool's
idle-semaphore lock, which its busy threads take too, and under load the event loop waited on it
(`_adjust_thread_count` in the loop's profile, BENCHMARKS.md). Here a submit is one
`SimpleQueue.put` (C, never blocks) and each task's completion is one lock that its waiter acquires.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

from common.thread_names import set_native_thread_name

log = logging.getLogger(__name__)


def lower_thread_priority(niceness: int) -> None:
    """Raise the calling thread's nice value by `niceness` (Linux schedules threads one by one; threads it
    starts inherit the value): the OS then runs it only when other work leaves a core. Best effort."""
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + niceness)
    except OSError as exc:  # never fatal: the work runs at the usual priority
        log.info("could not lower a thread's priority: %s", exc)


class PrepTask:
    """One call run on a prep thread: `result()` waits for it and returns its value (or raises its
    exception). It may be queued on several pools (a queued lookahead image needed now joins the demand
    pool too): the first thread to take it runs it, the others skip it."""

    __slots__ = ("_fn", "_arg", "_claim", "_done", "_value", "_error")

    def __init__(self, fn: Callable[[Any], Any], arg: Any) -> None:
        self._fn, self._arg = fn, arg
        self._claim = threading.Lock()  # taken (never given back) by the thread that runs the task
        self._done = threading.Lock()
        self._done.acquire()  # released (once) when the task has run: result() waits on it
        self._value: Any = None
        self._error: BaseException | None = None

    def started(self) -> bool:
        """Whether a thread has taken the task (it may still be running)."""
        return self._claim.locked()

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):  # taken from another queue already
            return
        try:
            self._value = self._fn(self._arg)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            self._error = exc
        finally:
            self._fn = self._arg = None
            self._done.release()

    def done(self) -> bool:
        """Whether the task has run (or failed)."""
        if self._done.acquire(blocking=False):
            self._done.release()
            return True
        return False

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("the prep task did not finish in time")
        self._done.release()  # for any other waiter
        if self._error is not None:
            raise self._error
        return self._value


class PrepThreads:
    """`threads` daemon threads named `name` running submitted tasks in order of submission, calling
    after_task() when each has ended (its result ready); `niceness` above 0 lowers the threads' OS
    priority by that much (lower_thread_priority)."""

    def __init__(self, threads: int, name: str, after_task: Callable[[], None] | None = None,
                 niceness: int = 0) -> None:
        self._after_task = after_task
        self._niceness = niceness
        self._queue: SimpleQueue[PrepTask | None] = SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", args=(name,), daemon=True)
                         for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> PrepTask:
        """Queue fn(arg); the returned task gives its result."""
        task = PrepTask(fn, arg)
        self._queue.put(task)
        return task

    def take_over(self, task: PrepTask) -> None:
        """Queue a task of another pool here too, unless a thread has taken it: whichever pool reaches
        it first runs it."""
        if not task.started():
            self._queue.put(task)

    def shutdown(self) -> None:
        """Let the threads run every task queued before this call, then exit (without waiting for them:
        a task's own cleanup, such as giving a decode slot back, still happens)."""
        for _ in self._threads:
            self._queue.put(None)

    def _run(self, name: str) -> None:
        set_native_thread_name(name)
        lower_thread_priority(self._niceness)
        while (task := self._queue.get()) is not None:
            task.run()
            task = None  # hold no finished task (its value: a prepared input) while waiting for the next
            if self._after_task is not None:
                self._after_task()
