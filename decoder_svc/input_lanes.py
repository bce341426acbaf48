"""Input processing in two lanes, so that one heavy request cannot stall text-only requests.

Text-only requests (tokenization only) run in threads of their own. Requests with images (header
probes, decoding, hashing: up to seconds for sixteen 4096x4096 images) run in a separate, bounded pool
and are admitted by cost, one unit per image: past `max_pending_images` images queued or running, a
new image request is refused with RESOURCE_EXHAUSTED (real overload: the client may retry later),
rather than queueing without bound. Per-request limits (images, pixels, prompt bytes) are the input
processor's and are checked before any of this work.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from common.errors import CapacityError

T = TypeVar("T")


class InputOverloadedError(CapacityError):
    """The image lane holds its most images already (the service answers RESOURCE_EXHAUSTED)."""


class InputLanes:
    """A text lane and a cost-admitted image lane of worker threads."""

    def __init__(self, text_threads: int = 2, image_threads: int | None = None,
                 max_pending_images: int = 64) -> None:
        image_threads = image_threads or max(1, min(4, (os.cpu_count() or 2) - 1))
        self._text = ThreadPoolExecutor(text_threads, thread_name_prefix="input-text")
        self._images = ThreadPoolExecutor(image_threads, thread_name_prefix="input-images")
        self.max_pending_images = max_pending_images
        self.pending_images = 0

    async def run(self, images: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in the lane for a request with `images` images; raises
        InputOverloadedError when the image lane is full."""
        loop = asyncio.get_running_loop()
        call = partial(fn, *args, **kwargs)
        if images == 0:
            return await loop.run_in_executor(self._text, call)
        if self.pending_images + images > self.max_pending_images:
            raise InputOverloadedError(
                f"input processing is full ({self.pending_images} images pending, at most "
                f"{self.max_pending_images}); retry later")
        self.pending_images += images
        try:
            return await loop.run_in_executor(self._images, call)
        finally:
            self.pending_images -= images

    def shutdown(self) -> None:
        self._text.shutdown(wait=False, cancel_futures=True)
        self._images.shutdown(wait=False, cancel_futures=True)
