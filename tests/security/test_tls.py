"""TLS and mutual TLS with certificates from make_local_pki, through grpcio and a second gRPC stack."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.client import EncoderClient
from common.health import health_status
from common.security.options import ServerSecurity
from common.security.tls import ClientTls, ServerTls, TlsConfigError, is_loopback
from tests.security.conftest import RecordingServicer, ServerThread


@pytest.fixture(scope="module")
def tls_server(pki):
    server = ServerThread(RecordingServicer(), ServerSecurity(tls=ServerTls.from_files(pki.server_cert,
                                                                                       pki.server_key)))
    yield server
    server.close()


@pytest.fixture(scope="module")
def mtls_server(pki):
    tls = ServerTls.from_files(pki.server_cert, pki.server_key, client_ca=pki.ca_cert)
    server = ServerThread(RecordingServicer(), ServerSecurity(tls=tls))
    yield server
    server.close()


def _stats(address: str, tls: ClientTls | None) -> int:
    with EncoderClient(address, timeout=5, tls=tls) as client:
        return client.stats().entries


def test_tls_handshake_with_generated_certificates(tls_server, pki):
    tls = ClientTls.from_files(ca=pki.ca_cert)
    assert _stats(tls_server.address, tls) == 7
    assert health_status(tls_server.address, tls=tls) == "SERVING"


def test_tls_refuses_plaintext_and_untrusted_clients(tls_server, other_pki):
    with pytest.raises(grpc.RpcError) as err:
        _stats(tls_server.address, None)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:  # a client that trusts another CA
        _stats(tls_server.address, ClientTls.from_files(ca=other_pki.ca_cert))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_checks_the_server_name(tls_server, pki):
    # The certificate is for localhost/127.0.0.1/::1: a client expecting another name refuses it.
    with pytest.raises(grpc.RpcError) as err:
        _stats(tls_server.address, ClientTls.from_files(ca=pki.ca_cert, server_name="encoder.example"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_client_without_a_certificate(mtls_server, pki, other_pki):
    with pytest.raises(grpc.RpcError) as err:
        _stats(mtls_server.address, ClientTls.from_files(ca=pki.ca_cert))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    cert, key = other_pki.clients["decoder"]  # a certificate from a CA the server does not trust
    with pytest.raises(grpc.RpcError) as err:
        _stats(mtls_server.address, ClientTls.from_files(ca=pki.ca_cert, cert=cert, key=key))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    cert, key = pki.clients["client"]
    assert _stats(mtls_server.address, ClientTls.from_files(ca=pki.ca_cert, cert=cert, key=key)) == 7


def test_a_second_grpc_stack_connects_with_the_ca_file(tls_server, pki):
    """grpclib (pure-Python HTTP/2 + the ssl module), like grpc-js, is not grpcio's C core: it needs only
    the CA file, ALPN h2 and a certificate whose SAN names the address dialled."""
    from grpclib.client import Channel, UnaryUnaryMethod

    from common.pb import common_pb2, encoder_pb2

    async def scenario():
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        context.set_alpn_protocols(["h2"])
        channel = Channel("127.0.0.1", tls_server.port, ssl=context)
        try:
            check = UnaryUnaryMethod(channel, "/grpc.health.v1.Health/Check",
                                     health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
            reply = await check(health_pb2.HealthCheckRequest(), timeout=5)
            stats = UnaryUnaryMethod(channel, "/mmserve.v1.EncoderService/GetStats",
                                     common_pb2.StatsRequest, encoder_pb2.EncoderStats)
            return reply.status, (await stats(common_pb2.StatsRequest(), timeout=5)).entries
        finally:
            channel.close()

    assert asyncio.run(scenario()) == (health_pb2.HealthCheckResponse.SERVING, 7)


def test_tls_config_errors_name_the_option(tmp_path, pki):
    with pytest.raises(TlsConfigError, match="--tls-cert"):
        ServerTls.from_files(tmp_path / "missing.pem", pki.server_key)
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TlsConfigError, match="--tls-ca .*not a PEM"):
        ClientTls.from_files(ca=tmp_path / "junk.pem")
    with pytest.raises(TlsConfigError, match="go together"):
        ClientTls.from_files(ca=pki.ca_cert, cert=pki.clients["client"][0])


def test_loopback_detection():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "encoder"))


def test_tls_start_up_errors_name_the_file_and_the_problem(tmp_path, pki):
    """A garbage certificate or a key of another certificate is refused at start-up, with the file and
    the problem named (gRPC itself would say only "Failed to bind to address")."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")
    with pytest.raises(TlsConfigError, match=f"--tls-cert {garbage}: not a valid PEM certificate"):
        ServerTls.from_files(garbage, pki.server_key)
    other_cert, other_key = pki.clients["client"]
    with pytest.raises(TlsConfigError, match=f"--tls-key {other_key}: does not match the certificate"):
        ServerTls.from_files(pki.server_cert, other_key)
    bad_key = tmp_path / "bad.key"
    bad_key.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(TlsConfigError, match=f"--tls-key {bad_key}: not a usable PEM private key"):
        ServerTls.from_files(pki.server_cert, bad_key)
    with pytest.raises(TlsConfigError, match="--tls-key .*does not match"):
        ClientTls.from_files(ca=pki.ca_cert, cert=other_cert, key=pki.server_key)
    ServerTls.from_files(pki.server_cert, pki.server_key, pki.ca_cert)  # the matching pair loads
