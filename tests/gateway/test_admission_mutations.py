"""Checks a mutation campaign found untested: the gateway's --image-formats is the list it applies (not
the default one), and the data-URL byte budget is refused at admission, before any image is decoded or
fetched. In-process over a fake decoder."""

from __future__ import annotations

import base64
import io

from PIL import Image

from common.images import encode_png
from gateway.images import ImageFetcher
from tests.gateway.harness import data_url
from tests.gateway.inprocess import fake_decoder, gateway_client
from tests.oracle import make_image

PNG = encode_png(make_image(2, (16, 16)))


def _jpeg_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "what is this?"}]}]}


def test_the_configured_image_formats_are_the_ones_applied():
    with fake_decoder() as (decoder, address), gateway_client(address, images={"formats": "png"}) as client:
        reply = client.post("/v1/chat/completions", json=_chat(_jpeg_url()))  # JPEG: in the default list
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "invalid_image_format" and error["param"] == "messages.0.content.0.image_url"
        assert decoder.requests == []
        assert client.post("/v1/chat/completions", json=_chat(data_url(PNG))).status_code == 200
    with fake_decoder() as (decoder, address), gateway_client(address) as client:  # the default takes JPEG
        assert client.post("/v1/chat/completions", json=_chat(_jpeg_url())).status_code == 200


def test_the_data_url_byte_budget_is_refused_at_admission(monkeypatch):
    async def must_not_fetch(*args, **kwargs):
        raise AssertionError("admission let an over-budget request reach the fetch path")

    monkeypatch.setattr(ImageFetcher, "fetch_all", must_not_fetch)
    monkeypatch.setattr(ImageFetcher, "fetch", must_not_fetch)
    budget = 2 * len(PNG) + 1  # two images fit, three do not
    with fake_decoder() as (decoder, address), gateway_client(
            address, images={"max_total_image_bytes": budget}) as client:
        reply = client.post("/v1/chat/completions", json=_chat(*[data_url(PNG)] * 3))
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert error["code"] == "images_too_large" and str(budget) in error["message"]
        assert decoder.requests == []
