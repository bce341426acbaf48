"""An image or video file's bytes that reach the engine core after their request does.

The front end sends a request to the core in two messages: the request itself, small (token ids,
content hashes, positions), then its images' and videos' encoded bytes (megabytes). The core schedules
the request as soon as the first arrives: a prefix hit never needs the bytes, and an image or video is
asked of its encoder by content hash first, so the bytes are read only when the encoder does not hold
it, by which time they have arrived. A request's placeholder holds a FollowingBytes in place of the bytes
(a video's: in its VideoSource); the core's command reader fills it from the second message.
"""

from __future__ import annotations

import threading
from dataclasses import replace


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


def file_bytes(data: bytes | FollowingBytes, timeout: float) -> bytes:
    """A file's bytes: as given, or waited for (up to timeout seconds) while still on their way."""
    return data.get(timeout) if isinstance(data, FollowingBytes) else data


def detach_files(placeholders) -> list[bytes]:
    """Take the encoded files out of a request's image and video placeholders (in order), leaving a
    FollowingBytes in each one's place; the request then crosses to the core without them. A video
    whose rows fill several placeholders (Qwen3-VL: one per group of frames) shares one VideoSource:
    its file is taken once and the placeholders keep sharing the detached source."""
    files = []
    detached_videos: dict[int, object] = {}
    for img in placeholders:
        if isinstance(img.image, bytes):
            files.append(img.image)
            img.image = FollowingBytes(len(img.image))
        elif img.video is not None and isinstance(img.video.data, bytes):
            detached = detached_videos.get(id(img.video))
            if detached is None:
                files.append(img.video.data)
                detached = replace(img.video, data=FollowingBytes(len(img.video.data)))
                detached_videos[id(img.video)] = detached
            img.video = detached
    return files


def awaiting_files(placeholders) -> list[FollowingBytes]:
    """The FollowingBytes of a request's placeholders, in order, each once (what its ImageBytes fill)."""
    holders: list[FollowingBytes] = []
    for img in placeholders:
        holder = img.image if img.video is None else img.video.data
        if isinstance(holder, FollowingBytes) and not any(holder is h for h in holders):
            holders.append(holder)
    return holders
