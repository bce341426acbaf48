"""Bad input: each case raises VideoError (INVALID_ARGUMENT, the cap and the value in the message) before
any frame is decoded."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from common.errors import as_service_error, status_of
from common.families.qwen2_5_vl.video_config import QWEN3_VL_VIDEO
from common.images import encode_png
from common.video import decode as decode_module
from common.video.decode import decode_video
from common.video.limits import VideoError, VideoLimits
from common.video.pipeline import read_video
from tests.video.media import make_audio_only, make_video


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if any frame decoding starts, or if sampling (which follows the checks) is reached."""

    def refuse(*args, **kwargs):
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(decode_module, "decode_frames", refuse)

    def sample(info):
        raise AssertionError("sampling ran: the header checks passed")

    return sample


@pytest.fixture(scope="module")
def video() -> bytes:
    return make_video(30, fps=10, width=64, height=48)  # 3 s, 3072 pixels a frame


def _refused(data: bytes, sample, limits: VideoLimits = VideoLimits()) -> str:
    with pytest.raises(VideoError) as info:
        decode_video(data, sample, limits)
    error = info.value
    assert status_of(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert as_service_error(error, "video 1: ").code == grpc.StatusCode.INVALID_ARGUMENT
    return str(error)


def test_over_the_byte_cap(video, no_decoding) -> None:
    message = _refused(video, no_decoding, VideoLimits(max_bytes=len(video) - 1))
    assert f"{len(video)} bytes" in message and f"limit of {len(video) - 1}" in message


def test_over_the_duration_cap(video, no_decoding) -> None:
    message = _refused(video, no_decoding, VideoLimits(max_duration_s=2.5))
    assert "3.0 s" in message and "limit of 2.5 s" in message


def test_over_the_frame_cap(video, no_decoding) -> None:
    message = _refused(video, no_decoding, VideoLimits(max_stream_frames=29))
    assert "30 frames" in message and "limit of 29 frames" in message


def test_over_the_pixel_cap(video, no_decoding) -> None:
    message = _refused(video, no_decoding, VideoLimits(max_pixels=64 * 48 - 1))
    assert "64x48" in message and str(64 * 48 - 1) in message


def test_corrupt_bytes(video, no_decoding) -> None:
    garbage = video[:8] + bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8))
    assert "cannot read the video container" in _refused(garbage, no_decoding)
    assert "cannot read the video container" in _refused(video[: len(video) // 3], no_decoding)
    assert "empty" in _refused(b"", no_decoding)


def test_not_a_video(no_decoding) -> None:
    from PIL import Image

    png = encode_png(Image.new("RGB", (8, 8)))
    assert "not an accepted video container" in _refused(png, no_decoding)
    assert "not an accepted video container" in _refused(b"just some text" * 10, no_decoding)
    assert "no video stream" in _refused(make_audio_only(), no_decoding)


def test_a_codec_not_accepted(no_decoding) -> None:
    ffv1 = make_video(4, codec="ffv1", fmt="matroska", pix_fmt="yuv420p")
    message = _refused(ffv1, no_decoding)
    assert "codec ffv1 is not accepted" in message and "h264" in message
    webm = make_video(4, codec="libvpx", fmt="webm")
    assert "not accepted" in _refused(webm, no_decoding, VideoLimits(codecs="h264"))
    assert "not an accepted video container" in _refused(webm, no_decoding, VideoLimits(formats="mp4"))


def test_too_short_to_sample_is_a_video_error() -> None:
    one_frame = make_video(1, fps=10)
    with pytest.raises(VideoError, match="shorter than one temporal patch"):
        read_video(one_frame, QWEN3_VL_VIDEO, "fp")


def test_limits_validate_their_lists() -> None:
    with pytest.raises(ValueError, match="video limits"):
        VideoLimits(formats="mp4,flv")


def test_decoded_size_cap_is_checked_before_decoding(video, monkeypatch):
    """Sampled frames x width x height x 3 over max_decoded_bytes: refused from the header, in planning
    (both services) and in decoding, before any frame is decoded."""
    from common.video.pipeline import plan_video

    def refuse(*args, **kwargs):
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(decode_module, "decode_frames", refuse)
    limits = VideoLimits(max_decoded_bytes=64 * 48 * 3 * 5)  # five 64x48 frames
    with pytest.raises(VideoError, match=r"6 sampled frames of 64x48 are 55296 bytes decoded; at most 46080"):
        decode_video(video, lambda info: np.arange(6), limits)
    with pytest.raises(VideoError, match="bytes decoded; at most 46080"):
        plan_video(video, QWEN3_VL_VIDEO, "fp", limits=limits)
    # Five frames fit: the check passes and decoding is reached.
    with pytest.raises(AssertionError, match="a frame was decoded"):
        decode_video(video, lambda info: np.arange(5), limits)
