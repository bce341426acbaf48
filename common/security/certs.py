"""A local certificate authority, a server certificate and client certificates, for TLS and mTLS.

For a local or test setup; production certificates come from your own CA. Needs the `cryptography`
package (`pip install -e '.[tls]'`). Keys are ECDSA P-256 and are written with mode 0600.

    paths = make_local_pki("certs/", server_names=["localhost", "127.0.0.1", "encoder"],
                           client_names=["decoder", "client"])
    # certs/ca.pem, certs/server.pem + server.key, certs/client-decoder.pem + .key, ...
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SERVER_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass
class LocalPki:
    """Where make_local_pki wrote each file."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)  # name -> (cert, key)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mmserve local"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: Sequence[str]):
    from cryptography import x509

    out = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def _issue(subject_cn: str, key, issuer_cert, issuer_key, days: int, *, server_names: Sequence[str] = (),
           client: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject_cn)).issuer_name(issuer_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(
                   [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                       ExtendedKeyUsageOID.CLIENT_AUTH]),
                   critical=False))
    # A client certificate names its identity in the CN (--auth-cert-service) and, for verifiers that
    # want one, in a DNS SAN too.
    names = list(server_names) if server_names else [subject_cn]
    builder = builder.add_extension(_san(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_local_pki(directory: str | Path, server_names: Sequence[str] = DEFAULT_SERVER_NAMES,
                   client_names: Sequence[str] = ("client",), days: int = 365,
                   ca_name: str = "mmserve local CA") -> LocalPki:
    """Write a CA, one server certificate valid for server_names, and one client certificate per name."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
    except ImportError:  # pragma: no cover - the tls extra is not installed
        raise RuntimeError("making certificates needs `cryptography`: pip install -e '.[tls]'") from None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    ca_cert = (x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    pki = LocalPki(out, out / "ca.pem", out / "ca.key", out / "server.pem", out / "server.key")
    _write_cert(pki.ca_cert, ca_cert)
    _write_key(pki.ca_key, ca_key)
    server_key = _key()
    _write_cert(pki.server_cert, _issue(server_names[0], server_key, ca_cert, ca_key, days,
                                        server_names=server_names))
    _write_key(pki.server_key, server_key)
    for name in client_names:
        key = _key()
        cert_path, key_path = out / f"client-{name}.pem", out / f"client-{name}.key"
        _write_cert(cert_path, _issue(name, key, ca_cert, ca_key, days, client=True))
        _write_key(key_path, key)
        pki.clients[name] = (cert_path, key_path)
    return pki
