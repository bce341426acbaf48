"""`n` choices and a request's images: one decoder call carries the bytes whatever n is, so they count
once against the request's budget (413 past it); n times their number counts against what the decoder can
admit together (400 naming the limit, never a 429 that SDKs retry); the gateway holds at most
--max-image-bytes-in-flight across requests (429), giving every byte back when a request ends.
In-process over a fake decoder: no services."""

from __future__ import annotations

import re

import pytest

from common.images import encode_png
from tests.gateway.harness import data_url
from tests.gateway.inprocess import fake_decoder, gateway_client
from tests.oracle import make_image

PNG = encode_png(make_image(5, (24, 24)))


def _chat(n: int = 1, images: int = 1, stream: bool = False, text: str = "hi") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(PNG)}}] * images
    return {"model": "m", "n": n, "stream": stream, "max_tokens": 2,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def _held(client) -> int:
    text = client.get("/metrics").text
    return int(float(re.search(r"^mmserve_gateway_media_bytes_held (\S+)$", text, re.M).group(1)))


def test_the_image_bytes_count_once_whatever_n_is():
    with fake_decoder() as (decoder, address), gateway_client(
            address, images={"max_total_image_bytes": 2 * len(PNG)}) as client:
        assert client.post("/v1/chat/completions", json=_chat(n=16, images=2)).status_code == 200
        assert [r.n for r in decoder.requests] == [16]  # one call, its images sent once
        reply = client.post("/v1/chat/completions", json=_chat(n=1, images=3))
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert error["code"] == "images_too_large" and str(2 * len(PNG)) in error["message"]
        assert len(decoder.requests) == 1  # refused before any decoder call
        assert _held(client) == 0


def test_n_beyond_what_the_decoder_can_admit_together_is_400_naming_the_limit():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json=_chat(n=65))
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "n" and error["code"] == "too_many_choice_images"
        assert "at most 64" in error["message"]
        reply = client.post("/v1/chat/completions", json=_chat(n=22, images=3))  # 66 images
        assert reply.status_code == 400 and "at most 64" in reply.json()["error"]["message"]
        assert decoder.requests == []  # nothing admitted, nothing to abort
        assert client.post("/v1/chat/completions", json=_chat(n=64)).status_code == 200
        assert client.post("/v1/chat/completions", json=_chat(n=128, images=0)).status_code == 200


def test_choices_are_admitted_together_or_not_at_all():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json=_chat(n=3, text="fail:RESOURCE_EXHAUSTED"))
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        assert decoder.finished == 0 and _held(client) == 0


def test_the_gateway_wide_budget_refuses_with_429_and_every_byte_is_given_back():
    limits = {"max_total_image_bytes": 2 * len(PNG), "max_bytes_in_flight": 3 * len(PNG)}
    with fake_decoder() as (decoder, address), gateway_client(address, images=limits) as client:
        decoder.release.clear()  # the first request's streams stay open: its bytes stay held
        with client.stream("POST", "/v1/chat/completions", json=_chat(n=4, images=2, stream=True)) as first:
            assert first.status_code == 200
            assert _held(client) == 2 * len(PNG)  # once, not once per choice
            busy = client.post("/v1/chat/completions", json=_chat(n=2, images=2))
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["code"] == "gateway_busy" and busy.headers["retry-after"] == "1"
            assert _held(client) == 2 * len(PNG)  # the refused request holds nothing
            assert client.post("/v1/chat/completions", json=_chat(n=1, text="fail:INVALID_ARGUMENT")
                               ).status_code == 400
            assert _held(client) == 2 * len(PNG)  # nor does a failed one
            decoder.release.set()
            assert "[DONE]" in "".join(first.iter_text())
        assert _held(client) == 0
        assert client.post("/v1/chat/completions", json=_chat(n=2, images=2)).status_code == 200
        assert _held(client) == 0


def test_the_in_flight_budget_holds_at_least_one_whole_request():
    from gateway.config import ImageFetchPolicy

    with pytest.raises(ValueError, match="--max-image-bytes-in-flight"):
        ImageFetchPolicy(max_total_image_bytes=100, max_bytes_in_flight=99)


def test_videos_count_in_the_n_choices_media_limit():
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with fake_decoder() as (decoder, address), gateway_client(
            address, images={"max_images_all_choices": 8}) as client:
        for parts, n in (([video], 9), ([video, video], 5)):  # 9 and 10 videos over the choices
            body = {"model": "m", "n": n, "messages": [{"role": "user", "content": [
                *parts, {"type": "text", "text": "hi"}]}]}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "too_many_choice_images" and error["param"] == "n"
        assert decoder.requests == []
        assert client.post("/v1/chat/completions", json=_chat(n=8)).status_code == 200  # 8 images: taken
