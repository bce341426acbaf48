"""Per-RPC authentication and tenant scoping, wrapped around each RPC handler of a grpc.aio server.

Every RPC except the health service must authenticate:
- `authorization: Bearer <token>` metadata, looked up in the token file (tokens.py), or
- under mutual TLS, a verified client certificate whose common name is one of `cert_services`: that
  service's identity (how a decoder can reach its encoders without a token).
No or an unknown token is UNAUTHENTICATED. A tenant that names another tenant in `x-mmserve-tenant` is
PERMISSION_DENIED; a service may name any tenant, and then acts for it.

Then the request is scoped before the servicer sees it (identity.py): a top-level `cache_salt` field is
moved into the tenant's namespace, and a top-level `lease_owner` field is bound to the caller. Doing it
here, by field name, covers every RPC, including ones added later, without each servicer repeating it.
A tenant's `accept` (transports) is cut to inline bytes: a shared-memory name or a CUDA IPC handle opens
the encoder's whole arena, every tenant's embeddings, so only services get zero-copy refs.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from common.errors import ServiceError
from common.handler_wrapping import wrap_behavior
from common.pb import common_pb2
from common.security.identity import (
    SERVICE,
    TENANT,
    TENANT_HEADER,
    Principal,
    bind_call,
    scoped_owner,
    scoped_salt,
    tenant_of_salt,
    valid_name,
)
from common.security.tokens import TokenTable

log = logging.getLogger("mmserve.security")

OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # probes (Docker, Kubernetes) carry no token


class AuthError(ServiceError):
    """A call that does not pass: its status code and a message safe to send back."""


@dataclass(frozen=True)
class CallIdentity:
    """The caller and the tenant the call is for (None: a service acting for no tenant)."""

    principal: Principal
    tenant: str | None


@dataclass
class AuthPolicy:
    """Who may call: bearer tokens, plus client-certificate common names that count as services."""

    tokens: TokenTable
    cert_services: frozenset[str] = field(default_factory=frozenset)

    def authenticate(self, metadata: dict[str, str], auth_context: dict) -> CallIdentity:
        """The call's identity from its metadata and TLS auth context; raises AuthError."""
        principal = self._principal(metadata, auth_context)
        named = metadata.get(TENANT_HEADER)
        if principal.kind == TENANT:
            if named is not None and named != principal.name:
                raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                                f"{TENANT_HEADER}: a tenant may act only for itself")
            return CallIdentity(principal, principal.name)
        if named is not None and not valid_name(named):
            raise AuthError(grpc.StatusCode.INVALID_ARGUMENT, f"{TENANT_HEADER}: not a tenant name")
        return CallIdentity(principal, named)

    def _principal(self, metadata: dict[str, str], auth_context: dict) -> Principal:
        header = metadata.get("authorization")
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                                "authorization metadata must be `Bearer <token>`")
            principal = self.tokens.lookup(token.strip())
            if principal is None:
                raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
            return principal
        for cn in auth_context.get("x509_common_name", []):
            name = cn.decode(errors="replace") if isinstance(cn, bytes) else str(cn)
            if name in self.cert_services:
                return Principal(SERVICE, name)
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                        "missing credentials: send `authorization: Bearer <token>` metadata")


def scope_request(request, identity: CallIdentity | None) -> None:
    """Rewrite the request's top-level cache_salt and lease_owner for identity (in place).

    Without authentication (identity None) a salt in a tenant's namespace is refused: a server without
    tokens must not pass one on to a server that trusts it to have checked (a confused deputy)."""
    fields = request.DESCRIPTOR.fields_by_name
    if identity is None:
        if "cache_salt" in fields and tenant_of_salt(request.cache_salt) is not None:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            "cache_salt: the mmserve-tenant: prefix is reserved for authenticated tenants")
        return
    if "cache_salt" in fields:
        if identity.tenant is not None:
            request.cache_salt = scoped_salt(identity.tenant, request.cache_salt)
        elif tenant_of_salt(request.cache_salt) is not None:
            # A service acting for nobody must not reach into a tenant's namespace.
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            f"a tenant's cache_salt needs {TENANT_HEADER} naming that tenant")
    if "lease_owner" in fields:
        request.lease_owner = scoped_owner(identity.principal, request.lease_owner)
    if "accept" in fields and identity.principal.kind == TENANT:
        del request.accept[:]
        request.accept.append(common_pb2.TRANSPORT_INLINE)


class AuthGuard:
    """Authenticates each RPC (health excepted) and scopes its request messages; with policy None it
    authenticates nobody and only keeps the tenant namespace closed (see scope_request). `wrap` puts it
    in front of a handler (at registration: common/handler_wrapping.py)."""

    def __init__(self, policy: AuthPolicy | None, service_name: str = "") -> None:
        self.policy = policy
        self._service_name = service_name

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """handler, authenticating and scoping each call first (health's handlers as they are)."""
        if method.startswith(OPEN_SERVICES):
            return handler

        def guarded(behavior, kind: str):
            make = self._wrap_unary_response if kind.endswith("unary") else self._wrap_stream_response
            return make(behavior, method, kind.startswith("stream"))

        return wrap_behavior(handler, guarded)

    async def _admit(self, request_or_iterator, context, method: str, streaming_request: bool):
        """Authenticate, bind the identity to this task, scope the request(s); aborts on failure."""
        try:
            identity = None
            if self.policy is not None:
                metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())
                            if isinstance(v, str)}
                identity = self.policy.authenticate(metadata, context.auth_context() or {})
            if not streaming_request:
                scope_request(request_or_iterator, identity)
        except AuthError as exc:
            log.info("%s %s refused: %s (%s) from %s", self._service_name, method.rsplit("/", 1)[-1],
                     exc.code.name, exc.message, context.peer())
            await context.abort(exc.code, exc.message)
        if identity is not None:
            bind_call(identity.principal, identity.tenant)
        if streaming_request:
            return _scoped_stream(request_or_iterator, identity, context)
        return request_or_iterator

    def _wrap_unary_response(self, behavior, method: str, streaming_request: bool):
        async def wrapper(request, context):
            request = await self._admit(request, context, method, streaming_request)
            return await behavior(request, context)

        return wrapper

    def _wrap_stream_response(self, behavior, method: str, streaming_request: bool):
        async def wrapper(request, context):
            request = await self._admit(request, context, method, streaming_request)
            result = behavior(request, context)
            if inspect.isawaitable(result):  # a handler that writes with context.write()
                await result
                return
            async for item in result:
                yield item

        return wrapper


async def _scoped_stream(requests, identity: CallIdentity | None, context) -> AsyncIterator:
    async for request in requests:
        try:
            scope_request(request, identity)
        except AuthError as exc:
            await context.abort(exc.code, exc.message)
        yield request
