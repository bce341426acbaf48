"""Bearer tokens never cross the network in plaintext unless the user says so.

A token sent (a client's --token-file) or taken (a server's --auth-tokens) without TLS is readable by
anyone on the path. On loopback that path is this machine; anywhere else, the combination is refused at
start with one line, unless the explicit opt-in flag is given (a trusted private network, a TLS-
terminating sidecar).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from common.errors import UsageError

CLIENT_OPT_IN = "--allow-plaintext-token"
SERVER_OPT_IN = "--allow-plaintext-tokens"


class PlaintextTokenError(UsageError):
    """A token would travel in plaintext off this machine (exit code 2, one line)."""


def host_of(address: str) -> str:
    """The host of a gRPC target or bind address: `h:port`, `[v6]:port`, `dns:///h:port`, `ipv4:h:port`;
    `unix:...` is returned as is."""
    if address.startswith(("unix:", "unix-abstract:")):
        return address
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        address = address.removeprefix(scheme)
    if address.startswith("["):
        return address[1:].partition("]")[0]
    if address.count(":") > 1:  # a bare IPv6 address without a port
        return address
    return address.rpartition(":")[0] if ":" in address else address


def is_loopback(address: str) -> bool:
    """Whether a target or bind address stays on this machine: a loopback IP, `localhost`, or a Unix
    socket. Any other name could resolve anywhere, so it is not."""
    host = host_of(address)
    if host.startswith(("unix:", "unix-abstract:")) or host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_client_token(targets: Sequence[str], tls: bool, token: bool, allowed: bool,
                       flag: str = "--token-file", tls_flag: str = "--tls-ca",
                       opt_in: str = CLIENT_OPT_IN) -> None:
    """Refuse a token sent without TLS to a target off this machine, unless allowed."""
    if not token or tls or allowed:
        return
    remote = [t for t in targets if not is_loopback(t)]
    if remote:
        raise PlaintextTokenError(
            f"{flag} without {tls_flag} would send the bearer token in plaintext to {remote[0]}: give "
            f"{tls_flag} (mmserve up --tls makes a CA), connect over loopback, or pass {opt_in}")


def check_server_tokens(bind_host: str, tls: bool, auth: bool, allowed: bool) -> None:
    """Refuse --auth-tokens without TLS on a bind address off this machine, unless allowed."""
    if not auth or tls or allowed or is_loopback(bind_host):
        return
    raise PlaintextTokenError(
        f"--auth-tokens without --tls-cert on --host {bind_host} would take bearer tokens in plaintext from "
        f"the network: give --tls-cert/--tls-key (mmserve up --tls makes them), bind --host 127.0.0.1, or "
        f"pass {SERVER_OPT_IN}")
