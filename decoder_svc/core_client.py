"""The front end's side of the engine core (engine_core.py): start it, call it, receive its outputs.

The core runs in a child process; this client owns the pipe to it and speaks core_protocol.py. Calls
(`add`, `abort`, `stats`) are awaited from asyncio; a sender thread writes them, so a large request
(image bytes) never blocks the event loop. A reader thread receives each step's outputs and hands them
to the streams' asyncio queues, one event-loop wake-up per step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from typing import Any

from common.client import new_lease_owner
from common.errors import UnavailableError
from common.security.options import ClientSecurity
from decoder_svc import core_protocol as msg
from decoder_svc.config import DecoderConfig
from decoder_svc.core_pipe import MessageReader
from decoder_svc.engine.following_bytes import detach_files
from decoder_svc.engine.output_processor import RequestOutput
from decoder_svc.engine.request import Request
from decoder_svc.engine_core import run_core
from decoder_svc.stats import DecoderStats

log = logging.getLogger("mmserve.decoder.core_client")

_START_POLL_S = 0.5


class CoreStartError(RuntimeError):
    """The core could not start (the message says why)."""


class CoreUsageError(CoreStartError):
    """The core refused its options (e.g. a KV cache too small for one request)."""


class CoreDeadError(UnavailableError):
    """The core is gone; no call can be answered."""


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, output in batch:
        q.put_nowait(output)


class EngineCoreClient:
    """Starts the engine core process and bridges it to asyncio."""

    def __init__(self, config: DecoderConfig, encoder_link: ClientSecurity | None = None,
                 on_step: Callable[[list[RequestOutput], float], None] | None = None) -> None:
        """A client of a core (not started yet) that runs `config` and reaches the encoders with
        `encoder_link`'s TLS and token; `on_step(outputs, seconds)` is called on the reader thread after
        each step that produced outputs."""
        self._on_step = on_step
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked; a clean interpreter
        self._conn, child_conn = ctx.Pipe()
        link = encoder_link or ClientSecurity()
        # The core's leases are taken for this secret: a core killed at shutdown cannot give them back,
        # the front end can (by request: FrontEndLink.release_requests). Never logged.
        self.lease_owner = new_lease_owner()
        self._process = ctx.Process(target=run_core, args=(child_conn, config, link, self.lease_owner),
                                    name="engine-core", daemon=True)
        self._child_conn = child_conn
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._outbox: queue.SimpleQueue[msg.CoreCall | msg.Close | None] = queue.SimpleQueue()
        self._stopping = False
        self.error: str | None = None
        self.info: msg.CoreInfo | None = None

    # -- life ------------------------------------------------------------------------------------
    def start(self) -> msg.CoreInfo:
        """Start the core and wait (blocking) until it is loaded and warm; raises CoreStartError."""
        self._process.start()
        self._child_conn.close()  # ours is the only other end: EOF when the core exits
        while not self._conn.poll(_START_POLL_S):
            if not self._process.is_alive():
                raise CoreStartError(f"the engine core exited with code {self._process.exitcode} "
                                     "before it was ready (its log is above)")
        message = self._conn.recv()
        if isinstance(message, msg.StartRefused):
            raise CoreUsageError(message.message)
        if not isinstance(message, msg.Ready):
            raise CoreStartError(f"the engine core could not start:\n{message.traceback}")
        self.info = message.info
        threading.Thread(target=self._read, name="core-reader", daemon=True).start()
        threading.Thread(target=self._send, name="core-sender", daemon=True).start()
        return message.info

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the core to close and wait for it; kill it if it does not go."""
        self._stopping = True
        self._outbox.put(msg.Close())
        self._outbox.put(None)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("engine core did not stop within %.0f s: killing it", timeout)
            self._process.kill()
            self._process.join(5)

    # -- calls -----------------------------------------------------------------------------------
    async def _call(self, make: Callable[[int], msg.CoreCall], then: tuple = ()) -> Any:
        """Send make(token), then the messages `then`, to the core and return its answer (its exception is
        raised here)."""
        if self.error is not None:
            raise CoreDeadError(f"engine core died: {self.error}")
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self._calls[token] = (asyncio.get_running_loop(), future)
        self._outbox.put(make(token))
        for message in then:
            self._outbox.put(message)
        return await future

    async def add(self, request: Request) -> None:
        """Queue a Request made by the InputProcessor (it is the core's now: its image files leave it and
        follow it in a message of their own, engine/following_bytes.py)."""
        files = detach_files(request.images)
        follow = (msg.ImageBytes(request.request_id, files),) if files else ()
        await self._call(lambda token: msg.AddRequest(token, request), follow)

    async def abort(self, request_id: str) -> bool:
        """Stop a request; its ABORT output follows on its stream."""
        return await self._call(lambda token: msg.AbortRequest(token, request_id))

    async def stats(self) -> DecoderStats:
        """The engine's and the embedding source's counters."""
        return await self._call(msg.GetStats)

    # -- streams ---------------------------------------------------------------------------------
    def open_stream(self, request_id: str) -> asyncio.Queue:
        """The queue on which request_id's outputs will arrive (open it before adding the request)."""
        q: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        """Stop delivering request_id's outputs."""
        with self._streams_lock:
            self._streams.pop(request_id, None)

    def open_stream_ids(self) -> list[str]:
        """The ids of the requests whose outputs someone still awaits."""
        with self._streams_lock:
            return list(self._streams)

    @property
    def num_open_streams(self) -> int:
        """Requests whose outputs someone still awaits."""
        with self._streams_lock:
            return len(self._streams)

    def fail_open_streams(self, message: str) -> None:
        """End every open stream with an error output."""
        with self._streams_lock:
            streams = list(self._streams.items())
        for request_id, (loop, q) in streams:
            loop.call_soon_threadsafe(q.put_nowait, RequestOutput(request_id, [], "", error=message))

    # -- threads ---------------------------------------------------------------------------------
    def _send(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:  # the core is gone: the reader reports it
                token = getattr(message, "token", None)  # Close and ImageBytes have no caller waiting
                if token is not None:
                    self._answer(token, False, CoreDeadError(f"engine core unreachable: {exc}"))

    def _answer(self, token: int, ok: bool, value: Any) -> None:
        entry = self._calls.pop(token, None)
        if entry is None:
            return
        loop, future = entry

        def settle() -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        loop.call_soon_threadsafe(settle)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop per step, not one per output.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                target = self._streams.get(output.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _read(self) -> None:
        reason = "the engine core exited"
        reader = MessageReader(self._conn)
        try:
            while True:
                message = reader.recv()
                if isinstance(message, msg.StepOutputs):
                    self._deliver(message.outputs)
                    if self._on_step is not None:
                        self._on_step(message.outputs, message.step_seconds)
                elif isinstance(message, msg.Reply):
                    self._answer(message.token, message.ok, message.value)
                elif isinstance(message, msg.Died):
                    reason = message.message
                    break
        except (EOFError, OSError):
            if self._stopping:
                return
            self._process.join(5)
            reason = f"the engine core exited with code {self._process.exitcode}"
        finally:
            reader.close()
        self.error = reason
        log.error("engine core failed: %s", reason)
        self.fail_open_streams(f"engine failed: {reason}")
        for token in list(self._calls):
            self._answer(token, False, CoreDeadError(f"engine core died: {reason}"))
