"""The gateway's settings (from `mmserve gateway`'s flags)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from gateway.images import ImageFetchPolicy


@dataclass
class GatewayConfig:
    """What the gateway serves and how."""

    decoders: list[str]
    served_model_name: str = "mmserve"
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    model_dir: Path | None = None  # its tokenizer writes logprob tokens as text
    request_timeout_s: float = 600.0  # the gRPC deadline of each Generate call (then 504)
    max_request_bytes: int = 64 * 2**20
    images: ImageFetchPolicy = field(default_factory=ImageFetchPolicy)
    cache_salt_header: str = "x-cache-salt"

    def tenant_of(self, api_key: str) -> str:
        """A stable, non-secret name for an API key: the prefix of every cache salt its requests get, so
        that tenants with different keys never share prefix KV or embeddings."""
        return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
