"""What each service's `main` does before it loads anything: fail fast on a busy port or a missing
model, report a user error in argparse's form, and turn a bind race into a user error.

The services import these from here, not from common/cli.py, which dispatches to the services: the
command line sits above them, this module below.
"""

from __future__ import annotations

import errno
import faulthandler
import signal
import socket
import sys
from typing import Protocol

from common.errors import UsageError


class Listener(Protocol):
    """What start_listening needs of a service (common.server.GrpcService is one; a Protocol because the
    server imports this module)."""

    host: str
    port: int
    metrics_port: int | None

    async def start(self) -> int: ...

    async def stop(self, grace: float = 5.0) -> None: ...


def dump_stacks_on_signal() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to stderr (a service's log) and the process goes
    on: for a service, engine core or decode process that seems stuck. Once per process."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def report_usage_error(prog: str, exc: BaseException) -> int:
    """Print `prog: error: message` (argparse's form) and return the usage exit code, 2."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2


def resolve_checkpoint(model: str, revision: str | None = None) -> str:
    """The local checkpoint directory of `model` (a directory or a Hub id at `revision`), downloading a
    Hub model unless HF_HUB_OFFLINE=1; UsageError (one line) when it cannot."""
    from common.hub import ModelNotFoundError, resolve_model

    try:
        return str(resolve_model(model, revision))
    except ModelNotFoundError as exc:
        raise UsageError(f"--model: {exc}") from None


def free_port() -> int:
    """A TCP port free on the loopback interface right now (for harnesses that start services)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, option: str = "--port") -> None:
    """Raise UsageError when host:port cannot be listened on (port 0 picks a free one: no check).

    Services call this before loading a model, so a busy port fails in a second, not after the load
    (start_listening still catches one taken in between). The probe sets SO_REUSEADDR, as servers do,
    so that sockets in TIME_WAIT from a previous run do not count; a listening socket still refuses it.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: {exc.strerror}") from None
    errors: list[OSError] = []
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                errors.append(exc)
    busy = [e for e in errors if e.errno == errno.EADDRINUSE]
    if busy:
        raise UsageError(f"{option} {port}: {host}:{port} is already in use")
    if errors and len(errors) == len(infos):  # e.g. a privileged port, or an address not on this host
        raise UsageError(f"{option} {port}: cannot listen on {host}:{port}: {errors[0].strerror}")


async def start_listening(service: Listener) -> int:
    """service.start(), with a port taken since check_port_free (a race) raised as a UsageError."""
    try:
        return await service.start()
    except (RuntimeError, OSError) as exc:
        # grpc raises RuntimeError("Failed to bind ...") (GrpcService.start raises OSError when an older
        # grpc returns port 0), prometheus OSError(EADDRINUSE); another RuntimeError is a bug: re-raised.
        if isinstance(exc, RuntimeError) and "bind" not in str(exc).lower():
            raise
        await service.stop(0)  # the gRPC port may be up when the metrics port failed
        metrics = f", metrics port {service.metrics_port}" if service.metrics_port is not None else ""
        reason = str(exc).split(";")[0]  # grpc's message goes on about GRPC_VERBOSITY
        raise UsageError(f"cannot listen on {service.host}:{service.port}{metrics}: {reason}") from None

