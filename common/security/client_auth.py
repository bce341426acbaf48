"""The client side of authentication: bearer token (and, for services, the tenant) on every call."""

from __future__ import annotations

import collections

import grpc
import grpc.aio

from common.security.identity import TENANT_HEADER


def auth_metadata(token: str | None, tenant: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata pairs for a call: `authorization: Bearer <token>` and, for a service, the tenant."""
    pairs = []
    if token:
        pairs.append(("authorization", f"Bearer {token}"))
    if tenant:
        pairs.append((TENANT_HEADER, tenant))
    return tuple(pairs)


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token's metadata to every call of a blocking channel (grpc.intercept_channel)."""

    def __init__(self, token: str) -> None:
        self._metadata = auth_metadata(token)

    def _details(self, details):
        metadata = (*(details.metadata or ()), *self._metadata)
        return _Details(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _AioToken:
    def __init__(self, token: str) -> None:
        self._metadata = auth_metadata(token)

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class AioTokenInterceptor(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the token's metadata to every unary call of an asyncio channel.

    grpc.aio files an interceptor under the first call kind it implements only, so each kind needs an
    interceptor object of its own (one that was both left streaming calls without the token)."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class AioStreamTokenInterceptor(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    """Adds the token's metadata to every server-streaming call of an asyncio channel (Generate)."""

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def token_interceptors(token: str | None, aio: bool = False) -> list:
    """The interceptors that send token (none without one)."""
    if not token:
        return []
    if aio:
        return [AioTokenInterceptor(token), AioStreamTokenInterceptor(token)]
    return [TokenInterceptor(token)]
