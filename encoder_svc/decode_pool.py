"""Image decode and content hash, in a pool of worker processes (or the server's threads).

Every Encode that carries image bytes needs them decoded (Pillow), made RGB and hashed (the cache key)
before the cache can be asked. That is about 1.5 ms of host work per 336px PNG, and much of it holds
the GIL (Pillow's chunked decode loop, `tobytes`, the copies), so in threads it shared one interpreter
with gRPC, the cache and the vision worker. A pool of spawned processes does it off the server's
interpreter: a child gets the file bytes and returns the hash and the raw RGB pixels (one pickle of
width x height x 3 bytes), which the vision worker then uses without decoding or copying the image again.

`decode_and_hash` is the one function both paths run, so the hash is the same either way
(common/hashing.py frames it; tests check pool against threads against `hash_image`).

A child that dies (a crash in a decoder library, the OOM killer) breaks the whole executor: the images
then in flight fail with `DecodeWorkerDied` (UNAVAILABLE to their callers: they may retry), the pool is
replaced at once and later requests are served. A submit that finds the pool already broken (a child
died while idle) is retried on the new pool, since that request did not cause it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import mmap
import multiprocessing
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
from PIL import Image

from common.hashing import image_content_hash
from common.images import ImageLimits, decode_image

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodedImage:
    """A decoded RGB image and its content hash: what the cache is keyed by and the vision worker reads."""

    content_hash: str  # hex, as on the wire
    width: int
    height: int
    pixels: bytes  # RGB rows, exactly what `Image.tobytes()` gives (the hashed bytes)

    mode = "RGB"

    def to_pil(self) -> Image.Image:
        """A PIL image over `pixels` (no copy; read-only)."""
        return Image.frombuffer("RGB", (self.width, self.height), self.pixels, "raw", "RGB", 0, 1)

    def array(self) -> np.ndarray:
        """A read-only uint8 [H, W, 3] view of `pixels` (no copy)."""
        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, 3)


def decode_and_hash(data: bytes, limits: ImageLimits, fingerprint: str, salt: str) -> DecodedImage:
    """Decode an image file (limits checked; ImageError for a bad one) and hash its RGB pixels.

    The pixels are read out once and hashed in place: the same digest as `hash_image` on the decoded
    image, without its copies."""
    image = decode_image(data, limits)
    pixels = image.tobytes()
    digest = image_content_hash(fingerprint, salt, image.mode, image.width, image.height, pixels)
    return DecodedImage(digest.hex(), image.width, image.height, pixels)


class DecodeWorkerDied(RuntimeError):
    """A decode process died while it held this image (its caller may retry)."""


# -- in the worker processes -----------------------------------------------------------------------

_mapped: dict[str, mmap.mmap] = {}  # a child's mappings of its pool's slot segments, by path


def _slot_view(path: str) -> mmap.mmap:
    # Plain mmap, not multiprocessing.shared_memory: on Python < 3.13 attaching registers the segment
    # with the resource tracker, which would unlink it when this child exits (common/transport/shm.py).
    if path not in _mapped:
        with open(path, "r+b") as f:
            _mapped[path] = mmap.mmap(f.fileno(), 0)
    return _mapped[path]


def decode_into_slot(data: bytes, limits: ImageLimits, fingerprint: str, salt: str, slot_path: str | None,
                     offset: int, capacity: int) -> DecodedImage:
    """`decode_and_hash` in a worker process. With a slot, pixels that fit are written into the pool's
    shared segment at offset and come back empty (the parent copies them out): a pickle through the
    result pipe cost the parent more CPU than decoding the image in a thread."""
    decoded = decode_and_hash(data, limits, fingerprint, salt)
    if slot_path is None or len(decoded.pixels) > capacity:
        return decoded
    _slot_view(slot_path)[offset:offset + len(decoded.pixels)] = decoded.pixels
    return DecodedImage(decoded.content_hash, decoded.width, decoded.height, b"")


def _exit_with_parent(parent: int) -> None:
    """Child initializer: exit once the server is gone. A SIGKILLed (OOM-killed) server cannot shut its
    pool down, and the children, which hold both ends of their call queue, would wait on it forever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _ready(_: int) -> int:
    time.sleep(0.02)  # long enough for the other tasks to go to other processes
    return os.getpid()


# -- in the server -------------------------------------------------------------------------------

class _Generation:
    """One executor and the result slots its processes write into; replaced as a whole when a process
    dies (a slot of a broken executor may still be written by a process being terminated)."""

    def __init__(self, processes: int, slot_bytes: int, slots: int) -> None:
        # spawn, not fork: the server has gRPC, torch and CUDA threads that a fork would copy half-way.
        self.executor = cf.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                               initializer=_exit_with_parent, initargs=(os.getpid(),))
        self.slot_bytes = slot_bytes
        self.segment = None
        self.free: list[int] = []
        self.lock = threading.Lock()
        if slots and slot_bytes:
            from common.transport.shm import ShmArena, shm_available

            try:
                if shm_available():
                    self.segment = ShmArena(slots * slot_bytes)  # swept like the arena if we die
                    self.free = list(range(slots))
            except (MemoryError, OSError) as exc:  # pixels then come back pickled
                log.info("no shared memory for decoded pixels (%s): they come back through a pipe", exc)

    def take_slot(self) -> int | None:
        with self.lock:
            return self.free.pop() if self.free else None

    def give_slot(self, slot: int) -> None:
        with self.lock:
            self.free.append(slot)

    def read(self, slot: int, nbytes: int) -> bytes:
        return self.segment.view(slot * self.slot_bytes, nbytes).numpy().tobytes()

    def close(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=True)
        if self.segment is not None:
            self.segment.close()  # unlinked; mappings die with their last user


class DecodePool:
    """`decode_and_hash` in `processes` spawned worker processes, replaced if one dies.

    Decoded pixels come back through `slots` shared-memory slots of `slot_bytes` (larger images, or
    when every slot is taken, through the result pipe)."""

    def __init__(self, processes: int, limits: ImageLimits = ImageLimits(), slot_bytes: int = 1 << 20,
                 slots: int | None = None) -> None:
        if processes < 1:
            raise ValueError(f"a decode pool needs at least one process, not {processes}")
        self.processes = processes
        self.limits = limits
        self.slot_bytes = slot_bytes
        self.slots = 4 * processes if slots is None else slots
        self.restarts = 0
        self._lock = threading.Lock()
        self._closed = False
        self._gen = _Generation(processes, slot_bytes, self.slots)

    @property
    def _executor(self) -> cf.ProcessPoolExecutor:
        return self._gen.executor

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every process now (each spawn imports Pillow and blake3: not on a request's time)."""
        gen, seen = self._gen, set()
        deadline = time.monotonic() + timeout_s
        while len(seen) < self.processes and time.monotonic() < deadline:
            seen.update(gen.executor.map(_ready, range(self.processes)))

    def _replace(self, broken: _Generation) -> None:
        with self._lock:
            if self._gen is not broken or self._closed:
                return  # another caller replaced it already
            self._gen = _Generation(self.processes, self.slot_bytes, self.slots)
            self.restarts += 1
        log.warning("an image decode process died: the decode pool was restarted (%d restarts)",
                    self.restarts)
        broken.close(wait=False)

    def _submit(self, fn, args_for, want_slot: bool) -> tuple[_Generation, cf.Future, int | None]:
        """Submit fn(*args_for(gen, slot)), with a result slot if wanted and one is free: (generation,
        future, slot)."""
        for attempt in range(2):
            gen = self._gen
            slot = gen.take_slot() if want_slot else None
            try:
                return gen, gen.executor.submit(fn, *args_for(gen, slot)), slot
            except BrokenProcessPool:  # a child died before this request came: retry on a new pool
                if slot is not None:
                    gen.give_slot(slot)
                self._replace(gen)
                if attempt:
                    raise DecodeWorkerDied("the image decode pool cannot start") from None
        raise AssertionError("unreachable")

    async def _result(self, gen: _Generation, fut: cf.Future):
        try:
            return await asyncio.wrap_future(fut)
        except BrokenProcessPool:
            self._replace(gen)
            raise DecodeWorkerDied("an image decode process died while decoding this image "
                                   "(the pool was restarted); retry the request") from None

    async def run(self, fn, *args):
        """fn(*args) in a worker process; DecodeWorkerDied if that process dies meanwhile."""
        gen, fut, _ = self._submit(fn, lambda gen, slot: args, want_slot=False)
        return await self._result(gen, fut)

    async def decode(self, data: bytes, fingerprint: str, salt: str) -> DecodedImage:
        """`decode_and_hash(data, ...)` in a worker process; ImageError for a bad image."""

        def args_for(gen: _Generation, slot: int | None) -> tuple:
            if slot is None:
                return data, self.limits, fingerprint, salt, None, 0, 0
            path, offset = str(gen.segment.path), slot * gen.slot_bytes
            return data, self.limits, fingerprint, salt, path, offset, gen.slot_bytes

        gen, fut, slot = self._submit(decode_into_slot, args_for, want_slot=True)
        try:
            decoded = await self._result(gen, fut)
            if slot is not None and not decoded.pixels:  # in the slot: copy out before it is reused
                decoded = DecodedImage(decoded.content_hash, decoded.width, decoded.height,
                                       gen.read(slot, 3 * decoded.width * decoded.height))
            return decoded
        finally:
            if slot is not None:
                if fut.done():  # the child is finished with the slot
                    gen.give_slot(slot)
                else:  # cancelled while the child may still write it: free it once it is done
                    fut.add_done_callback(lambda _: gen.give_slot(slot))

    def close(self) -> None:
        """Stop the processes; queued images are cancelled."""
        with self._lock:
            self._closed = True
            gen = self._gen
        gen.close(wait=True)
