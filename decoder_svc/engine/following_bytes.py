"""An image file's bytes that reach the engine core after their request does.

The front end sends a request to the core in two messages: the request itself, small (token ids,
content hashes, positions), then its images' encoded bytes (megabytes). The core schedules the request
as soon as the first arrives: a prefix hit never needs the bytes, and an image is asked of its encoder by
content hash first, so the bytes are read only when the encoder does not hold the image, by which time
they have arrived. A request's placeholder holds a FollowingBytes in place of the bytes; the core's
command reader fills it from the second message.
"""

from __future__ import annotations

import threading


class BytesNeverCameError(RuntimeError):
    """The bytes did not arrive in time (the front end is gone)."""


class FollowingBytes:
    """The bytes of one image file, set once by another thread; `get` waits for them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: bytes | None = None
        self._arrived = threading.Event()

    def __reduce__(self):  # only the size travels with the request; the bytes come on their own
        return FollowingBytes, (self.size,)

    def set(self, data: bytes) -> None:
        """The bytes arrived."""
        self._data = data
        self._arrived.set()

    def get(self, timeout: float) -> bytes:
        """The bytes, waiting up to timeout seconds for them; BytesNeverCameError otherwise."""
        if not self._arrived.wait(timeout):
            raise BytesNeverCameError(f"the image's {self.size} bytes did not reach the engine within "
                                      f"{timeout:.0f} s")
        return self._data

    def __len__(self) -> int:
        return self.size


def detach_files(placeholders) -> list[bytes]:
    """Take the encoded files out of a request's image placeholders (in order), leaving a FollowingBytes
    in each one's place; the request then crosses to the core without them."""
    files = []
    for img in placeholders:
        if isinstance(img.image, bytes):
            files.append(img.image)
            img.image = FollowingBytes(len(img.image))
    return files


def awaiting_files(placeholders) -> list[FollowingBytes]:
    """The FollowingBytes of a request's placeholders, in order (what its ImageBytes will fill)."""
    return [img.image for img in placeholders if isinstance(img.image, FollowingBytes)]
