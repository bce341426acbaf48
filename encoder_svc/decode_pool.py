"""The pool of image-decode processes (decode_child.py) that runs `decode_and_hash` (decoded_image.py)
off the server's interpreter.

Every Encode that carries image bytes needs them decoded (Pillow), made RGB and hashed (the cache key)
before the cache can be asked. That is host work of the order of a millisecond per image, much of it
holding the GIL (Pillow's chunked decode loop, `tobytes`, the copies), so in threads it shares one interpreter
with gRPC, the cache and the vision worker. A pool of spawned processes does it off the server's
interpreter.

The pool is driven from the server's event loop, with no threads of its own: a `ProcessPoolExecutor`
costs the server as much CPU per image in its management and queue-feeder threads and their hand-offs
as gRPC itself (BENCHMARKS.md). Here each child has one socket pair; the
loop writes a small job message to it and reads the child's reply in a reader callback. The image
travels through a shared-memory slot both ways: the loop copies the file bytes into a free slot, the
child decodes them and writes the RGB pixels back into the same slot. The server takes the pixels in
place (`in_slot=True`) and the vision worker frees the slot once its preprocessing has copied them;
other callers get a copy. Slots are as large as /dev/shm allows (8 MiB down to 1 MiB); pixels larger
than a slot come back in the reply itself, and a file larger than a slot is decoded in a thread. With
every slot taken, a request waits for one (the pool's backpressure).

A child that dies (a crash in a decoder library, the OOM killer) is noticed at once (its socket
closes) and replaced. Its images in flight are tried once more on the other processes; one that kills
a second process fails with `DecodeWorkerDied` (UNAVAILABLE to its caller), so an image that crashes
the decoder costs two restarts at most and never hangs. Children exit when the server dies. Children
that die while starting, three in a row (a broken environment), are not respawned: the pool then
decodes in threads, and says so in the log and in the `decode_processes` stat.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from common.errors import UnavailableError
from common.images import ImageLimits
from encoder_svc.decode_child import (
    DECODE,
    DECODED,
    FRAME,
    PICKLED,
    READ_BYTES,
    child_main,
    decode_job,
)
from encoder_svc.decoded_image import DecodedImage, decode_and_hash

log = logging.getLogger(__name__)


class DecodeWorkerDied(UnavailableError):
    """A decode process died while it held this image (its caller may retry)."""



class _SlotLease:
    """One slot held for a DecodedImage's pixels: given back once, by release() or when collected."""

    def __init__(self, pool: DecodePool, slot: int) -> None:
        self._finalizer = weakref.finalize(self, pool._give_slot, slot)
        self._finalizer.atexit = False

    def release(self) -> None:
        self._finalizer()  # runs at most once


@dataclass(eq=False)
class _Job:
    fn: object  # None for a decode (args: fingerprint, salt; the file bytes are in `data`)
    args: tuple
    future: asyncio.Future
    slot: int | None = None
    data: bytes = b""  # a decode's file bytes: copied into the slot again for a retry
    retries_left: int = 0
    sent_to: _Child | None = None
    in_slot: bool = False  # a decode whose caller takes the pixels in their slot


@dataclass(eq=False)
class _Child:
    process: multiprocessing.process.BaseProcess
    conn: object  # multiprocessing.connection.Connection
    jobs: dict[int, _Job] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop | None = None  # the loop its reader is registered on
    ready: bool = False
    inbox: bytearray = field(default_factory=bytearray)  # reply bytes read, not yet a whole frame


# Slot sizes tried, largest first: 8 MiB holds a 1080p image's pixels (6.2 MB). Pixels that do not fit
# come back through the socket and cost the event loop several times more (BENCHMARKS.md). Pages of
# /dev/shm are only used once written.
SLOT_SIZES = (8 << 20, 4 << 20, 2 << 20, 1 << 20)


def _default_slot_bytes(slots: int) -> int:
    """The largest slot size whose segment takes at most half of the free /dev/shm (1 MiB at least)."""
    from common.transport.shm import shm_available, shm_free_bytes

    free = shm_free_bytes() if shm_available() else 0
    return next((size for size in SLOT_SIZES if slots * size <= free // 2), SLOT_SIZES[-1])


MAX_STARTUP_FAILURES = 3  # children dead before ready, in a row, before the pool falls back to threads


class DecodePool:
    """`decode_and_hash` in `processes` spawned worker processes, each replaced if it dies.

    File bytes and pixels go through `slots` shared-memory slots of `slot_bytes` each (see the module
    docstring for what does not fit). Use it from one event loop at a time; `start` and `close` may be
    called from any thread.
    """

    child_main = staticmethod(child_main)  # what each process runs (tests substitute a broken one)

    def __init__(self, processes: int, limits: ImageLimits = ImageLimits(), slot_bytes: int | None = None,
                 slots: int | None = None) -> None:
        if processes < 1:
            raise ValueError(f"a decode pool needs at least one process, not {processes}")
        self.processes = processes
        self.limits = limits
        self.slots = 4 * processes if slots is None else slots
        slot_bytes = _default_slot_bytes(self.slots) if slot_bytes is None else slot_bytes
        self.slot_bytes = slot_bytes
        self.restarts = 0
        self.disabled = False  # set when children keep dying while starting: decode in threads then
        self._startup_failures = 0
        self._ids = itertools.count()
        self._children: list[_Child] = []
        self._closed = False
        self._lock = threading.Lock()  # start() and close() may come from other threads
        self._waiting: deque[asyncio.Future] = deque()  # decodes waiting for a free slot
        self._slot_lock = threading.RLock()  # re-entrant: see _take_slot
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the pool is used from
        self.segment = None
        self._free: list[int] = []
        if self.slots and slot_bytes:
            from common.transport.shm import ShmArena, shm_available

            try:
                if shm_available():
                    self.segment = ShmArena(self.slots * slot_bytes)  # swept like the arena if we die
                    self._slot_path = str(self.segment.path)
                    self._buffer = self.segment.view(0, self.segment.capacity).numpy()
                    self._free = list(range(self.slots))
            except (MemoryError, OSError) as exc:
                log.info("no shared memory for image slots (%s): images are decoded in threads", exc)

    # -- processes ---------------------------------------------------------------------------------

    def _spawn(self) -> _Child:
        # spawn, not fork: the server has gRPC, torch and CUDA threads that a fork would copy half-way.
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(target=self.child_main, args=(theirs, os.getpid(), self.limits),
                              name="image-decode", daemon=True)
        process.start()
        theirs.close()  # the child's end lives in the child only: its death closes the socket
        return _Child(process, ours)

    def _ensure_children(self) -> None:
        with self._lock:
            if self._closed:
                raise DecodeWorkerDied("the image decode pool is closed")
            while len(self._children) < self.processes and not self.disabled:
                self._children.append(self._spawn())

    @property
    def pids(self) -> list[int]:
        """The decode processes' pids."""
        return [c.process.pid for c in self._children]

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every process and wait until each has imported Pillow and blake3 (not on a request's
        time). Safe from any thread before the pool is used from an event loop."""
        deadline = time.monotonic() + timeout_s
        while not self.disabled and time.monotonic() < deadline:
            self._ensure_children()
            starting = [c for c in self._children if c.loop is None and not c.ready]
            if not starting:
                return
            child = starting[0]
            try:
                if child.conn.poll(max(0.0, deadline - time.monotonic())):
                    child.conn.recv_bytes()  # ("ready", pid): the child's first frame
                    child.ready = True
            except (EOFError, OSError):  # it died starting: replaced (or the pool gives up)
                self._replace(child)

    def listen(self) -> None:
        """Read the processes' replies on the running event loop from now on, so that a process that dies
        while idle is replaced at once (otherwise the first decode does this)."""
        self._ensure_children()
        self._bind(asyncio.get_running_loop())

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read every child's replies on loop (tests run one pool under several loops in turn)."""
        self._loop = loop
        for child in self._children:
            if child.loop is loop:
                continue
            if child.loop is not None and not child.loop.is_closed():
                child.loop.remove_reader(child.conn.fileno())
            loop.add_reader(child.conn.fileno(), self._on_readable, child)
            child.loop = loop

    def _replace(self, dead: _Child) -> None:
        """A child died: replace it, and retry its jobs elsewhere (once) or fail them."""
        if dead.loop is not None and not dead.loop.is_closed():
            dead.loop.remove_reader(dead.conn.fileno())
        dead.conn.close()
        dead.process.join(timeout=0.1)  # reaped (for its exit code): its socket closed, it is gone
        with self._lock:
            if dead not in self._children:
                return
            self._children.remove(dead)
            # Children that die before they are ready (a broken environment) would be respawned forever.
            self._startup_failures = 0 if dead.ready else self._startup_failures + 1
            if self._startup_failures >= MAX_STARTUP_FAILURES and not self.disabled:
                self.disabled = True
                log.error("image decode processes died %d times in a row while starting (exit code %s): "
                          "images are decoded in the server's threads from now on",
                          self._startup_failures, dead.process.exitcode)
            if not self._closed and not self.disabled:
                self._children.append(self._spawn())
                self.restarts += 1
                log.warning("an image decode process died (exit code %s): replaced (%d restarts)",
                            dead.process.exitcode, self.restarts)
        if dead.loop is not None and not dead.loop.is_closed():
            self._bind(dead.loop)
        for job in dead.jobs.values():
            if job.retries_left > 0 and not job.future.done() and not self._closed and self._children:
                job.retries_left -= 1
                self._send(job)
            else:
                self._finish(job, None, DecodeWorkerDied(
                    "an image decode process died while decoding this image (the process was "
                    "replaced); retry the request"))
        dead.jobs.clear()

    # -- jobs --------------------------------------------------------------------------------------

    def _send(self, job: _Job) -> None:
        if job.slot is not None:  # (again, for a retry: the dead child may have written pixels over it)
            self._slot(job.slot, len(job.data))[:] = np.frombuffer(job.data, dtype=np.uint8)
        if not self._children:  # the pool gave up on its processes (see _replace)
            self._finish(job, None, DecodeWorkerDied("the image decode processes could not start"))
            return
        child = min(self._children, key=lambda c: len(c.jobs))
        job_id = next(self._ids)
        child.jobs[job_id] = job
        job.sent_to = child
        if job.fn is None:
            payload = decode_job(job_id, job.slot * self.slot_bytes, len(job.data), self.slot_bytes,
                                  *job.args, self._slot_path)
        else:
            payload = PICKLED + pickle.dumps((job_id, job.fn, job.args))
        frame = memoryview(FRAME.pack(len(payload)) + payload)
        try:
            while frame:  # a job frame is small: the socket takes it at once
                frame = frame[os.write(child.conn.fileno(), frame):]
        except OSError:  # it died just now: its reader sees the closed socket and handles its jobs
            pass

    def _on_readable(self, child: _Child) -> None:
        """Every reply the child has sent so far: one read, then each whole frame in it."""
        try:
            data = os.read(child.conn.fileno(), READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the socket closed: the child is gone
            self._replace(child)
            return
        inbox = child.inbox
        inbox += data
        at = 0
        while len(inbox) - at >= FRAME.size:
            (size,) = FRAME.unpack_from(inbox, at)
            if len(inbox) - at - FRAME.size < size:
                break
            payload = bytes(inbox[at + FRAME.size:at + FRAME.size + size])
            at += FRAME.size + size
            self._on_reply(child, payload)
        del inbox[:at]

    def _on_reply(self, child: _Child, payload: bytes) -> None:
        if payload[:1] == DECODE:
            job_id, width, height, digest = DECODED.unpack_from(payload, 1)
            ok, value = True, DecodedImage(digest.decode(), width, height, b"")
        else:
            reply = pickle.loads(payload[1:])
            if reply[0] == "ready":
                child.ready = True
                return
            job_id, ok, value = reply
        job = child.jobs.pop(job_id, None)
        if job is not None:
            self._finish(job, value if ok else None, None if ok else value)

    def _finish(self, job: _Job, value, error: BaseException | None) -> None:
        """Settle a job's future (unless its caller gave up) and free its slot."""
        if error is None and job.slot is not None and isinstance(value, DecodedImage) and not value.pixels:
            pixels = self._slot(job.slot, 3 * value.width * value.height)
            if job.in_slot and not job.future.done():  # the caller reads them there, then releases
                value = DecodedImage(value.content_hash, value.width, value.height,
                                     memoryview(pixels), _SlotLease(self, job.slot))
                job.slot = None
            else:  # copied out before the slot is reused
                value = DecodedImage(value.content_hash, value.width, value.height, pixels.tobytes())
        if job.slot is not None:
            self._give_slot(job.slot)
            job.slot = None
        if job.future.done() or job.future.get_loop().is_closed():
            return
        if error is None:
            job.future.set_result(value)
        else:
            job.future.set_exception(error)

    def _slot(self, slot: int, nbytes: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self._buffer[start:start + nbytes]

    async def _take_slot(self) -> int:
        loop = asyncio.get_running_loop()
        while True:
            # Nothing that allocates Python objects runs under the lock: a garbage collection there
            # could run a _SlotLease finalizer (-> _give_slot) in this very thread.
            waiter = loop.create_future()
            with self._slot_lock:
                if self._free:
                    return self._free.pop()
                self._waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled: pass it on
                    self._wake_one()
                raise

    def _give_slot(self, slot: int) -> None:
        """Free a slot; from any thread (the vision worker frees the slots it read pixels from)."""
        with self._slot_lock:
            self._free.append(slot)
            if not self._waiting:
                return
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wake_one()
        elif loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake_one)
            except RuntimeError:  # closed meanwhile: nobody waits any more
                pass

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    async def _submit(self, job: _Job):
        loop = asyncio.get_running_loop()
        if self._closed:
            raise DecodeWorkerDied("the image decode pool is closed")
        # Once listening on this loop, children are bound as they start (_replace binds replacements):
        # the lock and the walk over the children are not needed on every image.
        if loop is not self._loop or len(self._children) < self.processes:
            self._ensure_children()
            self._bind(loop)
        self._send(job)
        return await job.future

    async def run(self, fn, *args):
        """fn(*args) in a worker process (not retried); DecodeWorkerDied if that process dies meanwhile."""
        if self.disabled:
            raise DecodeWorkerDied("the image decode processes could not start")
        return await self._submit(_Job(fn, args, asyncio.get_running_loop().create_future()))

    async def decode(self, data: bytes, fingerprint: str, salt: str, in_slot: bool = False) -> DecodedImage:
        """`decode_and_hash(data, ...)` in a worker process; ImageError for a bad image.

        in_slot: leave the pixels in their shared-memory slot (no copy) when they fit; the caller must
        then `release()` the image once it has read them (collecting it releases it too)."""
        if self.disabled or self.segment is None or len(data) > self.slot_bytes:
            return await asyncio.to_thread(decode_and_hash, data, self.limits, fingerprint, salt)
        slot = await self._take_slot()
        job = _Job(None, (fingerprint, salt), asyncio.get_running_loop().create_future(), slot, data,
                   retries_left=1, in_slot=in_slot)
        try:
            return await self._submit(job)
        except BaseException:
            if job.slot is not None and job.sent_to is None:  # never sent: nobody will free it
                self._give_slot(job.slot)
            raise

    def close(self) -> None:
        """Stop the processes; images in flight fail with DecodeWorkerDied."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, []
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for child in children:
            loop = child.loop
            if loop is not None and loop is not current and loop.is_running():
                # Reader removal and future settling belong to that loop's thread.
                try:
                    loop.call_soon_threadsafe(self._drop, child)
                    continue
                except RuntimeError:  # it closed meanwhile
                    pass
            self._drop(child)
        for child in children:
            child.process.join(timeout=5)
            if child.process.is_alive():
                child.process.kill()
                child.process.join(timeout=5)
        if self.segment is not None:
            self.segment.close()  # unlinked; mappings die with their last user

    def _drop(self, child: _Child) -> None:
        """Forget a closed pool's child (on its loop's thread, or with no loop running) and fail its jobs."""
        if not child.conn.closed:
            if child.loop is not None and not child.loop.is_closed():
                child.loop.remove_reader(child.conn.fileno())
            child.conn.close()  # the child sees EOF and exits
        for job in child.jobs.values():
            self._finish(job, None, DecodeWorkerDied("the image decode pool was closed"))
        child.jobs.clear()
