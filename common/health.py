"""Client side of the standard health service, for scripts, compose healthchecks and `mmserve up`.

Health needs no token; over TLS it needs `tls` (and under mutual TLS a client certificate in it)."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.security.tls import ClientTls, open_channel


def health_status(address: str, service: str = "", timeout: float = 2.0, tls: ClientTls | None = None) -> str:
    """"SERVING", "NOT_SERVING", ... or "UNREACHABLE" when nothing answers at address (or the TLS
    handshake fails)."""
    with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_until_serving(address: str, timeout: float, interval: float = 0.2,
                       is_alive=lambda: True, tls: ClientTls | None = None) -> bool:
    """Poll address until it reports SERVING; False on timeout or when is_alive() turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(address, timeout=min(2.0, timeout), tls=tls) == "SERVING":
            return True
        if not is_alive():
            return False
        time.sleep(interval)
    return False
