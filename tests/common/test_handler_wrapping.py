"""Handlers wrapped once, at registration: both ways a generated add_*_to_server registers them."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from common.handler_wrapping import WrappingRegistrar


class _Server:
    def __init__(self) -> None:
        self.generic: tuple = ()
        self.registered: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic += tuple(handlers)

    def add_registered_method_handlers(self, service, handlers) -> None:
        self.registered[service] = handlers


def test_generic_and_registered_handlers_are_wrapped_once_and_unknown_methods_pass():
    calls = []

    def wrap(method, handler):
        calls.append(method)
        inner = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: ("wrapped", inner(req, ctx)))

    handlers = {"Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: f"pong {req}")}
    server = _Server()
    registrar = WrappingRegistrar(server, wrap)
    registrar.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Svc", handlers),))
    registrar.add_registered_method_handlers("t.Svc", handlers)

    assert server.registered["t.Svc"]["Ping"].unary_unary("a", None) == ("wrapped", "pong a")
    (generic,) = server.generic
    details = SimpleNamespace(method="/t.Svc/Ping", invocation_metadata=())
    first, again = generic.service(details), generic.service(details)
    assert first is again and first.unary_unary("b", None) == ("wrapped", "pong b")
    assert generic.service(SimpleNamespace(method="/t.Svc/Nope", invocation_metadata=())) is None
    assert calls == ["/t.Svc/Ping", "/t.Svc/Ping"]  # once registered, once on the generic path's first call
