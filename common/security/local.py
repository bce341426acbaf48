"""Certificates and tokens for `mmserve up --tls`, made once in a directory and reused after.

    ca.pem, server.pem/.key           the services' certificate (localhost, 127.0.0.1, ::1, extra names)
    client-decoder.pem/.key           the decoder's identity at the encoder (mutual TLS)
    client-client.pem/.key            a client certificate for tools (the encoder requires one)
    tokens                            the --auth-tokens file: one tenant, `default`
    token                             that tenant's token, for clients (MMSERVE_TOKEN_FILE)
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.security.certs import DEFAULT_SERVER_NAMES, make_local_pki

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class LocalSecurity:
    """Paths of the files ensure_local_security made or found."""

    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name

    def encoder_args(self) -> list[str]:
        """Mutual TLS and tokens; the `decoder` certificate is the decoder's service identity."""
        return ["--tls-cert", str(self.path("server.pem")), "--tls-key", str(self.path("server.key")),
                "--tls-client-ca", str(self.path("ca.pem")), "--auth-tokens", str(self.path("tokens")),
                "--auth-cert-service", "decoder"]

    def decoder_args(self) -> list[str]:
        """TLS and tokens for clients; mutual TLS as `decoder` towards the encoder."""
        return ["--tls-cert", str(self.path("server.pem")), "--tls-key", str(self.path("server.key")),
                "--auth-tokens", str(self.path("tokens")), "--encoder-tls-ca", str(self.path("ca.pem")),
                "--encoder-tls-cert", str(self.path("client-decoder.pem")),
                "--encoder-tls-key", str(self.path("client-decoder.key"))]

    def gateway_args(self) -> list[str]:
        """TLS and the tenant's token towards the decoder (which requires a token under --tls)."""
        return ["--tls-ca", str(self.path("ca.pem")), "--token-file", str(self.path("token"))]

    def client_env(self) -> dict[str, str]:
        """The environment that gives `mmserve generate/stats/health` TLS, a client certificate and the
        token."""
        return {"MMSERVE_TLS_CA": str(self.path("ca.pem")),
                "MMSERVE_TLS_CERT": str(self.path("client-client.pem")),
                "MMSERVE_TLS_KEY": str(self.path("client-client.key")),
                "MMSERVE_TOKEN_FILE": str(self.path("token"))}


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def ensure_local_security(directory: str | Path, server_names: Sequence[str] = ()) -> LocalSecurity:
    """Make the files above unless they exist (a new host name means a new certificate set)."""
    out = Path(directory)
    names = list(dict.fromkeys([*DEFAULT_SERVER_NAMES, *server_names]))
    marker, listed = out / "server-names", "\n".join(names)
    fresh = (out / "client-client.key").exists() and marker.exists() and marker.read_text() == listed
    if not fresh:
        make_local_pki(out, server_names=names, client_names=["decoder", "client"])
        marker.write_text(listed)
    if not (out / "tokens").exists() or not (out / "token").exists():
        token = secrets.token_urlsafe(32)
        _write_private(out / "tokens", f"# made by mmserve up --tls\ntenant:{DEFAULT_TENANT} {token}\n")
        _write_private(out / "token", token + "\n")
    return LocalSecurity(out)
