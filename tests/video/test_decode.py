"""Decoding real (tiny) videos made with PyAV: header values, the frames at the sampled indices, and
decoding that stops at the last frame needed."""

from __future__ import annotations

import numpy as np
import pytest

from common.families.qwen2_5_vl.video_config import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO
from common.video.decode import decode_video
from common.video.limits import VideoError
from common.video.pipeline import read_video
from common.video.probe import probe_video
from tests.video.media import frame_colour, make_video

CASES = [("mpeg4", "mp4", "mp4"), ("libvpx", "webm", "matroska"), ("libvpx-vp9", "webm", "matroska"),
         ("mpeg4", "avi", "avi")]


@pytest.mark.parametrize("codec,fmt,name", CASES)
def test_probe_reads_the_header(codec: str, fmt: str, name: str) -> None:
    info = probe_video(make_video(30, fps=10, codec=codec, fmt=fmt))
    assert (info.format, info.width, info.height, info.fps, info.total_frames) == (name, 64, 48, 10.0, 30)
    assert info.codec == {"libvpx": "vp8", "libvpx-vp9": "vp9"}.get(codec, codec)
    assert info.duration_s == pytest.approx(3.0, abs=0.01)
    assert info.frames_estimated == (name == "matroska")  # WebM headers carry no frame count


@pytest.mark.parametrize("codec,fmt,name", CASES[:2])
def test_sampled_frames_are_the_right_ones(codec: str, fmt: str, name: str) -> None:
    data = make_video(40, fps=10, codec=codec, fmt=fmt)
    for config in (QWEN2_VL_VIDEO, QWEN3_VL_VIDEO):
        video = decode_video(data, config.sampling.indices_for)
        assert video.indices.tolist() == config.sampling.indices(40, 10.0).tolist()
        assert video.frames.shape == (len(video.indices), 48, 64, 3) and video.frames.dtype == np.uint8
        for frame, index in zip(video.frames, video.indices, strict=True):
            # lossy codecs and YUV 4:2:0: each flat frame's colour comes back within a few levels
            assert np.abs(frame.reshape(-1, 3).mean(0) - frame_colour(int(index))).max() < 8, index


def test_decoding_stops_at_the_last_sampled_frame() -> None:
    data = make_video(40, fps=10, gop_size=100, still=True)  # one keyframe: decoded from the start
    video = decode_video(data, lambda info: np.array([0, 3, 9]))
    assert len(video.frames) == 3 and video.frames_decoded == 10  # frames 0..9, not the 40 of the stream


def test_a_stream_shorter_than_its_header_is_refused() -> None:
    data = make_video(40, fps=10, codec="libvpx", fmt="webm")
    cut = data[: len(data) // 2]  # the header says 4 s at 10 fps; about half the frames are there
    assert probe_video(cut).total_frames == 40
    assert len(decode_video(cut, lambda info: np.array([0, 1])).frames) == 2  # the early frames decode
    with pytest.raises(VideoError, match="ended after"):
        decode_video(cut, lambda info: np.array([0, 39]))


def test_read_video_in_one_call() -> None:
    data = make_video(37, fps=12)
    video = read_video(data, QWEN3_VL_VIDEO, "fp")
    assert video.decoded.indices.tolist() == [0, 7, 14, 22, 29, 36]
    assert video.grid == (3, 8, 12) and video.num_tokens == 72
    assert video.timestamps == pytest.approx([3.5 / 12, 18 / 12, 32.5 / 12])
    assert len(video.content_hash) == 64
