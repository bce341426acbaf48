"""Image and video bytes the gateway holds: per request, once whatever its `n` (one decoder call carries
them, GenerateRequest.n asks for the samples), and for the whole gateway across the requests in flight.

A request over its own budget is refused with 413 naming the limit: it would be refused the same way on
an idle gateway. The gateway-wide budget is real overload: 429 with Retry-After, and every byte a
request took is given back when it ends (success, error or a client that left), and the memory is
returned to the system once enough was (common/memory_return.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.memory_return import MemoryReturn
from gateway.admission import too_large
from gateway.errors import APIError

RETRY_AFTER_S = 1


@dataclass
class GatewayBytes:
    """The image and video bytes every request in flight holds together, at most `limit`; memory is
    given back to the system once enough of them were released (common/memory_return.py)."""

    limit: int
    held: int = 0
    memory: MemoryReturn = field(default_factory=MemoryReturn)

    def reserve(self, n: int, param: str | None) -> None:
        """Hold n more bytes; 429 (overload: retry later) when they do not fit beside the others."""
        if self.held + n > self.limit:
            raise APIError(429, f"the gateway holds {self.held} bytes of images and videos for requests in "
                           f"flight (at most {self.limit}); retry later", param=param,
                           code="gateway_busy", retry_after_s=RETRY_AFTER_S)
        self.held += n

    def give_back(self, n: int) -> None:
        self.held -= n
        self.memory.freed(n, idle=self.held == 0)


class ByteBudget:
    """The bytes one request may still take: `limit` for all its images and videos together, also held
    against the gateway-wide budget until release()."""

    def __init__(self, limit: int, gateway: GatewayBytes | None = None) -> None:
        self.limit = limit
        self.gateway = gateway
        self.used = 0  # fetched bytes counted against limit
        self._held = 0  # of those, what the gateway-wide budget holds for this request

    def take(self, n: int, param: str | None) -> None:
        """Count n fetched bytes; 413 past the request's limit, 429 past the gateway's."""
        if self.used + n > self.limit:
            self.used += n
            raise too_large("the request's images and videos together", self.limit, "bytes",
                            "images_too_large", param)
        if self.gateway is not None:
            self.gateway.reserve(n, param)
            self._held += n
        self.used += n

    def check_declared(self, n: int, param: str | None) -> None:
        """413 now, before any byte is read, when a body that declares n bytes cannot fit the limit."""
        if self.used + n > self.limit:
            self.take(n, param)

    def release(self) -> None:
        """Give this request's bytes back to the gateway-wide budget (idempotent)."""
        if self.gateway is not None and self._held:
            held, self._held = self._held, 0
            self.gateway.give_back(held)
