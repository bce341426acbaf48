"""The gateway's parts without servers: balancing, address checks, data URLs, image fetching, request
translation, error mapping, cache salts."""

from __future__ import annotations

import asyncio
import base64

import grpc
import pytest
from starlette.requests import Request

from common.images import encode_png
from gateway import images as images_module
from gateway.app import Gateway
from gateway.balancer import DecoderEndpoint, DecoderPool
from gateway.config import GatewayConfig
from gateway.errors import APIError, http_status_of
from gateway.images import ImageFetcher, ImageFetchPolicy, decode_data_url, is_public_address
from gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from gateway.translate import chat_request, completion_request
from tests.gateway.harness import ImageServer
from tests.oracle import make_image

PNG = encode_png(make_image(3, (20, 20)))


def test_least_outstanding_wins_ties_rotate_and_unhealthy_are_skipped():
    a, b, c = (DecoderEndpoint(x) for x in "abc")
    pool = DecoderPool([a, b, c])
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert pool.pick() is b
    b.outstanding = 5
    assert pool.pick() is c
    a.outstanding = b.outstanding = c.outstanding = 0
    assert {pool.pick().address for _ in range(6)} == {"a", "b", "c"}  # ties are taken in turn
    b.status = c.status = "UNREACHABLE"
    assert {pool.pick().address for _ in range(6)} == {"a"}
    assert pool.pick(exclude=[a]).address in ("b", "c")  # only down ones left: try them anyway
    assert pool.pick(exclude=[a, b, c]) is None


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("224.0.0.1", False), ("::1", False), ("fe80::1%eth0", False), ("fd00::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:8.8.8.8", True)])
def test_public_addresses(address, public):
    assert is_public_address(address) is public


def test_data_urls():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert decode_data_url(url, 10**6, "p") == PNG
    assert decode_data_url("data:text/plain,a%20b", 10**6, "p") == b"a b"
    for bad, code in (("data:image/png;base64,@@@", None), ("data:image/png;base64", None),
                      (url, "image_too_large")):
        with pytest.raises(APIError) as err:
            decode_data_url(bad, 100, "messages.0.content.0.image_url")
        assert err.value.status == 400 and err.value.param == "messages.0.content.0.image_url"
        assert err.value.code == code


def _fetch(policy: ImageFetchPolicy, url: str) -> bytes:
    async def run() -> bytes:
        fetcher = ImageFetcher(policy)
        try:
            return await fetcher.fetch(url, "img")
        finally:
            await fetcher.close()

    return asyncio.run(run())


def test_fetch_pins_the_checked_address_and_checks_every_redirect(monkeypatch):
    # Pretend 127.0.0.1 is public to exercise the checked path; any other address stays private.
    monkeypatch.setattr(images_module, "is_public_address", lambda a: a == "127.0.0.1")
    # The redirect's target is refused before any connection: nothing needs to listen there.
    with ImageServer({"cat.png": PNG}, redirects={"to-private": "http://127.0.0.2:9/cat.png"}) as server:
        policy = ImageFetchPolicy()
        assert _fetch(policy, f"{server.url}/cat.png") == PNG
        assert _fetch(policy, f"{server.url}/redirect/cat.png") == PNG
        with pytest.raises(APIError) as err:
            _fetch(policy, f"{server.url}/to-private")
        assert err.value.code == "image_url_forbidden" and "127.0.0.2" in err.value.message


def test_fetch_refuses_private_hosts_unless_allowed_and_enforces_limits():
    with ImageServer({"cat.png": PNG, "slow.png": PNG}, slow=("slow.png",)) as server:
        with pytest.raises(APIError) as err:
            _fetch(ImageFetchPolicy(), f"{server.url}/cat.png")
        assert err.value.code == "image_url_forbidden"
        allowed = ImageFetchPolicy(allow_private=True, timeout_s=1.0, max_bytes=len(PNG))
        assert _fetch(allowed, f"{server.url}/cat.png") == PNG
        for path, code in (("slow.png", "image_fetch_timeout"), ("nope.png", "image_fetch_failed")):
            with pytest.raises(APIError) as err:
                _fetch(allowed, f"{server.url}/{path}")
            assert err.value.code == code
        with pytest.raises(APIError) as err:
            _fetch(ImageFetchPolicy(allow_private=True, max_bytes=len(PNG) - 1), f"{server.url}/cat.png")
        assert err.value.code == "image_too_large"
    for url in ("ftp://example.com/x.png", "file:///etc/passwd"):
        with pytest.raises(APIError):
            _fetch(ImageFetchPolicy(), url)


def test_translation_follows_openai_defaults():
    chat = parse_body(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 5, "max_completion_tokens": 7, "top_p": 1.0, "top_k": -1, "seed": 3, "stop": "x",
        "logprobs": True})
    out = asyncio.run(chat_request(chat, None, "salt"))
    s = out.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop), s.logprobs) == (
        7, 1.0, 0.0, 0, 3, ["x"], 1)
    assert [m.role for m in out.chat.messages] == ["system", "user"] and out.cache_salt == "salt"
    body = {"model": "m", "prompt": ["p"], "temperature": 0}
    text = completion_request(parse_body(CompletionRequest, body), "")
    assert text.prompt == "p" and text.sampling.max_tokens == 16 and text.sampling.temperature == 0
    assert not text.sampling.HasField("seed") and text.sampling.logprobs == 0
    with_logprobs = completion_request(parse_body(CompletionRequest, {**body, "logprobs": 0}), "")
    assert with_logprobs.sampling.logprobs == 1  # the sampled token's logprob, no alternatives


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:,x"}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "two words", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.image_url.url"),
    ({"messages": []}, "messages"),
])
def test_bad_chat_requests_are_400_naming_the_parameter(body, param):
    with pytest.raises(APIError) as err:
        asyncio.run(chat_request(parse_body(ChatCompletionRequest, {"model": "m", **body}), None, ""))
    assert err.value.status == 400 and err.value.param == param


def test_grpc_codes_map_to_http_statuses():
    expected = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
    for code in grpc.StatusCode:
        assert http_status_of(code) == expected.get(code.name, 400 if code.name == "OUT_OF_RANGE" else 500)


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "headers": raw})


def test_api_keys_are_tenants_and_the_salt_header_splits_a_tenant():
    gw = Gateway(GatewayConfig(decoders=["x:1"], api_keys=["ka", "kb"]))
    a, b = (gw.authorize(_request({"Authorization": f"Bearer {k}"})) for k in ("ka", "kb"))
    salt_a, salt_b = gw.cache_salt(_request({}), a, None), gw.cache_salt(_request({}), b, None)
    assert salt_a != salt_b and "ka" not in salt_a  # the key itself never becomes a salt
    assert gw.cache_salt(_request({"X-Cache-Salt": "p"}), a, None) == f"{salt_a}/p"
    assert gw.cache_salt(_request({}), a, "q") == f"{salt_a}/q"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic ka"}):
        with pytest.raises(APIError) as err:
            gw.authorize(_request(headers))
        assert err.value.status == 401
    open_gw = Gateway(GatewayConfig(decoders=["x:1"]))
    assert open_gw.authorize(_request({})) is None
    assert open_gw.cache_salt(_request({"X-Cache-Salt": "p"}), None, None) == "p"


def test_the_json_parser_stops_at_the_value_limit():
    from gateway.admission import parse_json_bounded

    # Past the limit comes malformed JSON: a parser that read on would answer 400 for it, not 413.
    body = b'{"messages":[' + b'{"role":"user"},' * 200 + b'!!! not JSON'
    with pytest.raises(APIError) as err:
        parse_json_bounded(body, max_values=100)
    assert err.value.status == 413 and "100 values" in err.value.message
    assert parse_json_bounded(b'{"a":[{"b":1},{"c":2}]}', max_values=5) == {"a": [{"b": 1}, {"c": 2}]}
