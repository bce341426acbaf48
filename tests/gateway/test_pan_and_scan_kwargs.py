"""vLLM's `mm_processor_kwargs: {"do_pan_and_scan": bool}` through the gateway (in-process, over a fake
decoder that records what reaches it): every image of the request gets ImageInput.pan_and_scan, videos
none; left out, no image sets it (the checkpoint decides); unknown keys are a 400 naming the key and the
keys served. A model without crops refuses it at the decoder (INVALID_ARGUMENT: tests/gemma3/
test_pan_and_scan_switch.py), which the gateway answers as a 400 like any INVALID_ARGUMENT."""

from __future__ import annotations

import pytest

from common.images import encode_png
from tests.gateway.harness import data_url
from tests.gateway.inprocess import fake_decoder, gateway_client
from tests.oracle import make_image

IMAGE = {"type": "image_url", "image_url": {"url": data_url(encode_png(make_image(4, (16, 16))))}}


def _chat(kwargs: dict | None) -> dict:
    """Two user messages with an image each."""
    body: dict = {"model": "m", "messages": [
        {"role": "user", "content": [IMAGE, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [IMAGE, {"type": "text", "text": "and?"}]}]}
    if kwargs is not None:
        body["mm_processor_kwargs"] = kwargs
    return body


def _images(request) -> list:
    return [p.image for m in request.chat.messages for p in m.content if p.WhichOneof("part") == "image"]


@pytest.mark.parametrize("flag", [True, False])
def test_do_pan_and_scan_reaches_every_image(flag: bool) -> None:
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json=_chat({"do_pan_and_scan": flag}))
        assert reply.status_code == 200, reply.text
        images = _images(decoder.requests[-1])
        assert len(images) == 2
        assert all(i.HasField("pan_and_scan") and i.pan_and_scan is flag for i in images)
        assert all((i.min_pixels, i.max_pixels) == (0, 0) for i in images)


@pytest.mark.parametrize("kwargs", [None, {}])
def test_left_out_the_checkpoint_decides(kwargs) -> None:
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        assert client.post("/v1/chat/completions", json=_chat(kwargs)).status_code == 200
        assert not any(i.HasField("pan_and_scan") for i in _images(decoder.requests[-1]))


def test_on_a_fixed_size_model_pixels_are_still_refused(tiny_model_dir) -> None:
    """do_pan_and_scan alone passes to the decoder (which knows the model); pixel settings beside it on a
    model without a pixel range are the gateway's 400, as before."""
    with fake_decoder() as (decoder, address), gateway_client(address, model=str(tiny_model_dir)) as client:
        assert client.post("/v1/chat/completions", json=_chat({"do_pan_and_scan": True})).status_code == 200
        reply = client.post("/v1/chat/completions", json=_chat({"do_pan_and_scan": True, "min_pixels": 9}))
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "mm_processor_kwargs"
        assert len(decoder.requests) == 1


@pytest.mark.parametrize("key", ["pan_and_scan", "do_pan_and_scan_", "pan_and_scan_max_num_crops"])
def test_unknown_keys_are_a_clear_400(key: str) -> None:
    """The crop rule's settings stay the checkpoint's: a request cannot set them."""
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json=_chat({key: True}))
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == f"mm_processor_kwargs.{key}"
        assert error["message"].startswith(f"mm_processor_kwargs.{key}: unknown key; the keys served are")
        assert "do_pan_and_scan" in error["message"]
        assert not decoder.requests


def test_a_decoder_refusal_is_a_400() -> None:
    """What a model without crops answers (INVALID_ARGUMENT) reaches the client as a 400."""
    with fake_decoder() as (_, address), gateway_client(address) as client:
        body = {"model": "m", "mm_processor_kwargs": {"do_pan_and_scan": True}, "messages": [
            {"role": "user", "content": [IMAGE, {"type": "text", "text": "fail:INVALID_ARGUMENT"}]}]}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text


def test_a_wrong_type_is_a_400() -> None:
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json=_chat({"do_pan_and_scan": "maybe"}))
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "mm_processor_kwargs.do_pan_and_scan"
        assert not decoder.requests
