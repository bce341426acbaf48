"""A parsed request's file bytes (what makes it heavy for the front end's memory return) count the images'
and videos' files it carries, in a prompt or a chat, and nothing for content hashes."""

from common.pb import common_pb2, decoder_pb2
from decoder_svc.wire import parse_request

HASH = "ab" * 32


def test_prompt_files_counted_hashes_not():
    request = decoder_pb2.GenerateRequest(
        prompt="<image> <image> <video> what?",
        images=[common_pb2.ImageInput(data=b"x" * 1000), common_pb2.ImageInput(content_hash=HASH)],
        videos=[common_pb2.VideoInput(data=b"v" * 300)])
    assert parse_request(request).file_bytes == 1300


def test_chat_files_counted():
    part = decoder_pb2.ContentPart
    message = decoder_pb2.ChatMessage(role="user", content=[
        part(text="look"), part(image=common_pb2.ImageInput(data=b"y" * 70)),
        part(image=common_pb2.ImageInput(data=b"z" * 5))])
    request = decoder_pb2.GenerateRequest(chat=decoder_pb2.ChatMessages(messages=[message]))
    assert parse_request(request).file_bytes == 75


def test_text_only_is_light():
    request = decoder_pb2.GenerateRequest(prompt="a" * 100_000)
    assert parse_request(request).file_bytes == 0
