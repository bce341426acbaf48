"""Who a call is, and the scoping of salts and lease owners that follows from it.

A tenant's cache salt lives in a namespace of its own: the server rewrites every `cache_salt` a tenant
sends to `mmserve-tenant:<name>:<salt>`. Image hashes, encoder-cache entries and prefix-KV block hashes
all depend on the salt, so one tenant can never name, find or reuse another's. Lease owners are bound the
same way to the caller's identity, so the same owner string in two tenants is two different owners.

A service (the decoder talking to its encoders, a gateway talking to decoders) acts for a tenant it names
in the `x-mmserve-tenant` metadata; only a service may name a tenant other than itself.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass

TENANT_HEADER = "x-mmserve-tenant"
TENANT_SALT_PREFIX = "mmserve-tenant:"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # no ':' : the salt prefix stays parseable

TENANT = "tenant"
SERVICE = "service"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: a tenant, or a service that may act for tenants."""

    kind: str  # TENANT or SERVICE
    name: str

    def __post_init__(self) -> None:
        if self.kind not in (TENANT, SERVICE):
            raise ValueError(f"unknown identity kind {self.kind!r}")
        if not NAME_PATTERN.fullmatch(self.name):
            raise ValueError(f"identity name {self.name!r}: use 1-64 letters, digits, '.', '_' or '-'")

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


def valid_name(name: str) -> bool:
    return NAME_PATTERN.fullmatch(name) is not None


def scoped_salt(tenant: str, salt: str) -> str:
    """The salt in tenant's namespace. Idempotent: a salt already in that namespace is kept as it is."""
    prefix = f"{TENANT_SALT_PREFIX}{tenant}:"
    return salt if salt.startswith(prefix) else prefix + salt


def tenant_of_salt(salt: str) -> str | None:
    """The tenant whose namespace a scoped salt is in, or None for an unscoped salt."""
    if not salt.startswith(TENANT_SALT_PREFIX):
        return None
    name, sep, _ = salt[len(TENANT_SALT_PREFIX):].partition(":")
    return name if sep and valid_name(name) else None


def scoped_owner(principal: Principal, owner: str) -> str:
    """A lease owner bound to the caller: another identity sending the same string owns nothing."""
    return f"{principal}/{owner}"


_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("mmserve_principal", default=None)
_acting_for: contextvars.ContextVar[str | None] = contextvars.ContextVar("mmserve_tenant", default=None)


def current_principal() -> Principal | None:
    """The identity of the RPC being served (None when the server runs without authentication)."""
    return _current.get()


def current_tenant() -> str | None:
    """The tenant the RPC being served is for: the caller's own, or the one a service named."""
    return _acting_for.get()


def bind_call(principal: Principal, tenant: str | None) -> None:
    """Record the caller for the rest of this RPC's task (the auth guard calls this)."""
    _current.set(principal)
    _acting_for.set(tenant)
