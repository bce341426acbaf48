"""Command-line flags for transport security and authentication, and what they turn into.

Servers: --tls-cert/--tls-key [--tls-client-ca] [--auth-tokens FILE] [--auth-cert-service CN]
[--reflection] [--metrics-host] [--allow-plaintext-tokens]. Clients: --tls-ca [--tls-cert --tls-key]
[--tls-server-name] [--token-file] [--allow-plaintext-token]; a token without TLS off loopback is refused
(common/security/plaintext.py) unless allowed. Each has an environment default (MMSERVE_*), so
`mmserve up --tls` can print one `export` line that the other commands then pick up.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import UsageError
from common.security.auth import AuthPolicy
from common.security.identity import valid_name
from common.security.plaintext import (
    CLIENT_OPT_IN,
    SERVER_OPT_IN,
    PlaintextTokenError,
    check_client_token,
    check_server_tokens,
)
from common.security.tls import ClientTls, ServerTls, TlsConfigError
from common.security.tokens import TokenFileError, TokenTable, read_token


class SecurityConfigError(UsageError):
    """Security options that do not fit together or files that cannot be used (exit code 2)."""


@dataclass(frozen=True)
class ServerSecurity:
    """What a server needs: TLS (None: plaintext), authentication (None: off), reflection, metrics host."""

    tls: ServerTls | None = None
    auth: AuthPolicy | None = None
    reflection: bool = True
    metrics_host: str = "127.0.0.1"


@dataclass(frozen=True)
class ClientSecurity:
    """What a client needs: TLS (None: plaintext) and a bearer token (None: none)."""

    tls: ClientTls | None = None
    token: str | None = None


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The server-side security flags (encoder and decoder)."""
    g = p.add_argument_group("security (docs/security.md)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate chain")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="require client certificates signed by this CA (mutual TLS)")
    g.add_argument("--auth-tokens", default=os.environ.get("MMSERVE_AUTH_TOKENS"), metavar="FILE",
                   help="bearer-token file mapping tokens to tenants and services; every RPC but health "
                   "then needs `authorization: Bearer <token>` [$MMSERVE_AUTH_TOKENS]")
    g.add_argument("--auth-cert-service", action="append", default=[], metavar="CN",
                   help="a client certificate with this common name authenticates as service CN "
                   "(needs --tls-client-ca and --auth-tokens; repeatable)")
    g.add_argument("--reflection", action="store_true",
                   help="serve reflection even with --auth-tokens (it is on without them)")
    g.add_argument("--metrics-host", default="127.0.0.1",
                   help="bind address of --metrics-port (the metrics endpoint has no authentication)")
    g.add_argument(SERVER_OPT_IN, action="store_true",
                   help="accept --auth-tokens without TLS on a --host off loopback (tokens then cross the "
                   "network in plaintext: a trusted network or a TLS sidecar only)")


def server_security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """ServerSecurity from parsed flags; raises SecurityConfigError with a message for the user."""
    try:
        tls = None
        if args.tls_cert or args.tls_key:
            if not (args.tls_cert and args.tls_key):
                raise SecurityConfigError("--tls-cert and --tls-key go together")
            tls = ServerTls.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)
        elif args.tls_client_ca:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        auth = None
        if args.auth_cert_service and not (tls and tls.mutual and args.auth_tokens):
            raise SecurityConfigError("--auth-cert-service needs --tls-client-ca and --auth-tokens")
        bad = [n for n in args.auth_cert_service if not valid_name(n)]
        if bad:
            raise SecurityConfigError(f"--auth-cert-service {bad[0]!r}: not a valid service name")
        if args.auth_tokens:
            auth = AuthPolicy(TokenTable.load(args.auth_tokens), frozenset(args.auth_cert_service))
        # The parser's --host (both services have one); a parser without it binds loopback.
        check_server_tokens(getattr(args, "host", "127.0.0.1"), tls is not None, auth is not None,
                            args.allow_plaintext_tokens)
    except (TlsConfigError, TokenFileError, PlaintextTokenError) as exc:
        raise SecurityConfigError(str(exc)) from None
    return ServerSecurity(tls=tls, auth=auth, reflection=auth is None or args.reflection,
                          metrics_host=args.metrics_host)


def add_client_args(p: argparse.ArgumentParser, prefix: str = "", what: str = "the server") -> None:
    """Client-side flags; prefix (e.g. "encoder-") names the link when a server is also a client."""
    env = "MMSERVE_" + prefix.upper().replace("-", "_")
    g = p.add_argument_group(f"security of the link to {what} (docs/security.md)")
    g.add_argument(f"--{prefix}tls-ca", default=os.environ.get(f"{env}TLS_CA"), metavar="PEM",
                   help=f"connect with TLS, trusting this CA [${env}TLS_CA]")
    g.add_argument(f"--{prefix}tls-cert", default=os.environ.get(f"{env}TLS_CERT"), metavar="PEM",
                   help=f"client certificate for mutual TLS [${env}TLS_CERT]")
    g.add_argument(f"--{prefix}tls-key", default=os.environ.get(f"{env}TLS_KEY"), metavar="PEM",
                   help=f"its private key [${env}TLS_KEY]")
    g.add_argument(f"--{prefix}tls-server-name", default=os.environ.get(f"{env}TLS_SERVER_NAME"),
                   metavar="NAME", help="the name to check in the server's certificate (default: the host)")
    g.add_argument(f"--{prefix}token-file", default=os.environ.get(f"{env}TOKEN_FILE"), metavar="FILE",
                   help=f"send the bearer token in FILE [${env}TOKEN_FILE; or the token itself in "
                   f"${env}TOKEN]")
    g.add_argument(f"--{prefix}{CLIENT_OPT_IN.removeprefix('--')}", action="store_true",
                   help="send the token without TLS to an address off loopback (in plaintext: a trusted "
                   "network only)")


def client_security_from_args(args: argparse.Namespace, prefix: str = "",
                              targets: Sequence[str] = ()) -> ClientSecurity:
    """ClientSecurity from parsed flags (see add_client_args); raises SecurityConfigError, also for a
    token that would go without TLS to one of `targets` off loopback (without the opt-in flag)."""
    attr = prefix.replace("-", "_")
    ca, cert, key = (getattr(args, f"{attr}tls_{n}") for n in ("ca", "cert", "key"))
    server_name = getattr(args, f"{attr}tls_server_name")
    token_file = getattr(args, f"{attr}token_file")
    try:
        tls = None
        if ca or cert or key:
            tls = ClientTls.from_files(ca, cert, key, server_name)
        token = read_token(token_file) if token_file else None
    except (TlsConfigError, TokenFileError) as exc:
        raise SecurityConfigError(str(exc)) from None
    if token is None:
        token = os.environ.get("MMSERVE_" + prefix.upper().replace("-", "_") + "TOKEN") or None
    try:
        check_client_token(targets, tls is not None, token is not None,
                           getattr(args, f"{attr}allow_plaintext_token", False),
                           flag=f"--{prefix}token-file", tls_flag=f"--{prefix}tls-ca",
                           opt_in=f"--{prefix}{CLIENT_OPT_IN.removeprefix('--')}")
    except PlaintextTokenError as exc:
        raise SecurityConfigError(str(exc)) from None
    return ClientSecurity(tls=tls, token=token)
