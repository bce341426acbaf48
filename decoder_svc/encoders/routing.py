"""Consistent hashing of image content hashes onto encoder replicas.

Each image lives in one encoder's cache; adding or removing an encoder moves only about 1/N of the
images to another one. A ring is immutable: membership changes (DNS discovery, health ejection) build a
new one with `with_members`, whose points for the surviving addresses are the same, so only the keys of
the added or removed addresses change owner.
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
        self.replicas = replicas
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

    def with_members(self, addresses: Sequence[str]) -> HashRing:
        """A ring over `addresses` with this ring's number of points per address."""
        return HashRing(addresses, self.replicas)
