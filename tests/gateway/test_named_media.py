"""vLLM's `uuid` on image parts: a file sent once under a client's name is reused when a later part names
it without the file, only within the same tenant (API key), in a byte-bounded memory; an unknown name is
a 400 that says to send the file again. In-process over a fake decoder."""

from __future__ import annotations

from common.images import encode_png
from gateway.media_memo import MediaMemo
from tests.gateway.harness import data_url
from tests.gateway.inprocess import fake_decoder, gateway_client
from tests.oracle import make_image

PNG = encode_png(make_image(6, (16, 16)))


def _chat(image_url: dict | None, uuid: str) -> dict:
    part = {"type": "image_url", "image_url": image_url, "uuid": uuid}
    return {"model": "m", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]}


def _key(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_named_image_is_reused_by_its_uuid_within_its_tenant_only():
    with fake_decoder() as (decoder, address), gateway_client(address, api_keys=["ka", "kb"]) as client:
        named = _chat({"url": data_url(PNG)}, "sku-1")
        first = client.post("/v1/chat/completions", json=named, headers=_key("ka"))
        assert first.status_code == 200, first.text
        again = client.post("/v1/chat/completions", json=_chat(None, "sku-1"), headers=_key("ka"))
        assert again.status_code == 200, again.text
        assert [r.chat.messages[0].content[0].image.data for r in decoder.requests] == [PNG, PNG]
        for key, uuid in (("kb", "sku-1"), ("ka", "sku-2")):  # another tenant's name; a name never sent
            reply = client.post("/v1/chat/completions", json=_chat(None, uuid), headers=_key(key))
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "unknown_image_uuid" and error["param"] == "messages.0.content.0.uuid"
        assert len(decoder.requests) == 2
        missing = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        assert client.post("/v1/chat/completions", json=missing, headers=_key("ka")).status_code == 400


def test_the_memo_is_bounded_in_bytes_least_recently_used_first_out():
    memo = MediaMemo(max_bytes=10)
    memo.put("t", "image", "a", b"x" * 4)
    memo.put("t", "image", "b", b"y" * 4)
    assert memo.get("t", "image", "a") == b"x" * 4  # now the most recent
    memo.put("t", "image", "c", b"z" * 4)  # 12 bytes: the least recent (b) goes
    assert memo.get("t", "image", "b") is None and memo.bytes == 8 and len(memo) == 2
    memo.put("t", "image", "big", b"w" * 11)  # larger than the memo: not kept, nothing evicted for it
    assert memo.get("t", "image", "big") is None and len(memo) == 2
    assert memo.get("other", "image", "a") is None  # keyed by tenant
