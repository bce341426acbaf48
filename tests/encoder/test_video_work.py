"""Work a video costs the encoder (issue 38, items 1 and 2), on qwen2.5-vl-tiny behind a real gRPC server:
a video's decoding holds neither the images' prep thread nor the tower (an image is encoded while a
video's decoding is held), and a video whose every caller hangs up stops decoding at the next frame,
counted in frames decoded (never timed); the next request for it starts afresh and completes."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.images import ImageLimits
from common.pb import common_pb2, encoder_pb2
from common.video.limits import VideoLimits
from encoder_svc import videos as videos_module
from encoder_svc.config import EncoderConfig
from tests.encoder.conftest import EncoderHarness, image_bytes
from tests.video.media import make_video

SHM = common_pb2.TRANSPORT_SHM
# 600 still frames (60 s at 10 fps) with one keyframe: max_frames=4 samples 0, 150, 300 and 450, all
# reached from the start, 451 frames to decode.
LONG = make_video(600, fps=10, gop_size=10000, still=True)
FEW = common_pb2.VideoInput(data=LONG, max_frames=4)
# The one-keyframe video decoded whole, as these tests' heavy load: no bound per frame kept (that bound:
# tests/video/test_decode_bound.py).
UNBOUNDED = {"max_decode_per_frame": 0}
WAIT_S = 30.0  # a bound for conditions that hold within milliseconds; never what a test measures


@pytest.fixture(scope="module")
def harness(qwen_model_dir):
    """One image prep thread: a video decoded there would hold it."""
    harness = EncoderHarness(EncoderConfig(
        model=qwen_model_dir, cache_bytes=64 << 20, lease_ttl_s=30, decode_processes=0, preprocess_threads=1,
        limits=ImageLimits(max_images_per_request=2), video_limits=VideoLimits(**UNBOUNDED)))
    yield harness
    harness.close()


@pytest.fixture
def encoder(harness):
    yield harness
    assert harness.stats().active_leases == 0, "a test (or the server) leaked a lease"


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.01)


def _request(*videos, images=(), salt="work") -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(videos=list(videos), accept=[SHM], cache_salt=salt,
                                     images=[common_pb2.ImageInput(data=d) for d in images])


def test_an_image_is_encoded_while_a_video_decoding_is_held(encoder, monkeypatch):
    held, go = threading.Event(), threading.Event()
    real = videos_module.decode_video

    def held_decode(*args, **kwargs):
        held.set()
        assert go.wait(WAIT_S), "the test never let the video go"
        return real(*args, **kwargs)

    monkeypatch.setattr(videos_module, "decode_video", held_decode)
    video_call = encoder.stub.Encode.future(_request(common_pb2.VideoInput(data=make_video(20, fps=10))),
                                            timeout=WAIT_S * 2)
    try:
        assert held.wait(WAIT_S)
        image = encoder.stub.Encode(_request(images=[image_bytes(7)]), timeout=WAIT_S)  # the video still held
        assert not video_call.done()
        encoder.release_all(image)
    finally:
        go.set()
    encoder.release_all(video_call.result())


def test_a_video_whose_caller_hung_up_stops_at_the_next_frame(encoder, monkeypatch):
    lane, cache = encoder.servicer.video_lane, encoder.servicer.cache
    decoded, abandoned, dropped = lane.frames_decoded, lane.abandoned, cache.abandoned
    at_frame_10 = threading.Event()
    real = lane._frame_decoded
    count = []

    def gated(key: str) -> bool:
        count.append(1)
        if len(count) == 10:  # hold the decoding until the server has seen the client leave
            at_frame_10.set()
            _until(lambda: cache.waiters(key) == 0, "the server saw the client hang up")
        return real(key)

    monkeypatch.setattr(lane, "_frame_decoded", gated)
    call = encoder.stub.Encode.future(_request(FEW), timeout=WAIT_S * 2)
    assert at_frame_10.wait(WAIT_S)
    call.cancel()
    with pytest.raises(grpc.FutureCancelledError):
        call.result()
    _until(lambda: lane.abandoned == abandoned + 1, "the decoding stopped")
    assert lane.frames_decoded - decoded == 10, "frames were decoded after every caller had gone"
    assert cache.abandoned == dropped + 1 and cache.stats().active_leases == 0

    # Nothing is left half-made: the same video again is decoded afresh and encoded.
    monkeypatch.setattr(lane, "_frame_decoded", real)
    before = lane.frames_decoded
    response = encoder.stub.Encode(_request(FEW), timeout=WAIT_S)
    assert len(response.embeddings) == 1 and not response.embeddings[0].cache_hit
    assert lane.frames_decoded - before == 451
    encoder.release_all(response)


@pytest.mark.parametrize("cap, words", [
    ({"max_decode_bytes": 450 * 64 * 48 * 3}, "video 0: reaching the sampled frames means decoding 451"),
    ({"max_decode_s": 1e-9}, "video 0: decoding took longer than the limit of 1e-09 s a video"),
])
def test_a_video_over_its_decode_work_or_time_is_invalid_argument(encoder, monkeypatch, cap, words):
    monkeypatch.setattr(encoder.servicer, "video_limits", VideoLimits(**cap, **UNBOUNDED))
    with pytest.raises(grpc.RpcError) as err:  # a salt of its own: no hit on the video encoded before
        encoder.stub.Encode(_request(FEW, salt=f"cap-{sorted(cap)}"), timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    monkeypatch.undo()  # and the service goes on serving
    encoder.release_all(encoder.stub.Encode(_request(images=[image_bytes(8)]), timeout=WAIT_S))
