"""Decoding one video on several threads (--video-decode-threads): the option parsed and passed with the
video limits, the schedule's runs split between threads (or FFmpeg's codec threads for one run), the very
frames one thread decodes, each sampled frame converted as HF's `to_ndarray` does, and the caps and the
caller's leaving still stopping every thread at its next frame."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from common.config import add_options, from_args
from common.video import decode as decode_module
from common.video.decode import DecodeAbandoned, decode_video, plan_decoding, thread_plan
from common.video.limits import VideoError, VideoLimits, default_decode_threads
from common.video.probe import open_video
from common.video.schedule import DecodeSchedule
from encoder_svc.config import EncoderConfig
from tests.video.media import make_video

# Every 13th of 400 frames from a video with a keyframe every 10: ~31 runs from a keyframe each.
SAMPLED = np.arange(0, 400, 13)


@pytest.fixture(scope="module")
def many_runs() -> bytes:
    return make_video(400, fps=25, gop_size=10)


@pytest.fixture(scope="module")
def one_keyframe() -> bytes:
    """Few keyframes (the encoder adds one at a change of scene): few, long runs (FFmpeg's codec threads
    decode a part of one run)."""
    return make_video(300, fps=25, gop_size=10000)


def _limits(threads: int | None, **kwargs) -> VideoLimits:
    return VideoLimits(decode_threads=threads, **kwargs)


def test_the_option_is_parsed_into_the_encoders_video_limits(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, EncoderConfig)
    (tmp_path / "config.json").write_text("{}")
    model = ["--model", str(tmp_path)]
    args = parser.parse_args([*model, "--video-decode-threads", "3"])
    assert from_args(VideoLimits, args).decode_threads == 3
    default = from_args(VideoLimits, parser.parse_args(model))
    assert default.decode_threads is None and default.decode_thread_count == default_decode_threads()
    assert 1 <= default_decode_threads() <= 4
    with pytest.raises(SystemExit):
        parser.parse_args([*model, "--video-decode-threads", "0"])
    with pytest.raises(ValueError, match="decode_threads"):
        VideoLimits(decode_threads=0)


def test_the_limits_thread_count_reaches_the_decoding(many_runs, monkeypatch) -> None:
    seen = []
    real = decode_module.thread_plan
    monkeypatch.setattr(decode_module, "thread_plan", lambda schedule, threads: seen.append(threads)
                        or real(schedule, threads))
    decode_video(many_runs, lambda info: SAMPLED, _limits(3))
    assert seen == [3]


def test_the_runs_are_split_between_threads_at_seeks(many_runs) -> None:
    _, _, schedule = plan_decoding(many_runs, lambda info: SAMPLED)
    parts, codec_threads = thread_plan(schedule, 4)
    assert len(parts) == 4 and codec_threads == 1
    assert tuple(run for part in parts for run in part.runs) == schedule.runs
    assert all(part.runs[0].seek_pts is not None for part in parts[1:])
    assert thread_plan(schedule, 1) == ((schedule,), 1)
    in_order = DecodeSchedule.in_order(399)
    assert thread_plan(in_order, 4) == ((in_order,), 4)  # one run: FFmpeg's threads


@pytest.mark.parametrize("threads", [2, 4, 8])
def test_threads_decode_the_frames_one_thread_does(many_runs, one_keyframe, threads) -> None:
    for video in (many_runs, one_keyframe):
        one = decode_video(video, lambda info: SAMPLED[SAMPLED < 300], _limits(1))
        several = decode_video(video, lambda info: SAMPLED[SAMPLED < 300], _limits(threads))
        assert np.array_equal(one.frames, several.frames) and np.array_equal(one.indices, several.indices)
        assert several.frames_decoded == one.frames_decoded


def test_frames_are_converted_as_hfs_to_ndarray(many_runs) -> None:
    video = decode_video(many_runs, lambda info: SAMPLED, _limits(2))
    wanted = {int(i): n for n, i in enumerate(SAMPLED)}
    with open_video(many_runs) as (container, stream, _):
        for index, frame in enumerate(container.decode(stream)):  # this clip's frames come in pts order
            if index in wanted:
                assert np.array_equal(frame.to_ndarray(format="rgb24"), video.frames[wanted[index]]), index


def test_every_thread_stops_once_nobody_wants_the_video(many_runs) -> None:
    asked = []

    def keep_going() -> bool:
        asked.append(1)
        return len(asked) < 6

    progress = []
    real = decode_module._Progress

    class Counted(real):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            progress.append(self)

    decode_module._Progress = Counted
    try:
        with pytest.raises(DecodeAbandoned):
            decode_video(many_runs, lambda info: SAMPLED, _limits(4), keep_going=keep_going)
    finally:
        decode_module._Progress = real
    assert len(asked) == 6, "a thread asked again after the caller had gone"
    assert progress[0].decoded <= 6 + 3, "threads went on decoding after one had stopped"


def test_the_time_budget_stops_every_thread(many_runs, monkeypatch) -> None:
    class Clock:  # each reading one second later: a budget of 4.5 s allows 4 frames
        now = 0.0

        def monotonic(self) -> float:
            self.now += 1.0
            return self.now

    monkeypatch.setattr(decode_module, "time", Clock())
    with pytest.raises(VideoError, match=r"--max-video-decode-seconds\); stopped after 5 frames"):
        decode_video(many_runs, lambda info: SAMPLED, _limits(4, max_decode_s=4.5))


def test_the_decode_work_cap_is_checked_before_any_thread_starts(monkeypatch) -> None:
    still = make_video(300, fps=25, gop_size=10000, still=True)  # one keyframe: all 300 frames to decode
    monkeypatch.setattr(decode_module, "decode_frames", lambda *a, **k: pytest.fail("a frame was decoded"))
    with pytest.raises(VideoError, match="--max-video-decode-bytes"):
        decode_video(still, lambda info: np.array([0, 299]),
                     _limits(4, max_decode_bytes=64 * 48 * 3 * 299, max_decode_per_frame=0))
