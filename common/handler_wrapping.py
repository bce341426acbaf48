"""Wrapping every RPC handler once, where it is registered, instead of with server interceptors.

A `grpc.aio` server interceptor runs on every call: a chain of Python coroutines that looks the handler
up again and hands it back, on the event loop's time (BENCHMARKS.md has the profile). The wrappers are
the same for every call of a handler, so wrapping once at registration gives every call the same
behaviour without the dispatch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import grpc

# (full method name "/package.Service/Method", handler) -> the handler to serve it with
HandlerWrap = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


def wrap_behavior(handler: grpc.RpcMethodHandler,
                  wrap: Callable[[Callable, str], Callable]) -> grpc.RpcMethodHandler:
    """The same handler (kind, serializers) with its behaviour replaced by wrap(behaviour, kind); kind is
    "unary_unary", "unary_stream", "stream_unary" or "stream_stream"."""
    kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
            else "stream_unary" if handler.stream_unary else "stream_stream")
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(wrap(getattr(handler, kind), kind), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class _WrappedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose handlers come out wrapped (each wrapped once, on its first call)."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: HandlerWrap) -> None:
        self._inner = inner
        self._wrap = wrap
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        if len(self._wrapped) < 256:  # generated services have fixed handlers; keep no per-call ones
            self._wrapped[method] = (handler, wrapped)
        return wrapped


class WrappingRegistrar:
    """Stands in for the server where generated `add_*Servicer_to_server` functions register their
    handlers, and registers each handler on the real server through `wrap`."""

    def __init__(self, server: grpc.aio.Server, wrap: HandlerWrap) -> None:
        self._server = server
        self._wrap = wrap

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_WrappedGenericHandler(handler, self._wrap) for handler in generic_rpc_handlers))

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {name: self._wrap(f"/{service_name}/{name}", handler)
                   for name, handler in method_handlers.items()}
        self._server.add_registered_method_handlers(service_name, wrapped)
