"""The gateway as a public edge (issue 32), through a real gateway process over a fake decoder:
admission before any fetch, byte budgets that answer 413 (never a retried 429), bounded parsing of
huge bodies, 400s for malformed text and nesting, salt limits, bare /health, the image-format
allowlist, SSRF address forms, slowloris, and well-formed SSE streams."""

from __future__ import annotations

import io
import json
import socket
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import pytest
from PIL import Image

from common.images import encode_png
from gateway import admission
from gateway.config import RequestLimits
from gateway.errors import APIError
from tests.gateway.harness import GatewayProcess, ImageServer, data_url, start_failing_decoder

KEY = "sk-edge"
PNG = encode_png(Image.new("RGB", (8, 8), (200, 30, 30)))


@pytest.fixture(scope="module")
def fake_decoder():
    server, address = start_failing_decoder()
    yield address
    server.stop(0)


@pytest.fixture(scope="module")
def edge(fake_decoder, tmp_path_factory):
    """API keys on, private image URLs allowed (the image server is local), short connection timeouts."""
    g = GatewayProcess([fake_decoder], tmp_path_factory.mktemp("gw") / "gateway.log",
                       ["--served-model-name", "fake", "--api-key", KEY, "--allow-private-image-urls",
                        "--header-timeout", "1", "--max-connections", "4000"]).start()
    yield g
    g.stop()


def _post(gw: GatewayProcess, body, path: str = "/v1/chat/completions", **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    if isinstance(body, (bytes, str)):
        headers["content-type"] = "application/json"
        return httpx.post(gw.url + path, content=body, headers=headers, timeout=60, **kwargs)
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=60, **kwargs)


def _chat(*parts, **extra) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": list(parts)}], **extra}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _assert_error(reply: httpx.Response, status: int, *words: str) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    for word in words:
        assert word in body["error"]["message"], body
    return body["error"]


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_sixty_urls_are_refused_before_any_fetch(edge):
    with ImageServer({"cat.png": PNG}) as server:
        reply = _post(edge, _chat(*[_image(f"{server.url}/cat.png?{i}") for i in range(60)]))
        error = _assert_error(reply, 400, "60 images", "at most 16")
        assert error["code"] == "too_many_images"
        assert server.hits == []  # nothing was fetched


def test_images_over_the_byte_budget_are_413_not_a_retried_status(fake_decoder, tmp_path):
    """14 images of 19 MiB, each inside the per-image limit: together they pass the budget that fits the
    decoder's 256 MiB message, so the answer is 413 (before the 14th fetch), never 429 or 503."""
    big = PNG + bytes(19 * 2**20 - len(PNG))  # a valid PNG header, padded to 19 MiB
    g = GatewayProcess([fake_decoder], tmp_path / "gateway.log", [
        "--served-model-name", "fake", "--api-key", KEY, "--allow-private-image-urls"]).start()
    try:
        with ImageServer({"big.png": big}) as server:
            reply = _post(g, _chat(*[_image(f"{server.url}/big.png?{i}") for i in range(14)]))
            error = _assert_error(reply, 413, "images and videos together", "exceeds the limit of")
            assert error["code"] == "images_too_large"
    finally:
        g.stop()


def test_a_failed_fetch_cancels_the_rest(fake_decoder, tmp_path):
    """With a budget of two 1 MB images and 4 fetches at a time, the third image ends the request: the
    fetches not started yet never start."""
    big = PNG + bytes(2**20 - len(PNG))
    g = GatewayProcess([fake_decoder], tmp_path / "gateway.log", [
        "--served-model-name", "fake", "--api-key", KEY, "--allow-private-image-urls",
        "--max-total-image-bytes", str(2 * len(big) + 10), "--image-fetch-concurrency", "4"]).start()
    try:
        with ImageServer({"big.png": big}) as server:
            reply = _post(g, _chat(*[_image(f"{server.url}/big.png?{i}") for i in range(16)]))
            _assert_error(reply, 413, "images and videos together")
            time.sleep(0.5)
            assert len(server.hits) <= 6, server.hits
    finally:
        g.stop()


def test_a_million_empty_messages_are_refused_cheaply(edge, monkeypatch):
    """A 30 MB body of a million empty messages: 413 naming the limit on JSON values, with work bounded by
    that limit (the parse stops at the first value past it) and the gateway's memory by a few times the
    body; a small request right after is served. Its time is measured in
    bench/experiments/empty_messages.py."""
    body = b'{"model":"fake","messages":[' + b'{"role":"user","content":""},' * 999_999 + \
        b'{"role":"user","content":""}]}'
    before = _rss_bytes(edge.proc.pid)
    reply = _post(edge, body)
    growth = _rss_bytes(edge.proc.pid) - before
    error = _assert_error(reply, 413, "JSON objects and numbers", "exceeds the limit of")
    assert error["code"] == "request_too_large"
    assert growth < 100 * 2**20, f"RSS grew {growth / 2**20:.0f} MiB"
    assert _post(edge, _chat({"type": "text", "text": "hi"})).status_code == 200

    # The same parse in this process: the values it made and the bytes it allocated.
    limit = RequestLimits().max_json_values
    made, peak, refused = _parse_counted(body, limit, monkeypatch)
    assert refused.status == 413
    assert made == limit + 1, made  # stopped at the first value past the limit, not at the body's end
    # The body decoded to text once (30 MiB) and the limit's 100k objects (~20 MiB); all 1M: ~260 MiB.
    assert peak < len(body) + 48 * 2**20, f"{peak / 2**20:.0f} MiB allocated while parsing"


def _parse_counted(body: bytes, limit: int, monkeypatch) -> tuple[int, int, APIError]:
    """parse_json_bounded(body, limit) expected to refuse: (JSON values made, peak bytes allocated, the
    error). Every hook the parser gives json.loads (objects, ints, floats) is counted on its way."""
    made = 0

    def counted(hook):
        def call(*args):
            nonlocal made
            made += 1
            return hook(*args)
        return call

    def loads(data, **hooks):
        return json.loads(data, **{name: counted(hook) for name, hook in hooks.items()})

    monkeypatch.setattr(admission, "json", SimpleNamespace(loads=loads))
    tracemalloc.start()
    try:
        with pytest.raises(APIError) as refused:
            admission.parse_json_bounded(body, limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return made, peak, refused.value


def test_message_and_prompt_caps_are_named(edge):
    many = {"model": "fake", "messages": [{"role": "user", "content": "x"}] * 1025}
    assert _assert_error(_post(edge, many), 400, "1025 messages", "at most 1024")["param"] == "messages"
    huge = _chat({"type": "text", "text": "x" * (2**20)})
    assert _assert_error(_post(edge, huge), 413, "rendered prompt", str(2**20))["code"] == "prompt_too_large"


@pytest.mark.parametrize("body, param", [
    ('{"model":"fake","messages":[{"role":"user","content":"a\\ud800b"}]}', "messages.0.content"),
    ('{"model":"fake","messages":[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}]}',
     "messages.0.content.0.text"),
    ('{"model":"fake","messages":[{"role":"user","content":"hi"}],"stop":"\\ud800"}', "stop"),
])
def test_lone_surrogates_are_400(edge, body, param):
    assert _assert_error(_post(edge, body), 400, "surrogate")["param"] == param


def test_lone_surrogate_in_a_completions_prompt_is_400(edge):
    reply = _post(edge, '{"model":"fake","prompt":"\\ud800"}', path="/v1/completions")
    assert _assert_error(reply, 400, "surrogate")["param"] == "prompt"


def test_deep_nesting_is_400_and_counted(edge):
    before = httpx.get(f"{edge.url}/metrics").text.count('status="400"')
    _assert_error(_post(edge, "[" * 100_000 + "]" * 100_000), 400, "nested too deeply")
    metrics = httpx.get(f"{edge.url}/metrics").text
    assert 'mmserve_gateway_errors_total{code="none",status="400"}' in metrics
    assert metrics.count('status="400"') >= before


def test_salt_over_the_limit_after_the_tenant_prefix_is_a_clear_400(edge):
    error = _assert_error(_post(edge, _chat({"type": "text", "text": "hi"}, cache_salt="s" * 250)), 400,
                          "cache_salt of 250 bytes", "235 bytes allowed", "decoder's limit is 256")
    assert error["param"] == "cache_salt"
    assert _post(edge, _chat({"type": "text", "text": "hi"}, cache_salt="s" * 235)).status_code == 200


def test_health_details_only_for_authenticated_callers(edge, fake_decoder):
    bare = httpx.get(f"{edge.url}/health")
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    assert fake_decoder not in bare.text
    full = httpx.get(f"{edge.url}/health", headers={"Authorization": f"Bearer {KEY}"})
    assert full.json()["decoders"] == {fake_decoder: "SERVING"}


def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["EPS", "TIFF", "ICO"])
def test_formats_outside_the_allowlist_are_refused(edge, fmt):
    reply = _post(edge, _chat(_image("data:image/x;base64," + data_url(_encoded(fmt)).split(",", 1)[1])))
    assert _assert_error(reply, 400, "not an accepted image format")["code"] == "invalid_image_format"
    assert _post(edge, _chat(_image(data_url(_encoded("WEBP"))))).status_code == 200


@pytest.mark.parametrize("host", ["[::127.0.0.1]", "[::ffff:127.0.0.1]", "[64:ff9b::a9fe:a9fe]",
                                  "[64:ff9b:1::a9fe:a9fe]", "[2002:a9fe:a9fe::1]", "[2002:7f00:1::1]"])
def test_ssrf_address_forms_are_refused(fake_decoder, tmp_path_factory, host):
    g = _strict_gateway(fake_decoder, tmp_path_factory)
    reply = _post(g, _chat(_image(f"http://{host}/latest/meta-data/")))
    assert _assert_error(reply, 400, "non-public address")["code"] == "image_url_forbidden"


_STRICT: dict = {}


def _strict_gateway(fake_decoder, tmp_path_factory) -> GatewayProcess:
    """One gateway with the default (public addresses only) image policy, shared by the SSRF cases."""
    if "g" not in _STRICT:
        _STRICT["g"] = GatewayProcess([fake_decoder], tmp_path_factory.mktemp("gw") / "gateway.log",
                                      ["--served-model-name", "fake", "--api-key", KEY]).start()
    return _STRICT["g"]


@pytest.fixture(scope="module", autouse=True)
def _stop_strict():
    yield
    if "g" in _STRICT:
        _STRICT.pop("g").stop()


def test_slowloris_leaves_normal_requests_succeeding(edge):
    """1000 connections that send half a request head: each is closed after the header timeout (1 s),
    and normal requests meanwhile and afterwards succeed."""
    socks = []
    try:
        for _ in range(1000):
            s = socket.create_connection(("127.0.0.1", edge.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        ok = [_post(edge, _chat({"type": "text", "text": "hi"})).status_code for _ in range(5)]
        assert ok == [200] * 5
        time.sleep(2.0)
        closed = 0
        for s in socks:
            s.settimeout(2.0)
            try:
                closed += s.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 0
        assert closed == len(socks)  # the server closed every half-sent request
        assert _post(edge, _chat({"type": "text", "text": "hi"})).status_code == 200
    finally:
        for s in socks:
            s.close()


def _sse_frames(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), raw[-200:]
    frames = raw[:-2].split("\n\n")
    assert all(f.startswith("data: ") and "\n" not in f for f in frames), frames
    return frames


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", _chat({"type": "text", "text": "hello"}, stream=True)),
    ("/v1/completions", {"model": "fake", "prompt": "hello", "stream": True}),
    ("/v1/chat/completions", _chat({"type": "text", "text": "fail-after-one:INTERNAL"}, stream=True)),
    ("/v1/completions", {"model": "fake", "prompt": "fail-after-one:RESOURCE_EXHAUSTED", "stream": True}),
])
def test_every_stream_ends_with_done(edge, path, body):
    """The raw body, not the SDK (which accepts a stream without it): every frame is `data: ...\\n\\n` and
    the last is `data: [DONE]\\n\\n`, also after an error event."""
    reply = _post(edge, body, path=path)
    assert reply.status_code == 200
    frames = _sse_frames(reply.text)
    assert frames[-1] == "data: [DONE]"
    assert frames.count("data: [DONE]") == 1
    if "fail" in body.get("prompt", "") or "fail" in str(body.get("messages")):
        assert '"error"' in frames[-2]
