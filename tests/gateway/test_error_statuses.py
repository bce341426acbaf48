"""Each gRPC status a decoder can answer, as the HTTP status and OpenAI error body the client sees
(a real gateway over a fake decoder that fails on demand), and a gateway with no live decoder."""

from __future__ import annotations

import httpx
import openai
import pytest

from bench.services import free_port
from tests.gateway.conftest import openai_client
from tests.gateway.harness import FAKE_PEER, GatewayProcess, start_failing_decoder

_5XX = openai.InternalServerError  # the client's class for every status >= 500
PASSED_ON = {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"}  # the decoder's own messages
# The decoder refusing the gateway's credentials is the server's problem: 502, never the client's 401/403.
STATUSES = [("INVALID_ARGUMENT", 400, openai.BadRequestError),
            ("UNAUTHENTICATED", 502, _5XX), ("PERMISSION_DENIED", 502, _5XX),
            ("NOT_FOUND", 404, openai.NotFoundError),
            ("RESOURCE_EXHAUSTED", 429, openai.RateLimitError), ("UNAVAILABLE", 503, _5XX),
            ("DEADLINE_EXCEEDED", 504, _5XX), ("INTERNAL", 500, _5XX), ("UNKNOWN", 500, _5XX),
            ("FAILED_PRECONDITION", 500, _5XX)]


@pytest.fixture(scope="module")
def fake_gateway(tmp_path_factory):
    server, address = start_failing_decoder()
    g = GatewayProcess([address], tmp_path_factory.mktemp("gw") / "gateway.log",
                       ["--served-model-name", "fake"]).start()
    yield g
    g.stop()
    server.stop(0)


@pytest.mark.parametrize("code, status, exc_type", STATUSES)
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_status_becomes_http_status(fake_gateway, code, status, exc_type, stream):
    client = openai_client(fake_gateway)
    with pytest.raises(exc_type) as err:
        reply = client.completions.create(model="fake", prompt=f"fail:{code}", max_tokens=2, stream=stream)
        list(reply) if stream else None
    assert err.value.status_code == status
    assert err.value.body["code"] == code.lower()
    message = err.value.body["message"]
    # The decoder's validation messages pass on; transport codes get a fixed message. No address ever.
    assert (f"fake decoder fails with {code}" in message) == (code in PASSED_ON), message
    assert "10.9.8.7" not in message and FAKE_PEER not in message
    assert set(err.value.body) == {"message", "type", "param", "code"}
    if status in (429, 503):  # real overload: worth a retry, and the client is told when
        assert err.value.response.headers.get("retry-after") == "1"


def test_chat_error_body_shape(fake_gateway):
    reply = httpx.post(f"{fake_gateway.url}/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "fail:RESOURCE_EXHAUSTED"}]})
    assert reply.status_code == 429
    assert reply.json() == {"error": {"message": "fake decoder fails with RESOURCE_EXHAUSTED at <address>",
                                      "type": "rate_limit_error", "param": None,
                                      "code": "resource_exhausted"}}


def test_error_after_the_first_token_ends_the_stream_with_an_error_event(fake_gateway):
    client = openai_client(fake_gateway)
    messages = [{"role": "user", "content": "fail-after-one:RESOURCE_EXHAUSTED"}]
    stream = client.chat.completions.create(model="fake", messages=messages, stream=True)
    texts = []
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content)
    assert "a" in texts  # the first token went out before the error
    assert "RESOURCE_EXHAUSTED mid-stream" in err.value.message


def test_successful_fake_generation(fake_gateway):
    reply = openai_client(fake_gateway).completions.create(model="fake", prompt="hello", max_tokens=2)
    assert reply.choices[0].text == "ab" and reply.choices[0].finish_reason == "length"
    assert reply.usage.total_tokens == 5


def test_no_live_decoder_is_503_and_unhealthy(tmp_path):
    g = GatewayProcess([f"127.0.0.1:{free_port()}"], tmp_path / "gateway.log",
                       ["--served-model-name", "none"]).start(wait_healthy=False)
    try:
        health = httpx.get(f"{g.url}/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        with pytest.raises(openai.InternalServerError) as err:
            openai_client(g).completions.create(model="none", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "unavailable"
        assert "127.0.0.1" not in err.value.response.text and "ipv4" not in err.value.response.text
    finally:
        g.stop()
