"""Consistent hashing of image content hashes onto encoder replicas.

Each image lives in one encoder's cache; adding or removing an encoder moves only about 1/N of the
images to another one.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence


class HashRing:
    """Maps a key (an image content hash) to one of several addresses."""

    def __init__(self, addresses: Sequence[str], replicas: int = 64) -> None:
        if not addresses:
            raise ValueError("at least one encoder address is needed")
        self.addresses = list(dict.fromkeys(addresses))
        points = []
        for address in self.addresses:
            for i in range(replicas):
                points.append((self._point(f"{address}#{i}"), address))
        points.sort()
        self._points = [p for p, _ in points]
        self._owners = [a for _, a in points]

    @staticmethod
    def _point(text: str) -> int:
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")

    def route(self, key: str) -> str:
        """The address that owns key."""
        i = bisect.bisect(self._points, self._point(key)) % len(self._points)
        return self._owners[i]
