"""Decoding the sampled frames of a video: the header is read and checked first (common.video.probe),
the frame indices are chosen from it, the frames to decode are scheduled from the packet index
(common.video.schedule: a seek to the keyframe before a sampled frame when that decodes fewer frames)
and their cost checked against the cap; only then are frames decoded.

Frames are numbered in presentation order from 0 (by their timestamps, through the packet index) and
converted with PyAV's `to_ndarray(format="rgb24")`, as Hugging Face's `read_video_pyav`
(transformers/video_utils.py) does, so the same file gives HF's pixels.

Decoding stops, at the next frame, when its caller no longer wants it (`keep_going`: every client of
the job has gone, DecodeAbandoned) or when it has taken longer than `max_decode_s` (VideoError).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from common.video.limits import VideoError, VideoLimits
from common.video.probe import VideoInfo, open_video, public_message
from common.video.schedule import DecodeSchedule, index_packets, schedule_decoding

# Frames a run may decode beyond its schedule: after a seek, a decoder may output a few frames from
# before the keyframe (open groups of pictures). More than this means the index does not fit the stream.
SLACK_FRAMES_PER_RUN = 16


class DecodeAbandoned(Exception):  # noqa: N818 - not an error: nobody is left to tell
    """Decoding stopped because nobody waits for the video any more."""


class _IndexMismatch(Exception):  # noqa: N818 - internal: decode in order instead
    """The decoded frames do not follow the packet index (timestamps differ, a sampled frame skipped)."""


@dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of a video and where they came from."""

    frames: np.ndarray  # uint8 [n, H, W, 3], RGB
    indices: np.ndarray  # int64 [n], each frame's index in the stream, increasing
    info: VideoInfo
    frames_decoded: int = 0  # every frame decoded to reach them (the work it cost)


class _Progress:
    """The frames decoded so far, against the schedule's count, the time budget and the caller."""

    def __init__(self, limits: VideoLimits, keep_going: Callable[[], bool] | None) -> None:
        self.limits = limits
        self.keep_going = keep_going
        self.deadline = time.monotonic() + limits.max_decode_s
        self.decoded = 0
        self.allowed = 0  # raised by each schedule tried

    def frame(self) -> None:
        """One more frame decoded: stop when past the schedule, the time budget or the caller's interest."""
        self.decoded += 1
        if self.decoded > self.allowed:
            raise _IndexMismatch
        if self.keep_going is not None and not self.keep_going():
            raise DecodeAbandoned
        if time.monotonic() > self.deadline:
            raise VideoError(f"decoding took longer than the limit of {self.limits.max_decode_s:g} s a video "
                             f"(--max-video-decode-seconds); stopped after {self.decoded} frames")


def decode_frames(container, stream, indices: np.ndarray, info: VideoInfo, schedule: DecodeSchedule,
                  progress: _Progress) -> np.ndarray:
    """uint8 [len(indices), H, W, 3] RGB frames at the (increasing) indices, decoding only the
    schedule's runs."""
    wanted = {int(i): n for n, i in enumerate(indices)}
    out: list[np.ndarray | None] = [None] * len(indices)
    position = None if schedule.frame_pts is None else {p: i for i, p in enumerate(schedule.frame_pts)}
    count = 0
    try:
        for run in schedule.runs:
            if run.seek_pts is not None:
                container.seek(run.seek_pts, stream=stream, backward=True, any_frame=False)
            reached = False
            for frame in container.decode(stream):
                # The header's size was checked against the cap; a stream may change size later on.
                if (frame.width, frame.height) != (info.width, info.height):
                    raise VideoError(f"video frame {count} is {frame.width}x{frame.height}; the header says "
                                     f"{info.width}x{info.height}")
                if position is None:
                    index = count
                elif frame.pts is None or frame.pts not in position:
                    raise _IndexMismatch
                else:
                    index = position[frame.pts]
                count += 1
                progress.frame()
                if index < run.first:  # decoded on the way to the run's keyframe
                    continue
                if index in wanted:
                    out[wanted[index]] = frame.to_ndarray(format="rgb24")
                if index >= run.last:
                    reached = True
                    break
            if position is not None and (not reached or any(
                    out[wanted[i]] is None for i in wanted if run.first <= i <= run.last)):
                raise _IndexMismatch  # the stream skipped a sampled frame the index promised
    except (VideoError, DecodeAbandoned, _IndexMismatch):
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg raises many types for bad streams
        raise VideoError(f"cannot decode video frame {count}: {public_message(exc)}") from None
    missing = [int(i) for i in indices if out[wanted[int(i)]] is None]
    if missing:
        raise VideoError(f"the video stream ended after {count} frames; frame {missing[0]} was needed (the "
                         f"header says {info.total_frames})")
    return np.stack(out)


def plan_decoding(data: bytes, sample: Callable[[VideoInfo], Sequence[int]],
                  limits: VideoLimits = VideoLimits()) -> tuple[VideoInfo, np.ndarray, DecodeSchedule]:
    """(header, sampled indices, decode schedule) of encoded video bytes, nothing decoded: every cap of
    `limits` checked, the decode work (common/video/schedule.py) included. Raises VideoError."""
    with open_video(data, limits) as (container, stream, info):
        indices = np.asarray(sample(info), dtype=np.int64).reshape(-1)
        if indices.size == 0 or indices[0] < 0 or indices[-1] >= info.total_frames \
                or np.any(np.diff(indices) <= 0):
            raise ValueError(f"frame indices must increase within [0, {info.total_frames}): "
                             f"{indices.tolist()}")
        limits.check_decoded(int(indices.size), info.width, info.height)
        schedule = schedule_decoding(index_packets(container, stream), indices)
    limits.check_decode_work(schedule.frames_to_decode, info.width, info.height)
    return info, indices, schedule


def decode_video(data: bytes, sample: Callable[[VideoInfo], Sequence[int]],
                 limits: VideoLimits = VideoLimits(),
                 keep_going: Callable[[], bool] | None = None) -> DecodedVideo:
    """Decode the frames `sample(info)` picks from encoded video bytes (e.g. FrameSampling.indices_for).

    Every cap in `limits` is checked from the header and the packet index before any frame is decoded.
    Raises VideoError for empty, oversized, corrupt or truncated input, a container or codec not
    accepted, no video stream, or decoding past its time budget; DecodeAbandoned once `keep_going()`
    (asked at every frame) answers False.
    """
    info, indices, schedule = plan_decoding(data, sample, limits)
    progress = _Progress(limits, keep_going)
    try:
        frames = _decode(data, limits, indices, info, schedule, progress)
    except _IndexMismatch:
        # Decode in order instead, if that too is within the cap (the frames decoded so far count).
        in_order = DecodeSchedule.in_order(int(indices[-1]))
        limits.check_decode_work(progress.decoded + in_order.frames_to_decode, info.width, info.height)
        try:
            frames = _decode(data, limits, indices, info, in_order, progress)
        except _IndexMismatch:
            raise VideoError("the video's frames do not match its header") from None
    return DecodedVideo(frames, indices, info, progress.decoded)


def _decode(data: bytes, limits: VideoLimits, indices: np.ndarray, info: VideoInfo, schedule: DecodeSchedule,
            progress: _Progress) -> np.ndarray:
    slack = SLACK_FRAMES_PER_RUN * len(schedule.runs)
    progress.allowed = progress.decoded + schedule.frames_to_decode + slack
    with open_video(data, limits) as (container, stream, _):
        return decode_frames(container, stream, indices, info, schedule, progress)
