"""The decoder refusing the gateway's own credentials (its --token-file or certificate) is a server
problem: the client gets 502 with a server_error body, never the 401/403 that blames its API key.
In-process over a fake decoder."""

from __future__ import annotations

import pytest

from tests.gateway.inprocess import fake_decoder, gateway_client


@pytest.mark.parametrize("code", ["UNAUTHENTICATED", "PERMISSION_DENIED"])
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_auth_failure_is_502_not_401(code, stream):
    with fake_decoder() as (_, address), gateway_client(address) as client:
        body = {"model": "m", "prompt": f"fail:{code}", "max_tokens": 2, "stream": stream}
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 502, reply.text
        error = reply.json()["error"]
        assert error["type"] == "server_error" and "gateway's credentials" in error["message"]
        assert "retry-after" not in reply.headers  # a configuration fault: retrying will not help
