"""Runs the engine on its own thread beside the asyncio gRPC server.

The engine is single-threaded by design; every call into it (add, abort, step, stats) happens on the
loop thread. The server talks to it through `submit` (a future resolved with the engine's answer) and
receives each request's outputs on an asyncio queue, so the event loop never blocks on model compute.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from decoder_svc.engine.engine import EngineStats, LLMEngine, RequestOutput

log = logging.getLogger("mmserve.decoder.loop")

_IDLE_WAIT_S = 0.5      # nothing to do: sleep until a command arrives
_WAITING_POLL_S = 0.002  # requests wait on the encoder: poll again soon, without spinning a core


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, output in batch:
        q.put_nowait(output)


class EngineLoop:
    """The engine thread and its bridge to asyncio."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[RequestOutput], float], None]
                 | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._on_step = on_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.stats_snapshot: EngineStats = engine.stats()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))
        self._thread.join(timeout)

    # -- called from the asyncio side -----------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run fn(engine) on the engine thread; await its result (exceptions propagate)."""
        if self.error is not None:
            raise RuntimeError(f"engine loop died: {self.error}")
        fut: Future = Future()
        self._commands.put((lambda: fn(self.engine), fut))
        return asyncio.wrap_future(fut)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """The queue on which request_id's outputs will arrive (open it before adding the request)."""
        q: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    @property
    def num_open_streams(self) -> int:
        """Requests whose outputs someone still awaits."""
        with self._streams_lock:
            return len(self._streams)

    def fail_open_streams(self, message: str) -> None:
        """End every open stream with an error output (a drain that ran out of time)."""
        with self._streams_lock:
            streams = list(self._streams.items())
        for request_id, (loop, q) in streams:
            loop.call_soon_threadsafe(q.put_nowait, RequestOutput(request_id, [], "", error=message))

    def close_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    # -- the engine thread ----------------------------------------------------------------------
    def _run_commands(self, timeout: float) -> None:
        try:
            fn, fut = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    fut.set_exception(exc)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop per step, not one per output: each call_soon_threadsafe
        # writes to the loop's self-pipe, and the engine thread should get back to stepping.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                target = self._streams.get(output.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _run(self) -> None:
        engine = self.engine
        try:
            progressed = False
            while not self._stop.is_set():
                if not engine.has_unfinished():
                    timeout = _IDLE_WAIT_S
                else:  # a step that computed nothing waits on the encoder: don't spin a core on it
                    timeout = 0.0 if progressed else _WAITING_POLL_S
                self._run_commands(timeout)
                if not engine.has_unfinished():
                    progressed = False
                    continue
                started = time.perf_counter()
                outputs = engine.step()
                progressed = engine.last_step_num_tokens > 0 or bool(outputs)
                if outputs:
                    self._deliver(outputs)
                self.stats_snapshot = engine.stats()
                if self._on_step is not None:
                    self._on_step(engine, outputs, time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - report, then fail every open stream
            log.exception("engine loop died")
            self.error = exc
            with self._streams_lock:
                streams = list(self._streams.items())
            for request_id, (loop, q) in streams:
                failed = RequestOutput(request_id=request_id, new_token_ids=[], text="",
                                       error=f"engine failed: {type(exc).__name__}: {exc}")
                loop.call_soon_threadsafe(q.put_nowait, failed)
