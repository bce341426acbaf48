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


def test_each_tenant_has_a_budget_of_its_own():
    memo = MediaMemo(max_bytes=10, max_tenants=4)
    memo.put("ka", "image", "a", b"x" * 8, tenant="ka")
    for i in range(3):  # another tenant fills its own budget many times over
        memo.put("kb", "image", f"b{i}", b"y" * 8, tenant="kb")
    assert memo.get("ka", "image", "a", tenant="ka") == b"x" * 8
    assert memo.bytes == 16 and memo.tenants == 2
    assert memo.get("ka", "image", "a", tenant="kb") is None  # a name never crosses tenants


def test_the_number_of_tenants_is_bounded_least_recently_active_first_out():
    memo = MediaMemo(max_bytes=10, max_tenants=2)
    memo.put("s", "image", "a", b"1", tenant="t1")
    memo.put("s", "image", "a", b"2", tenant="t2")
    assert memo.get("s", "image", "a", tenant="t1") == b"1"  # t1 now the more recent
    memo.put("s", "image", "a", b"3", tenant="t3")  # a third tenant: t2's files go
    assert memo.tenants == 2 and memo.get("s", "image", "a", tenant="t2") is None
    assert memo.of("t1").get("s", "image", "a") == b"1" and memo.of("t3").get("s", "image", "a") == b"3"


def test_one_tenants_files_never_push_out_anothers_through_the_gateway():
    budget = 2 * len(PNG)
    with fake_decoder() as (decoder, address), gateway_client(
            address, api_keys=["ka", "kb"], images={"max_named_media_bytes": budget}) as client:
        named = _chat({"url": data_url(PNG)}, "mine")
        assert client.post("/v1/chat/completions", json=named, headers=_key("ka")).status_code == 200
        for i in range(4):  # kb names more than the whole budget
            other = _chat({"url": data_url(PNG)}, f"theirs-{i}")
            assert client.post("/v1/chat/completions", json=other, headers=_key("kb")).status_code == 200
        again = client.post("/v1/chat/completions", json=_chat(None, "mine"), headers=_key("ka"))
        assert again.status_code == 200, again.text
        assert client.app.state.gateway.named_media.bytes == 3 * len(PNG)  # one of ka's, two of kb's
