"""vLLM's `uuid` on image and video parts: a client names a file once (`{"type": "image_url", "image_url":
{...}, "uuid": "sku-1"}`) and later sends only the name (`"image_url": null`). The gateway keeps the bytes
of named files in a byte-bounded LRU, keyed by the request's cache salt (its tenant) too, so one tenant's
names never reach another tenant's files. A name the gateway does not hold is a 400 that says to send the
file again.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_UUID_CHARS = 256


class MediaMemo:
    """(cache salt, kind, uuid) -> file bytes, least recently used first out, at most max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._files: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()

    def get(self, salt: str, kind: str, uuid: str) -> bytes | None:
        """The bytes named uuid for this tenant (salt), or None."""
        key = (salt, kind, uuid)
        data = self._files.get(key)
        if data is not None:
            self._files.move_to_end(key)
        return data

    def put(self, salt: str, kind: str, uuid: str, data: bytes) -> None:
        """Remember data under uuid for this tenant (a newer file replaces an older one of that name);
        a file larger than the whole memo is not kept."""
        key = (salt, kind, uuid)
        old = self._files.pop(key, None)
        if old is not None:
            self.bytes -= len(old)
        if len(data) > self.max_bytes:
            return
        self._files[key] = data
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            _, evicted = self._files.popitem(last=False)
            self.bytes -= len(evicted)

    def __len__(self) -> int:
        return len(self._files)
