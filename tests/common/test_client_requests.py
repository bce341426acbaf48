"""Requests built by common/client.py: every kind of image input lands in its field, filled in place."""

from __future__ import annotations

from common.client import _encode_request, fill_image_input, generate_request, image_input
from common.pb import common_pb2


def test_every_kind_of_image_fills_its_field(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(b"from-a-file")
    given = common_pb2.ImageInput(data=b"given", max_pixels=7)
    request = generate_request("<image>" * 4, [b"raw", "hash:" + "ab" * 32, str(path), given], max_tokens=1)
    assert [i.WhichOneof("source") for i in request.images] == ["data", "content_hash", "data", "data"]
    assert request.images[0].data == b"raw" and request.images[1].content_hash == "ab" * 32
    assert request.images[2].data == b"from-a-file"
    assert request.images[3] == given and request.sampling.max_tokens == 1


def test_chat_images_and_encode_requests_carry_their_bytes():
    data = bytes(range(256)) * 4096  # 1 MiB
    chat = [{"role": "user", "content": [{"type": "image", "image": data}, {"type": "text", "text": "hi"}]}]
    request = generate_request(chat=chat)
    assert request.chat.messages[0].content[0].image.data == data
    assert request.chat.messages[0].content[1].text == "hi"
    encode = _encode_request([data, "hash:" + "cd" * 32], [1], "salt", False, "r1", "owner")
    assert encode.images[0].data == data and encode.images[1].content_hash == "cd" * 32
    assert encode.cache_salt == "salt" and encode.lease_owner == "owner"


def test_image_input_returns_a_message_and_fill_returns_its_field():
    assert image_input(b"x").data == b"x"
    field = common_pb2.ImageInput()
    assert fill_image_input(field, "hash:" + "ef" * 32) is field and field.content_hash == "ef" * 32
