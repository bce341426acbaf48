"""TLS credentials for servers and channels, from PEM files.

A server with `client_ca` set requires and verifies client certificates (mutual TLS); without it, any
client that trusts the server's certificate may connect (and authenticates with a token, if asked).
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """A TLS option that cannot work (a missing file, a key without its certificate)."""


def _read(path: str | Path | None, option: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{option} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"{option} {path}: not a PEM file")
    return data


def _check_certificates(data: bytes | None, path: str | Path | None, option: str) -> None:
    """TlsConfigError unless data holds at least one parseable X.509 certificate."""
    if data is None:
        return
    try:
        ssl.create_default_context(cadata=data.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise TlsConfigError(f"{option} {path}: not a valid PEM certificate ({exc})") from None


def _check_key_pair(cert: str | Path | None, key: str | Path | None, cert_option: str,
                    key_option: str) -> None:
    """TlsConfigError naming the file and the problem: a key that is unreadable or not the
    certificate's own (rather than gRPC's later, misleading "Failed to bind to address")."""
    if cert is None or key is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TlsConfigError(f"{key_option} {key}: does not match the certificate in {cert_option} "
                                 f"{cert}") from None
        raise TlsConfigError(f"{key_option} {key}: not a usable PEM private key ({exc})") from None


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate chain and key; client_ca turns on mutual TLS."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> ServerTls:
        """Load PEM files; raises TlsConfigError naming the option, the file and the problem."""
        tls = cls(_read(cert, "--tls-cert"), _read(key, "--tls-key"), _read(client_ca, "--tls-client-ca"))
        _check_certificates(tls.cert_chain, cert, "--tls-cert")
        _check_certificates(tls.client_ca, client_ca, "--tls-client-ca")
        _check_key_pair(cert, key, "--tls-cert", "--tls-key")
        return tls

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientTls:
    """What a client trusts (ca; None means the system roots) and, for mutual TLS, its own cert and key.

    server_name overrides the name checked against the server's certificate (for a certificate made
    for a name other than the address dialled).
    """

    ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None,
                   key: str | Path | None = None, server_name: str | None = None) -> ClientTls:
        """Load PEM files; a certificate needs its key and the other way round."""
        if (cert is None) != (key is None):
            raise TlsConfigError("--tls-cert and --tls-key go together (a client certificate needs its key)")
        tls = cls(_read(ca, "--tls-ca"), _read(cert, "--tls-cert"), _read(key, "--tls-key"), server_name)
        _check_certificates(tls.ca, ca, "--tls-ca")
        _check_certificates(tls.cert_chain, cert, "--tls-cert")
        _check_key_pair(cert, key, "--tls-cert", "--tls-key")
        return tls

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def open_channel(address: str, tls: ClientTls | None, options: Sequence[tuple] = (),
                 interceptors: Sequence = ()) -> grpc.Channel:
    """A blocking channel: TLS when tls is given, plaintext otherwise; client interceptors on top."""
    opts = [*options, *(tls.channel_options() if tls else [])]
    channel = (grpc.secure_channel(address, tls.credentials(), options=opts) if tls
               else grpc.insecure_channel(address, options=opts))
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def open_aio_channel(address: str, tls: ClientTls | None, options: Sequence[tuple] = (),
                     interceptors: Sequence = ()) -> grpc.aio.Channel:
    """An asyncio channel: TLS when tls is given, plaintext otherwise."""
    opts = [*options, *(tls.channel_options() if tls else [])]
    inter = list(interceptors) or None
    if tls:
        return grpc.aio.secure_channel(address, tls.credentials(), options=opts, interceptors=inter)
    return grpc.aio.insecure_channel(address, options=opts, interceptors=inter)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost": addresses no other host can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
