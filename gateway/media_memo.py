"""vLLM's `uuid` on image and video parts: a client names a file once (`{"type": "image_url", "image_url":
{...}, "uuid": "sku-1"}`) and later sends only the name (`"image_url": null`, or `{}`). The gateway keeps
the bytes of named files per tenant (an API key; without --api-key every client is one tenant), each
tenant's in a byte-bounded LRU of its own, keyed by the request's cache salt too, so one tenant's names
never reach another tenant's files and one tenant's files never push out another's. At most max_tenants
tenants are remembered: a new one makes the least recently active tenant's files forgotten. A name the
gateway does not hold is a 400 that says to send the file again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_UUID_CHARS = 256
DEFAULT_MAX_TENANTS = 8


@dataclass
class _TenantFiles:
    """One tenant's files: (cache salt, kind, uuid) -> bytes, least recently used first."""

    files: OrderedDict[tuple[str, str, str], bytes] = field(default_factory=OrderedDict)
    bytes: int = 0


class MediaMemo:
    """tenant -> its files, at most max_bytes each, least recently used first out; at most max_tenants
    tenants, the least recently active tenant's files forgotten whole for a new tenant's."""

    def __init__(self, max_bytes: int, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        self.max_bytes = max_bytes
        self.max_tenants = max_tenants
        self._tenants: OrderedDict[str, _TenantFiles] = OrderedDict()

    def of(self, tenant: str) -> TenantMedia:
        """The files of one tenant, with get and put that need no tenant."""
        return TenantMedia(self, tenant)

    def get(self, salt: str, kind: str, uuid: str, tenant: str = "") -> bytes | None:
        """The bytes named uuid for this tenant and cache salt, or None."""
        files = self._tenants.get(tenant)
        if files is None:
            return None
        self._tenants.move_to_end(tenant)
        key = (salt, kind, uuid)
        data = files.files.get(key)
        if data is not None:
            files.files.move_to_end(key)
        return data

    def put(self, salt: str, kind: str, uuid: str, data: bytes, tenant: str = "") -> None:
        """Remember data under uuid for this tenant and cache salt (a newer file replaces an older one of
        that name); a file larger than a tenant's whole budget is not kept."""
        files = self._tenants.get(tenant)
        key = (salt, kind, uuid)
        if files is not None:
            self._tenants.move_to_end(tenant)
            old = files.files.pop(key, None)
            if old is not None:
                files.bytes -= len(old)
        if len(data) > self.max_bytes:
            return
        if files is None:
            while len(self._tenants) >= self.max_tenants:
                self._tenants.popitem(last=False)
            files = self._tenants[tenant] = _TenantFiles()
        files.files[key] = data
        files.bytes += len(data)
        while files.bytes > self.max_bytes:
            _, evicted = files.files.popitem(last=False)
            files.bytes -= len(evicted)

    @property
    def bytes(self) -> int:
        """The bytes held, all tenants together."""
        return sum(files.bytes for files in self._tenants.values())

    @property
    def tenants(self) -> int:
        """The tenants whose files are held."""
        return len(self._tenants)

    def __len__(self) -> int:
        return sum(len(files.files) for files in self._tenants.values())


@dataclass(frozen=True)
class TenantMedia:
    """MediaMemo's files of one tenant: what a request's translation reads and adds to."""

    memo: MediaMemo
    tenant: str

    def get(self, salt: str, kind: str, uuid: str) -> bytes | None:
        return self.memo.get(salt, kind, uuid, self.tenant)

    def put(self, salt: str, kind: str, uuid: str, data: bytes) -> None:
        self.memo.put(salt, kind, uuid, data, self.tenant)
