"""A bearer token never crosses the network in plaintext by accident: a client's token without TLS to an
address off loopback, and a server's --auth-tokens without TLS on a bind address off loopback, are
refused at start with one line naming the opt-in flag."""

from __future__ import annotations

import argparse

import pytest

from common.security.options import (
    SecurityConfigError,
    add_client_args,
    add_server_args,
    client_security_from_args,
    server_security_from_args,
)
from common.security.plaintext import PlaintextTokenError, check_client_token, is_loopback
from gateway.main import main as gateway_main


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:50052", True), ("127.8.9.1:1", True), ("[::1]:50052", True), ("localhost:50052", True),
    ("::1", True), ("unix:/tmp/s.sock", True), ("ipv4:127.0.0.1:5", True), ("dns:///localhost:5", True),
    ("10.0.0.5:50052", False), ("0.0.0.0", False), ("[2001:db8::1]:1", False), ("decoder:50052", False),
    ("localhost.evil.com:1", False), ("::", False)])
def test_loopback_addresses(address, loopback):
    assert is_loopback(address) is loopback


def _server(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    add_server_args(parser)
    return parser.parse_args(list(argv))


def test_services_refuse_tokens_without_tls_off_loopback(tokens_file, pki):
    tokens = ["--auth-tokens", str(tokens_file)]
    with pytest.raises(SecurityConfigError, match="--allow-plaintext-tokens") as err:
        server_security_from_args(_server("--host", "0.0.0.0", *tokens))
    assert "--host 0.0.0.0" in str(err.value) and "\n" not in str(err.value)
    assert server_security_from_args(_server("--host", "0.0.0.0", *tokens, "--allow-plaintext-tokens")).auth
    assert server_security_from_args(_server(*tokens)).auth  # loopback: stays on this machine
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    assert server_security_from_args(_server("--host", "0.0.0.0", *tokens, *tls)).tls
    assert server_security_from_args(_server("--host", "0.0.0.0")).auth is None  # no tokens: nothing to leak


def _gateway(argv: list[str], capsys) -> tuple[int | None, str]:
    """gateway main() up to serving (not served: a stub stops it there): (exit code, stderr)."""
    try:
        code = gateway_main(["--port", "0", *argv])
    except _Served:
        code = None
    return code, capsys.readouterr().err


class _Served(Exception):
    pass


def test_gateway_refuses_a_token_in_plaintext_to_a_remote_decoder(tmp_path, pki, capsys, monkeypatch):
    token = tmp_path / "token"
    token.write_text("a-token-long-enough-for-any-check\n")

    def serve(config):
        raise _Served()

    monkeypatch.setattr("gateway.main.serve", serve)
    monkeypatch.delenv("MMSERVE_TOKEN", raising=False)
    remote = ["--decoder", "10.1.2.3:50052", "--token-file", str(token)]
    code, err = _gateway(remote, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "plaintext to 10.1.2.3:50052" in err and "--allow-plaintext-token" in err
    assert _gateway([*remote, "--allow-plaintext-token"], capsys)[0] is None
    assert _gateway([*remote, "--tls-ca", str(pki.ca_cert)], capsys)[0] is None
    assert _gateway(["--decoder", "127.0.0.1:50052", "--token-file", str(token)], capsys)[0] is None
    assert _gateway(["--decoder", "10.1.2.3:50052"], capsys)[0] is None  # no token: nothing to leak


def test_services_stop_at_start_with_one_line(tmp_path, tokens_file, capsys, monkeypatch):
    from decoder_svc.main import main as decoder_main
    from encoder_svc.main import main as encoder_main
    from tests.cli_errors import decoy_model

    model = str(decoy_model(tmp_path / "model"))  # refused before any load: it would fail to load
    token = tmp_path / "encoder-token"
    token.write_text("a-token-long-enough-for-any-check\n")
    monkeypatch.delenv("MMSERVE_ENCODER_TOKEN", raising=False)
    cases = [
        (encoder_main, ["--host", "0.0.0.0", "--auth-tokens", str(tokens_file)], "--allow-plaintext-tokens"),
        (decoder_main, ["--encoder", "10.0.0.7:50051", "--encoder-token-file", str(token)],
         "--encoder-allow-plaintext-token"),
    ]
    for main, argv, opt_in in cases:
        assert main(["--model", model, "--port", "0", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "plaintext" in err[-1] and opt_in in err[-1], err


def _client(prefix: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_client_args(parser, prefix)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("prefix", ["", "encoder-"])
def test_a_token_from_the_environment_is_refused_in_plaintext_off_loopback(prefix, monkeypatch):
    """Options only: nothing connects. A token in $MMSERVE_[ENCODER_]TOKEN is a token like one in a file."""
    env = "MMSERVE_" + prefix.upper().replace("-", "_")
    for name in ("TOKEN_FILE", "TLS_CA", "TLS_CERT", "TLS_KEY", "TLS_SERVER_NAME"):
        monkeypatch.delenv(env + name, raising=False)
    monkeypatch.setenv(env + "TOKEN", "an-environment-token-long-enough")
    remote = ["127.0.0.1:50052", "10.1.2.3:50052"]
    with pytest.raises(SecurityConfigError, match="plaintext to 10.1.2.3:50052") as err:
        client_security_from_args(_client(prefix), prefix, remote)
    assert f"--{prefix}allow-plaintext-token" in str(err.value)
    allowed = client_security_from_args(_client(prefix, f"--{prefix}allow-plaintext-token"), prefix, remote)
    assert allowed.token == "an-environment-token-long-enough"
    assert client_security_from_args(_client(prefix), prefix, ["127.0.0.1:50052"]).token
    monkeypatch.delenv(env + "TOKEN")
    assert client_security_from_args(_client(prefix), prefix, remote).token is None  # nothing to leak


def test_every_target_is_checked_not_only_the_first():
    targets = ["127.0.0.1:50051", "localhost:50052", "10.0.0.9:50053"]
    with pytest.raises(PlaintextTokenError, match="plaintext to 10.0.0.9:50053"):
        check_client_token(targets, tls=False, token=True, allowed=False)
    check_client_token(targets[:2], tls=False, token=True, allowed=False)  # all on loopback
    check_client_token(targets, tls=True, token=True, allowed=False)
