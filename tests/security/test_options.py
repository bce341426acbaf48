"""Security options as a user meets them: one-line errors before any load, warnings, bind addresses."""

from __future__ import annotations

import asyncio
import logging

import pytest

from common.security.options import SecurityConfigError, ServerSecurity, server_security_from_args
from common.server import GrpcService
from tests.cli_errors import assert_usage_error, decoy_model, run_cli


def _server_args(*extra: str):
    import argparse

    from common.security.options import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(extra))


def test_server_options_that_cannot_work_are_refused(tmp_path, pki):
    (tmp_path / "tokens").write_text("tenant:a short\n")
    cases = [
        (["--auth-tokens", str(tmp_path / "missing")], "No such file"),
        (["--auth-tokens", str(tmp_path / "tokens")], "line 1.*shorter"),
        (["--tls-cert", str(pki.server_cert)], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", str(pki.ca_cert)], "--tls-client-ca needs"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(tmp_path / "nokey")], "--tls-key"),
        (["--auth-cert-service", "decoder"], "--auth-cert-service needs"),
    ]
    for extra, message in cases:
        with pytest.raises(SecurityConfigError, match=message):
            server_security_from_args(_server_args(*extra))
    assert server_security_from_args(_server_args()) == ServerSecurity()  # plaintext, no auth, reflection


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_bad_security_options_are_usage_errors_before_the_model_loads(service, tmp_path):
    model = str(decoy_model(tmp_path / "model"))
    base = [service, "--model", model, "--port", "0"] + (["--encoder", "127.0.0.1:1"] if service == "decoder"
                                                          else [])
    assert_usage_error(run_cli(*base, "--auth-tokens", str(tmp_path / "missing")), "--auth-tokens",
                       "No such file")
    if service == "decoder":
        assert_usage_error(run_cli(*base, "--encoder-tls-ca", str(tmp_path / "missing.pem")), "--tls-ca",
                           "No such file")


def test_plaintext_off_loopback_warns_and_metrics_stay_on_loopback(monkeypatch, caplog):
    bound = []
    monkeypatch.setattr("prometheus_client.start_http_server", lambda port, addr: bound.append(addr))

    async def scenario(host: str, security: ServerSecurity | None):
        server = GrpcService("warn-test", host, 0, metrics_port=9, security=security)
        await server.start()
        await server.stop(0)

    with caplog.at_level(logging.WARNING, logger="mmserve.server"):
        asyncio.run(scenario("0.0.0.0", None))
        assert "plaintext on 0.0.0.0" in caplog.text
        caplog.clear()
        asyncio.run(scenario("127.0.0.1", None))
        assert "plaintext" not in caplog.text
    asyncio.run(scenario("0.0.0.0", ServerSecurity(metrics_host="0.0.0.0")))
    assert bound == ["127.0.0.1", "127.0.0.1", "0.0.0.0"]
