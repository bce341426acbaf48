"""What the official client and vLLM's tests meet first, in-process over a fake decoder: one model by its
id (`client.models.retrieve`) and OpenAI-shaped 404s, 415 for a body without Content-Type, fields the
server does not honour refused by name (as `tools` and `logit_bias` are), vLLM's uuid-reuse form
`"image_url": {}`, a system image a chat template drops refused with the reason, and a huge unknown model
name echoed cut."""

from __future__ import annotations

import pytest

from common.images import encode_png
from tests.gateway.harness import data_url
from tests.gateway.inprocess import fake_decoder, gateway_client
from tests.oracle import make_image

PNG = encode_png(make_image(3, (16, 16)))
USER = [{"role": "user", "content": "hi"}]


def test_one_model_by_its_id_and_openai_shaped_404s():
    with fake_decoder() as (_, address), gateway_client(
            address, served_model_names=["org/m", "m"], lora_modules=["sql=/adapters/sql"]) as client:
        listed = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
        for model in ("org/m", "m", "sql"):  # a Hub id's slash included
            reply = client.get(f"/v1/models/{model}")
            assert reply.status_code == 200, reply.text
            assert reply.json() == listed[model]
        for path in ("/v1/models/nope", "/v1/nothing-here"):
            reply = client.get(path)
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert error["type"] == "not_found_error" and error["message"], path
        assert client.get("/v1/models/nope").json()["error"]["code"] == "model_not_found"
        wrong_method = client.get("/v1/chat/completions")
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["code"] == "method_not_allowed"


def test_a_body_without_content_type_is_415():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/completions", content=b'{"model": "m", "prompt": "hi"}')
        assert reply.status_code == 415, reply.text
        assert reply.json()["error"]["code"] == "unsupported_media_type"
        assert decoder.requests == []
        typed = client.post("/v1/completions", content=b'{"model": "m", "prompt": "hi"}',
                            headers={"Content-Type": "application/json; charset=utf-8"})
        assert typed.status_code == 200, typed.text


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
    ("/v1/completions", {"logit_bias": {"1": 2.0}}, "logit_bias"),
])
def test_fields_not_honoured_are_400_naming_them(path, extra, param):
    base = {"messages": USER} if path == "/v1/chat/completions" else {"prompt": "hi"}
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post(path, json={"model": "m", **base, **extra})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["code"] == "unsupported_parameter"
        assert param in error["message"]
        assert decoder.requests == []


def test_the_honoured_forms_of_those_fields_pass():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        body = {"model": "m", "messages": USER, "response_format": {"type": "text"}, "modalities": ["text"],
                "function_call": "none", "functions": []}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert len(decoder.requests) == 1


def test_vllms_empty_image_url_object_with_a_uuid_reuses_the_named_file():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        def chat(part: dict) -> dict:
            return {"model": "m", "messages": [{"role": "user", "content": [part, {"type": "text",
                                                                                    "text": "hi"}]}]}

        named = {"type": "image_url", "image_url": {"url": data_url(PNG)}, "uuid": "sku-9"}
        assert client.post("/v1/chat/completions", json=chat(named)).status_code == 200
        reply = client.post("/v1/chat/completions",
                            json=chat({"type": "image_url", "image_url": {}, "uuid": "sku-9"}))
        assert reply.status_code == 200, reply.text
        assert [r.chat.messages[0].content[0].image.data for r in decoder.requests] == [PNG, PNG]
        for part in ({"type": "image_url", "image_url": {}, "uuid": "never-sent"},
                     {"type": "video_url", "video_url": {}, "uuid": "never-sent"}):
            reply = client.post("/v1/chat/completions", json=chat(part))
            assert reply.status_code == 400 and reply.json()["error"]["code"].startswith("unknown_"), part


MISMATCH = "fail:INVALID_ARGUMENT:prompt has 0 <image> placeholders but 1 images"


def test_a_system_image_the_template_drops_is_refused_with_the_reason():
    image = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    with fake_decoder() as (_, address), gateway_client(address) as client:
        system = {"model": "m", "messages": [
            {"role": "system", "content": [{"type": "text", "text": MISMATCH}, image]},
            {"role": "user", "content": "hi"}]}
        reply = client.post("/v1/chat/completions", json=system)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert "drops the images and videos of system messages" in error["message"]
        assert error["param"] == "messages.0.content.1" and error["code"] == "system_media_dropped"
        # The same refusal without a system image stays the decoder's own.
        user = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": MISMATCH},
                                                                       image]}]}
        reply = client.post("/v1/chat/completions", json=user)
        assert reply.status_code == 400 and "system" not in reply.json()["error"]["message"]


def test_a_huge_unknown_model_name_is_echoed_cut():
    with fake_decoder() as (decoder, address), gateway_client(address, lora_modules=["sql"]) as client:
        name = "x" * 2**20
        for reply in (client.post("/v1/completions", json={"model": name, "prompt": "hi"}),
                      client.get(f"/v1/models/{name[:4000]}")):
            assert reply.status_code == 404, reply.text[:200]
            message = reply.json()["error"]["message"]
            assert len(message) < 400 and "characters)" in message and "'sql'" in message
        assert decoder.requests == []
