"""The one server skeleton both services run on.

It owns everything that is not the service itself: a `grpc.aio` server with message limits large
enough for inline embeddings, the standard health service (NOT_SERVING until the service says it is
warm), server reflection, a wrapper on each handler that logs each RPC and turns exceptions into
statuses, a Prometheus endpoint on its own port (off unless asked) and graceful shutdown on
SIGTERM/SIGINT. Handlers reach the server only through `add` (wrapped: authentication comes first).
With a ServerSecurity it also serves TLS (mutual TLS with a client CA) and authenticates every RPC but
health (common/security/); reflection is then off unless asked for.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from common.errors import ServiceError
from common.freed_memory import reuse_freed_blocks
from common.handler_wrapping import WrappingRegistrar, wrap_behavior
from common.security.auth import AuthGuard
from common.security.options import ServerSecurity
from common.security.tls import is_loopback
from common.startup import dump_stacks_on_signal

log = logging.getLogger("mmserve.server")

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # one 576x4096 fp32 embedding inline is 9 MiB; leave room


def _short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


class _StatusMapping:
    """Logs each RPC and maps exceptions to statuses: ServiceError keeps its code, anything else is
    INTERNAL with the exception's type and message (never a bare "Exception calling application")."""

    def __init__(self, service_name: str) -> None:
        self._service_name = service_name

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """handler with its exceptions mapped to statuses (streaming-request RPCs, none in our protos,
        as they are)."""
        short = _short(method)

        def mapped(behavior, kind: str):
            if kind == "unary_unary":
                return self._wrap_unary(behavior, short)
            if kind == "unary_stream":
                return self._wrap_stream(behavior, short)
            return behavior

        return wrap_behavior(handler, mapped)

    async def _fail(self, context, method: str, exc: BaseException, started: float) -> None:
        if isinstance(exc, ServiceError):
            code, message = exc.code, exc.message
            # NOT_FOUND is the normal answer to a hash-first Encode of a new image: not worth INFO.
            level = logging.DEBUG if code == grpc.StatusCode.NOT_FOUND else logging.INFO
            log.log(level, "%s %s -> %s: %s", self._service_name, method, code.name, message)
        else:
            code, message = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            log.exception("%s %s failed after %.1f ms", self._service_name, method,
                          1e3 * (time.perf_counter() - started))
        await context.abort(code, message)

    def _wrap_unary(self, behavior, method: str):
        async def wrapper(request, context):
            started = time.perf_counter()
            try:
                response = await behavior(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except BaseException as exc:  # noqa: BLE001 - every failure must become a status
                await self._fail(context, method, exc, started)
            log.debug("%s %s ok in %.1f ms", self._service_name, method,
                      1e3 * (time.perf_counter() - started))
            return response

        return wrapper

    def _wrap_stream(self, behavior, method: str):
        async def wrapper(request, context):
            started = time.perf_counter()
            try:
                async for item in behavior(request, context):
                    yield item
            # GeneratorExit: the client hung up while the stream was paused at a yield; the call is gone.
            except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
                raise
            except BaseException as exc:  # noqa: BLE001
                await self._fail(context, method, exc, started)
            log.debug("%s %s stream done in %.1f ms", self._service_name, method,
                      1e3 * (time.perf_counter() - started))

        return wrapper


class GrpcService:
    """A gRPC server with health, reflection, error mapping, metrics and graceful shutdown.

    Usage::

        server = GrpcService("encoder", host, port, metrics_port)
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer,
                   "mmserve.v1.EncoderService")
        port = await server.start()       # health says NOT_SERVING
        ...warm up...
        server.set_serving(True)
        await server.wait(on_shutdown=servicer.close)   # until SIGTERM/SIGINT
    """

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        security: ServerSecurity | None = None,
    ) -> None:
        reuse_freed_blocks()  # requests of megabytes: no fresh pages for each copy (common/freed_memory.py)
        dump_stacks_on_signal()
        self.name = name
        self.host = host
        self.port = port
        self.metrics_port = metrics_port
        self.bound_port: int | None = None
        self.security = security or ServerSecurity()
        # Auth outermost: nothing runs for a caller it refuses. Without tokens it still keeps the
        # tenant salt namespace closed. Both wrap each handler once, as it is registered (no server
        # interceptors: see common/handler_wrapping.py).
        auth, statuses = AuthGuard(self.security.auth, name), _StatusMapping(name)
        self._service_names: list[str] = []
        self._stopping = asyncio.Event() if _has_loop() else None
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._registrar = WrappingRegistrar(
            self._server, lambda method, handler: auth.wrap(method, statuses.wrap(method, handler)))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._registrar)

    def add(self, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any,
            service_full_name: str) -> None:
        """Register a servicer (before start)."""
        add_to_server(servicer, self._registrar)
        self._service_names.append(service_full_name)

    async def start(self) -> int:
        """Bind and start serving RPCs; health reports NOT_SERVING until set_serving(True)."""
        if self.security.reflection:
            names = [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
                reflection.aio.ReflectionServicer(names), self._registrar)
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        if self.security.tls is not None:
            self.bound_port = self._server.add_secure_port(address, self.security.tls.credentials())
        else:
            if not is_loopback(self.host):
                log.warning("%s: plaintext on %s: anyone who reaches this port can use it; give "
                            "--tls-cert/--tls-key (and --auth-tokens) off 127.0.0.1 (docs/security.md)",
                            self.name, self.host)
            self.bound_port = self._server.add_insecure_port(address)
        if self.bound_port == 0:
            raise OSError(f"{self.name}: cannot bind {address}")
        await self._server.start()
        await self._set_health(False)
        if self.metrics_port is not None:
            from prometheus_client import start_http_server

            metrics_host = self.security.metrics_host
            start_http_server(self.metrics_port, addr=metrics_host)
            log.info("%s metrics on http://%s:%d/metrics", self.name, metrics_host, self.metrics_port)
        log.info("%s listening on %s:%d (%s%s)", self.name, self.host, self.bound_port,
                 "plaintext" if self.security.tls is None
                 else "mutual TLS" if self.security.tls.mutual else "TLS",
                 ", bearer tokens" if self.security.auth is not None else "")
        return self.bound_port

    async def _set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self._service_names]:
            result = self._health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    def set_serving(self, serving: bool) -> None:
        """Report SERVING (warm) or NOT_SERVING on the health service."""
        asyncio.get_running_loop().create_task(self._set_health(serving))

    async def wait(self, on_shutdown: Callable[[], Awaitable[None]] | None = None,
                   grace: float = 5.0, drain: Callable[[], Awaitable[None]] | None = None,
                   drain_timeout: float = 30.0) -> None:
        """Serve until SIGTERM/SIGINT (or stop()), then shut down gracefully: NOT_SERVING, then
        `drain()` (the service refuses new work and lets in-flight work finish) for up to drain_timeout
        seconds, then on_shutdown(), then stop, cancelling what is left after `grace` seconds."""
        loop = asyncio.get_running_loop()
        if self._stopping is None:
            self._stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stopping.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await self._stopping.wait()
        log.info("%s shutting down", self.name)
        await self._set_health(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), drain_timeout)
            except asyncio.TimeoutError:
                log.warning("%s: drain did not finish within %.0f s", self.name, drain_timeout)
        if on_shutdown is not None:
            await on_shutdown()
        await self._server.stop(grace)

    def request_stop(self) -> None:
        """Make wait() return (as a signal would)."""
        if self._stopping is not None:
            self._stopping.set()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop at once: NOT_SERVING, then let in-flight RPCs finish for up to grace seconds."""
        await self._set_health(False)
        await self._server.stop(grace)
        self.request_stop()


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def configure_logging(level: str = "INFO") -> None:
    """One log format for both services."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
