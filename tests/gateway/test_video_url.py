"""`video_url` chat parts through a real gateway process: data: and http(s) URLs (the image fetch policy:
private addresses only when allowed, the per-file byte limit before the body is read) become chat video
parts of the decoder's GenerateRequest (a recording fake decoder); a served model without video input
(LLaVA) answers 400 before anything is fetched; a non-video file, too many videos and an assistant
message's video are 400s."""

from __future__ import annotations

import base64
import threading
from concurrent import futures

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from PIL import Image

from common.images import encode_png
from common.pb import decoder_pb2, decoder_pb2_grpc
from tests.gateway.harness import GatewayProcess, ImageServer
from tests.video.media import make_video

CLIP = make_video(12, fps=6, width=32, height=32)
BIG = make_video(90, fps=10, width=320, height=240)
LIMIT = len(CLIP) + 1000  # --max-video-bytes: CLIP fits, BIG does not
IMAGE_LIMIT = 1000  # --max-image-bytes, below CLIP: the image cap does not apply to videos
PNG = encode_png(Image.new("RGB", (8, 8), (10, 200, 30)))


class RecordingDecoder(decoder_pb2_grpc.DecoderServiceServicer):
    """Keeps every GenerateRequest and answers two tokens."""

    def __init__(self) -> None:
        self.requests: list[decoder_pb2.GenerateRequest] = []
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.requests.append(request)
        yield decoder_pb2.GenerateResponse(token_ids=[7], text="a")
        yield decoder_pb2.GenerateResponse(
            token_ids=[8], text="b", finish_reason=decoder_pb2.FINISH_REASON_LENGTH,
            usage=decoder_pb2.Usage(prompt_tokens=3, completion_tokens=2))


@pytest.fixture(scope="module")
def decoder():
    recorder = RecordingDecoder()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    decoder_pb2_grpc.add_DecoderServiceServicer_to_server(recorder, server)
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield recorder, f"127.0.0.1:{port}"
    server.stop(0)


def _gateway(address, model_dir, tmp_path_factory) -> GatewayProcess:
    assert len(BIG) > LIMIT and len(CLIP) > IMAGE_LIMIT > len(PNG)
    return GatewayProcess([address], tmp_path_factory.mktemp("gw") / "gateway.log",
                          ["--model", str(model_dir), "--served-model-name", "m",
                           "--allow-private-image-urls", "--max-video-bytes", str(LIMIT),
                           "--max-image-bytes", str(IMAGE_LIMIT), "--max-videos-per-request", "2"]).start()


@pytest.fixture(scope="module")
def qwen_gateway(decoder, qwen_model_dir, tmp_path_factory):
    g = _gateway(decoder[1], qwen_model_dir, tmp_path_factory)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def llava_gateway(decoder, tiny_model_dir, tmp_path_factory):
    g = _gateway(decoder[1], tiny_model_dir, tmp_path_factory)
    yield g
    g.stop()


def _chat(gateway: GatewayProcess, *parts, role: str = "user", **extra) -> httpx.Response:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": role, "content": list(parts)}], **extra}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)


def _video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def _data_url(data: bytes, media: str = "video/mp4") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _error(reply: httpx.Response, status: int, code: str | None, *words: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and all(w in error["message"] for w in words), error


def test_video_urls_reach_the_decoder_as_chat_video_parts(qwen_gateway, decoder):
    recorder, _ = decoder
    other = make_video(10, fps=5, width=48, height=32)
    with ImageServer({"clip.mp4": other}) as server:
        before = len(recorder.requests)
        reply = _chat(qwen_gateway, {"type": "text", "text": "What happens?"}, _video(_data_url(CLIP)),
                      _video(f"{server.url}/clip.mp4"))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "ab"
    (request,) = recorder.requests[before:]
    assert not request.videos and not request.images  # chat carries them inline
    (message,) = request.chat.messages
    kinds = [part.WhichOneof("part") for part in message.content]
    assert kinds == ["text", "video", "video"]
    assert message.content[1].video.data == CLIP and message.content[2].video.data == other
    video = message.content[1].video
    assert (video.fps, video.max_frames, video.min_pixels, video.max_pixels) == (0, 0, 0, 0)  # defaults


def test_video_url_limits(qwen_gateway, decoder):
    recorder, _ = decoder
    before = len(recorder.requests)
    with ImageServer({"big.mp4": BIG, "still.png": PNG}) as server:
        _error(_chat(qwen_gateway, _video(f"{server.url}/big.mp4")), 400, "video_too_large",
               f"video larger than {LIMIT} bytes")
        _error(_chat(qwen_gateway, _video(_data_url(BIG))), 400, "video_too_large")
        _error(_chat(qwen_gateway, _video(f"{server.url}/still.png")), 400, "invalid_video_format",
               "messages.0.content.0.video_url")
        _error(_chat(qwen_gateway, *[_video(f"{server.url}/still.png?{i}") for i in range(3)]), 400,
               "too_many_videos", "3 videos", "at most 2")
        assert server.hits.count("still.png") == 1  # the count is refused before any fetch
    reply = _chat(qwen_gateway, _video(_data_url(CLIP)), role="assistant")
    assert reply.status_code == 400 and "assistant messages cannot carry videos" in reply.text
    assert len(recorder.requests) == before


def test_a_model_without_video_input_answers_400(llava_gateway, decoder):
    recorder, _ = decoder
    before = len(recorder.requests)
    with ImageServer({"clip.mp4": CLIP}) as server:
        reply = _chat(llava_gateway, {"type": "text", "text": "Hi"}, _video(f"{server.url}/clip.mp4"))
        _error(reply, 400, "unsupported_modality", "does not take video input")
        assert reply.json()["error"]["param"] == "messages.0.content.1.video_url"
        assert server.hits == []  # refused before fetching
    assert len(recorder.requests) == before


def test_mm_processor_kwargs_reach_every_image_and_video(qwen_gateway, decoder):
    """vLLM's mm_processor_kwargs: the pixel range onto each image and video, fps and max_frames onto each
    video; the decoder checks them against the model and its caps."""
    recorder, _ = decoder
    before = len(recorder.requests)
    kwargs = {"min_pixels": 3136, "max_pixels": 200704, "fps": 1.0, "max_frames": 8}
    reply = _chat(qwen_gateway, {"type": "image_url", "image_url": {"url": _data_url(PNG, "image/png")}},
                  _video(_data_url(CLIP)), mm_processor_kwargs=kwargs)
    assert reply.status_code == 200, reply.text
    (request,) = recorder.requests[before:]
    image, video = (part for part in request.chat.messages[0].content)
    assert (image.image.min_pixels, image.image.max_pixels) == (3136, 200704)
    assert (video.video.fps, video.video.max_frames, video.video.min_pixels, video.video.max_pixels) == \
        (1.0, 8, 3136, 200704)


def test_mm_processor_kwargs_refusals(qwen_gateway, llava_gateway, decoder):
    recorder, _ = decoder
    before = len(recorder.requests)
    clip = _video(_data_url(CLIP))
    _error(_chat(qwen_gateway, clip, mm_processor_kwargs={"num_frames": 8}), 400, "invalid_value",
           "mm_processor_kwargs.num_frames")
    _error(_chat(qwen_gateway, clip, mm_processor_kwargs={"fps": -1}), 400, "invalid_value",
           "mm_processor_kwargs.fps")
    image = {"type": "image_url", "image_url": {"url": _data_url(PNG, "image/png")}}
    reply = _chat(llava_gateway, image, mm_processor_kwargs={"max_pixels": 200704})
    _error(reply, 400, "unsupported_parameter", "fixed size")
    assert reply.json()["error"]["param"] == "mm_processor_kwargs"
    assert len(recorder.requests) == before
