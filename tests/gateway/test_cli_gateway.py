"""`mmserve gateway`'s user errors: one line on stderr, exit 2, before anything starts."""

from __future__ import annotations

from tests.cli_errors import assert_usage_error, busy_port, run_cli


def test_gateway_usage_errors(tmp_path):
    assert_usage_error(run_cli("gateway", timeout=30), "--decoder")
    with busy_port() as port:
        assert_usage_error(run_cli("gateway", "--decoder", "127.0.0.1:1", "--port", str(port), timeout=30),
                           f"--port {port}", "already in use")
    assert_usage_error(run_cli("gateway", "--decoder", "x:1", "--model", str(tmp_path), timeout=30),
                       "--model", "not a checkpoint directory")
    assert_usage_error(run_cli("gateway", "--decoder", "x:1", "--request-timeout", "0", timeout=30),
                       "--request-timeout")
