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
import multiprocessing
import threading
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


def _ready(_: int) -> bool:
    return True


class DecodePool:
    """`decode_and_hash` in `processes` spawned worker processes, replaced if one dies."""

    def __init__(self, processes: int, limits: ImageLimits = ImageLimits()) -> None:
        if processes < 1:
            raise ValueError(f"a decode pool needs at least one process, not {processes}")
        self.processes = processes
        self.limits = limits
        self.restarts = 0
        self._lock = threading.Lock()
        self._closed = False
        self._executor = self._new_executor()

    def _new_executor(self) -> cf.ProcessPoolExecutor:
        # spawn, not fork: the server has gRPC, torch and CUDA threads that a fork would copy half-way.
        return cf.ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))

    def start(self) -> None:
        """Start every process now (each spawn imports Pillow and blake3: not on a request's time)."""
        list(self._executor.map(_ready, range(self.processes)))  # executor.map: on-demand spawns, all at once

    def _replace(self, broken: cf.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is not broken or self._closed:
                return  # another caller replaced it already
            self._executor = self._new_executor()
            self.restarts += 1
        log.warning("an image decode process died: the decode pool was restarted (%d restarts)",
                    self.restarts)
        broken.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn, *args) -> tuple[cf.ProcessPoolExecutor, cf.Future]:
        for attempt in range(2):
            executor = self._executor
            try:
                return executor, executor.submit(fn, *args)
            except BrokenProcessPool:  # a child died before this request came: retry on a new pool
                self._replace(executor)
                if attempt:
                    raise DecodeWorkerDied("the image decode pool cannot start") from None
        raise AssertionError("unreachable")

    async def run(self, fn, *args):
        """fn(*args) in a worker process; DecodeWorkerDied if that process dies meanwhile."""
        executor, fut = self._submit(fn, *args)
        try:
            return await asyncio.wrap_future(fut)
        except BrokenProcessPool:
            self._replace(executor)
            raise DecodeWorkerDied("an image decode process died while decoding this image "
                                   "(the pool was restarted); retry the request") from None

    async def decode(self, data: bytes, fingerprint: str, salt: str) -> DecodedImage:
        """`decode_and_hash(data, ...)` in a worker process; ImageError for a bad image."""
        return await self.run(decode_and_hash, data, self.limits, fingerprint, salt)

    def close(self) -> None:
        """Stop the processes; queued images are cancelled."""
        with self._lock:
            self._closed = True
            executor = self._executor
        executor.shutdown(wait=True, cancel_futures=True)
