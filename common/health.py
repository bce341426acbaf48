"""Client side of the standard health service, for scripts, compose healthchecks and `mmserve up`."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_status(address: str, service: str = "", timeout: float = 2.0) -> str:
    """"SERVING", "NOT_SERVING", ... or "UNREACHABLE" when nothing answers at address."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_until_serving(address: str, timeout: float, interval: float = 0.2,
                       is_alive=lambda: True) -> bool:
    """Poll address until it reports SERVING; False on timeout or when is_alive() turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(address, timeout=min(2.0, timeout)) == "SERVING":
            return True
        if not is_alive():
            return False
        time.sleep(interval)
    return False
