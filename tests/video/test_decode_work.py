"""The work a video may cost is bounded before decoding (issue 38, item 1): frames are reached by seeking
to the keyframe before each sampled frame, the frames to decode x their size are counted from the packet
index and refused over --max-video-decode-bytes before any is decoded, and decoding stops at the next
frame when its time budget is spent or its caller has gone. Work is counted in frames, never timed."""

from __future__ import annotations

import numpy as np
import pytest

from common.families.qwen2_5_vl.video_config import QWEN3_VL_VIDEO
from common.video import decode as decode_module
from common.video.decode import DecodeAbandoned, decode_video, plan_decoding
from common.video.limits import VideoError, VideoLimits
from common.video.pipeline import plan_video
from common.video.schedule import DecodeRun, DecodeSchedule, PacketIndex, schedule_decoding
from tests.video.media import frame_colour, make_video

FRAME_BYTES = 64 * 48 * 3


@pytest.fixture(scope="module")
def long_video() -> bytes:
    """600 frames (60 s at 10 fps) of 64x48, a keyframe at least every 30."""
    return make_video(600, fps=10, gop_size=30)


@pytest.fixture(scope="module")
def one_keyframe() -> bytes:
    """600 still frames with a single keyframe: only decodable from the start (the issue's bomb, small)."""
    return make_video(600, fps=10, gop_size=10000, still=True)


def test_a_long_video_decodes_only_the_groups_of_its_sampled_frames(long_video) -> None:
    sampled = np.array([0, 200, 420, 599])
    video = decode_video(long_video, lambda info: sampled)
    assert video.indices.tolist() == sampled.tolist()
    assert video.frames_decoded <= 4 * 30, "every frame up to the last sampled one was decoded"
    for frame, index in zip(video.frames, sampled, strict=True):
        assert np.abs(frame.reshape(-1, 3).mean(0) - frame_colour(int(index))).max() < 8, index
    # The very frames decoding in order gives (HF's reader decodes in order).
    info, indices, _ = plan_decoding(long_video, lambda info: sampled)
    progress = decode_module._Progress(VideoLimits(), None)
    in_order = decode_module._decode(long_video, VideoLimits(), indices, info,
                                     DecodeSchedule.in_order(599), progress)
    assert np.array_equal(in_order, video.frames) and progress.decoded == 600


def test_the_plan_counts_the_frames_to_decode(long_video, one_keyframe) -> None:
    assert plan_video(long_video, QWEN3_VL_VIDEO.with_request(max_frames=4), "fp").frames_to_decode <= 4 * 30
    unbounded = VideoLimits(max_decode_per_frame=0)  # the bound per frame kept: test_decode_bound.py
    assert plan_video(one_keyframe, QWEN3_VL_VIDEO.with_request(max_frames=4), "fp",
                      limits=unbounded).frames_to_decode == 600


def test_decode_work_over_the_cap_is_refused_before_decoding(one_keyframe, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(decode_module, "decode_frames", refuse)
    limits = VideoLimits(max_decode_bytes=FRAME_BYTES * 599, max_decode_per_frame=0)
    config = QWEN3_VL_VIDEO.with_request(max_frames=4)
    for call in (lambda: decode_video(one_keyframe, lambda info: np.array([0, 599]), limits),
                 lambda: plan_video(one_keyframe, config, "fp", limits=limits)):  # both services plan so
        with pytest.raises(VideoError) as error:
            call()
        message = str(error.value)
        assert "decoding 600 frames of 64x48" in message and "--max-video-decode-bytes" in message
        assert str(FRAME_BYTES * 599) in message


def test_decoding_stops_when_its_time_budget_is_spent(one_keyframe, monkeypatch) -> None:
    class Clock:  # each reading one second later: a budget of 4.5 s allows 4 frames
        now = 0.0

        def monotonic(self) -> float:
            self.now += 1.0
            return self.now

    monkeypatch.setattr(decode_module, "time", Clock())
    frames = []
    with pytest.raises(VideoError, match=r"limit of 4.5 s a video \(--max-video-decode-seconds\); stopped "
                                         r"after (\d+) frames") as error:
        decode_video(one_keyframe, lambda info: np.array([0, 599]), VideoLimits(max_decode_s=4.5),
                     keep_going=lambda: frames.append(1) or True)
    assert "stopped after 5 frames" in str(error.value) and len(frames) == 5


def test_decoding_stops_at_the_next_frame_once_nobody_wants_it(one_keyframe) -> None:
    asked = []

    def keep_going() -> bool:
        asked.append(1)
        return len(asked) < 3

    with pytest.raises(DecodeAbandoned):
        decode_video(one_keyframe, lambda info: np.array([0, 599]), keep_going=keep_going)
    assert len(asked) == 3  # three frames decoded of the 600 the sampled ones need


def test_a_sampled_keyframe_is_decoded_from_itself() -> None:
    index = PacketIndex(tuple(range(0, 1000, 10)), (0, 30, 60, 90))
    schedule = schedule_decoding(index, [5, 60, 90])
    assert schedule.runs == (DecodeRun(None, 0, 5), DecodeRun(600, 60, 60), DecodeRun(900, 90, 90))
    assert schedule.frames_to_decode == 8
    assert schedule_decoding(index, [30]).runs == (DecodeRun(300, 30, 30),)


def test_the_in_order_fallback_counts_the_frames_already_decoded(long_video, monkeypatch) -> None:
    """The packet index did not fit the stream after some frames were decoded: decoding in order (600 frames,
    exactly the cap on its own) is refused, since the frames decoded before it count toward the cap."""
    real = decode_module._decode
    tried = []

    def index_misfits(data, limits, indices, info, schedule, progress):
        if not tried:  # the scheduled decode runs, then its frames turn out not to match the index
            tried.append(real(data, limits, indices, info, schedule, progress) is not None)
            assert progress.decoded > 0
            raise decode_module._IndexMismatch
        return real(data, limits, indices, info, schedule, progress)

    monkeypatch.setattr(decode_module, "_decode", index_misfits)
    _, _, schedule = plan_decoding(long_video, lambda info: np.array([0, 599]))
    limits = VideoLimits(max_decode_bytes=FRAME_BYTES * 600)
    with pytest.raises(VideoError) as error:
        decode_video(long_video, lambda info: np.array([0, 599]), limits)
    assert tried and f"decoding {schedule.frames_to_decode + 600} frames of 64x48" in str(error.value)
    # within a cap that has room for both, the fallback decodes
    roomy = VideoLimits(max_decode_bytes=FRAME_BYTES * (600 + schedule.frames_to_decode))
    tried.clear()
    video = decode_video(long_video, lambda info: np.array([0, 599]), roomy)
    assert video.frames_decoded == schedule.frames_to_decode + 600
