"""Fake stubs' methods as gRPC's: called in place, or started with `.future` (the remote source keeps an
Encode open as a future while it asks whether a slow encoder is alive)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, TimeoutError

import grpc


class ThreadCall:
    """The grpc.Future of a synchronous fake call, run on a thread of its own as gRPC runs a real one."""

    def __init__(self, fn: Callable, *args, **kwargs) -> None:
        self._future: Future = Future()
        # Named after the caller's thread: fakes tell the source's fetch and prefetch threads apart by it.
        threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True,
                         name=f"{threading.current_thread().name}-call").start()

    def _run(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        try:
            self._future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            self._future.set_exception(exc)

    def result(self, timeout: float | None = None):
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise grpc.FutureTimeoutError() from None

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return False  # a fake call runs to its end (its waits are bounded)

    def cancelled(self) -> bool:
        return False

    def exception(self, timeout: float | None = None):
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable) -> None:
        """fn(this call) once it ends (at once when it has), as gRPC calls it."""
        self._future.add_done_callback(lambda _: fn(self))


class FakeMethod:
    """A fake stub's method in gRPC's shape: `method(request, ...)` or `method.future(request, ...)`."""

    def __init__(self, fn: Callable) -> None:
        self._fn = fn

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def future(self, *args, **kwargs) -> ThreadCall:
        return ThreadCall(self._fn, *args, **kwargs)
