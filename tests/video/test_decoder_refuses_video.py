"""Until the engine serves video, the decoder's front end answers any request carrying a video (prompt
`videos` or a chat video part) with one INVALID_ARGUMENT, through a real gRPC server, before the engine
core sees anything."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc
from decoder_svc.server import SERVICE_NAME, DecoderServicer
from decoder_svc.wire import VIDEO_NOT_SERVED


class UntouchedCore:
    """An engine core that records any use: a refused request must not reach it."""

    num_open_streams = 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        def record(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"the engine core was used: {name}")

        return record


@pytest.fixture(scope="module")
def decoder():
    """A DecoderServicer over UntouchedCore behind a real gRPC server on a background loop."""
    from common.server import GrpcService

    core = UntouchedCore()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def make():
        service = GrpcService("decoder-video-test", "127.0.0.1", 0)
        service.add(decoder_pb2_grpc.add_DecoderServiceServicer_to_server,
                    DecoderServicer(core, inputs=None), SERVICE_NAME)
        return service

    service = call(make())
    port = call(service.start())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield decoder_pb2_grpc.DecoderServiceStub(channel), core
    channel.close()
    call(service.stop(0.5))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


VIDEO = common_pb2.VideoInput(data=b"\x00\x00\x00\x18ftypmp42", fps=1.0)


@pytest.mark.parametrize("kind", ["prompt", "chat", "hash_only"])
def test_a_request_with_video_is_invalid_argument(decoder, kind):
    stub, core = decoder
    if kind == "prompt":
        request = decoder_pb2.GenerateRequest(prompt="<|vision_start|><|video_pad|><|vision_end|>Hi",
                                              videos=[VIDEO])
    elif kind == "hash_only":
        request = decoder_pb2.GenerateRequest(prompt="<|video_pad|>",
                                              videos=[common_pb2.VideoInput(content_hash="ab" * 32)])
    else:
        request = decoder_pb2.GenerateRequest(chat=decoder_pb2.ChatMessages(messages=[decoder_pb2.ChatMessage(
            role="user", content=[decoder_pb2.ContentPart(text="What happens?"),
                                  decoder_pb2.ContentPart(video=VIDEO)])]))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == VIDEO_NOT_SERVED
    assert core.calls == []
