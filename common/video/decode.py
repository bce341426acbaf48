"""Decoding the sampled frames of a video: the header is read and checked first (common.video.probe),
the frame indices are chosen from it, the frames to decode are scheduled from the packet index
(common.video.schedule: a seek to the keyframe before a sampled frame when that decodes fewer frames)
and their cost checked against the cap; only then are frames decoded.

Frames are numbered in presentation order from 0 (by their timestamps, through the packet index) and
converted with PyAV's `to_ndarray(format="rgb24")`, as Hugging Face's `read_video_pyav`
(transformers/video_utils.py) does, so the same file gives HF's pixels.

Decoding uses up to `limits.decode_thread_count` threads (--video-decode-threads): the schedule's runs
(each begins at a keyframe, or at the stream's start) are split between threads, each decoding its share
on a container of its own; a schedule of one run (decoding in order, a video with few keyframes) is
decoded by FFmpeg's own codec threads instead. Either way every frame is decoded from the same keyframe
as on one thread, so the frames are the same. Only the sampled frames are converted to RGB, into their
place in the output, by one swscale context per thread (HF's `to_ndarray` makes one per frame: the same
pixels, several times slower).

Decoding stops, at the next frame of each thread, when its caller no longer wants it (`keep_going`: every
client of the job has gone, DecodeAbandoned) or when it has taken longer than `max_decode_s` (VideoError);
the threads are joined before decode_video returns or raises, so no decoding outlives it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from common.video.limits import VideoError, VideoLimits
from common.video.probe import VideoInfo, open_video, public_message
from common.video.schedule import DecodeSchedule, bounded_indices, index_packets, schedule_decoding

# Frames a run may decode beyond its schedule: after a seek, a decoder may output a few frames from
# before the keyframe (open groups of pictures). More than this means the index does not fit the stream.
SLACK_FRAMES_PER_RUN = 16
# A thread of its own for a part of the schedule only when each part has at least this many frames to
# decode: opening another container costs about as much as decoding a frame or two.
MIN_FRAMES_PER_THREAD = 8


class DecodeAbandoned(Exception):  # noqa: N818 - not an error: nobody is left to tell
    """Decoding stopped because nobody waits for the video any more."""


class _IndexMismatch(Exception):  # noqa: N818 - internal: decode in order instead
    """The decoded frames do not follow the packet index (timestamps differ, a sampled frame skipped)."""


class _Stopped(Exception):  # noqa: N818 - internal: another thread's error is the one raised
    """This thread stopped because another thread decoding the same video stopped (with its reason)."""


@dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of a video and where they came from."""

    frames: np.ndarray  # uint8 [n, H, W, 3], RGB
    indices: np.ndarray  # int64 [n], each frame's index in the stream, increasing
    info: VideoInfo
    frames_decoded: int = 0  # every frame decoded to reach them (the work it cost)


class _Progress:
    """The frames decoded so far, against the schedule's count, the time budget and the caller; shared by
    the threads decoding one video (the first to stop stops the others at their next frame)."""

    def __init__(self, limits: VideoLimits, keep_going: Callable[[], bool] | None) -> None:
        self.limits = limits
        self.keep_going = keep_going
        self.deadline = time.monotonic() + limits.max_decode_s
        self.decoded = 0
        self.allowed = 0  # raised by each schedule tried
        self.stopped = False  # a thread has stopped: the others stop at their next frame
        self._lock = threading.Lock()

    def frame(self) -> None:
        """One more frame decoded: stop when past the schedule, the time budget or the caller's interest,
        or when another thread has stopped."""
        with self._lock:
            if self.stopped:
                raise _Stopped
            try:
                self._count()
            except BaseException:
                self.stopped = True
                raise

    def _count(self) -> None:
        self.decoded += 1
        if self.decoded > self.allowed:
            raise _IndexMismatch
        if self.keep_going is not None and not self.keep_going():
            raise DecodeAbandoned
        if time.monotonic() > self.deadline:
            raise VideoError(f"decoding took longer than the limit of {self.limits.max_decode_s:g} s a video "
                             f"(--max-video-decode-seconds); stopped after {self.decoded} frames")

    def stop(self) -> None:
        """Stop every thread at its next frame (a thread failed outside `frame`)."""
        with self._lock:
            self.stopped = True


class _Output:
    """The sampled frames, filled in place as threads decode them: uint8 [n, H, W, 3] and which are in."""

    def __init__(self, indices: np.ndarray, info: VideoInfo) -> None:
        self.indices = indices
        self.slot = {int(i): n for n, i in enumerate(indices)}
        self.frames = np.empty((len(indices), info.height, info.width, 3), np.uint8)
        self.filled = np.zeros(len(indices), bool)

    def put(self, index: int, frame, reformatter) -> None:
        """Convert a decoded frame to RGB into its place with `reformatter` (a PyAV VideoReformatter of the
        calling thread's): the pixels of HF's `frame.to_ndarray(format="rgb24")`, which makes a new
        swscale context (and its pool of threads) for every frame."""
        n = self.slot[index]
        self.frames[n] = reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()
        self.filled[n] = True

    def has(self, index: int) -> bool:
        return bool(self.filled[self.slot[index]])

    def missing(self) -> list[int]:
        """The sampled indices not decoded (yet)."""
        return [int(i) for i in self.indices[~self.filled]]


def decode_frames(container, stream, info: VideoInfo, schedule: DecodeSchedule, progress: _Progress,
                  out: _Output) -> None:
    """Decode the schedule's runs on container and put their sampled frames into `out`."""
    from av.video.reformatter import VideoReformatter  # PyAV only where a video is opened

    reformatter = VideoReformatter()  # one swscale context for every frame this thread converts
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
                if index in out.slot:
                    out.put(index, frame, reformatter)  # only a sampled frame is converted
                if index >= run.last:
                    reached = True
                    break
            if position is not None and (not reached or any(
                    not out.has(i) for i in out.slot if run.first <= i <= run.last)):
                raise _IndexMismatch  # the stream skipped a sampled frame the index promised
    except (VideoError, DecodeAbandoned, _IndexMismatch, _Stopped):
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg raises many types for bad streams
        raise VideoError(f"cannot decode video frame {count}: {public_message(exc)}") from None


def plan_decoding(data: bytes, sample: Callable[[VideoInfo], Sequence[int]],
                  limits: VideoLimits = VideoLimits()) -> tuple[VideoInfo, np.ndarray, DecodeSchedule]:
    """(header, sampled indices, decode schedule) of encoded video bytes, nothing decoded: every cap of
    `limits` checked, the decode work (common/video/schedule.py) included. Where reaching the sampled
    frames would decode more than limits.max_decode_per_frame frames per frame kept, the indices are the
    nearest frames within that share (schedule.bounded_indices): the frames decoded and the timestamps
    reported are theirs. Raises VideoError."""
    with open_video(data, limits) as (container, stream, info):
        indices = np.asarray(sample(info), dtype=np.int64).reshape(-1)
        if indices.size == 0 or indices[0] < 0 or indices[-1] >= info.total_frames \
                or np.any(np.diff(indices) <= 0):
            raise ValueError(f"frame indices must increase within [0, {info.total_frames}): "
                             f"{indices.tolist()}")
        limits.check_decoded(int(indices.size), info.width, info.height)
        packets = index_packets(container, stream)
        schedule = schedule_decoding(packets, indices)
        per_frame = limits.max_decode_per_frame
        if per_frame and schedule.frames_to_decode > per_frame * indices.size:
            indices = np.asarray(bounded_indices(packets, indices, per_frame), dtype=np.int64)
            schedule = schedule_decoding(packets, indices)
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


def thread_plan(schedule: DecodeSchedule, threads: int) -> tuple[tuple[DecodeSchedule, ...], int]:
    """(parts of the schedule, each decoded on a thread and container of its own; FFmpeg codec threads
    per part) for `threads` threads: as many parts as threads, runs and MIN_FRAMES_PER_THREAD allow, and
    the threads left over to the codec of each part (all of them when there is one part)."""
    wanted = min(threads, max(1, schedule.frames_to_decode // MIN_FRAMES_PER_THREAD))
    parts = schedule.split(wanted)
    return parts, max(1, threads // len(parts))


def use_codec_threads(stream, threads: int) -> None:
    """Let FFmpeg decode the stream on `threads` threads (frame and slice threading, whichever the codec
    has); one thread: FFmpeg's default of one. Before the first frame is decoded."""
    if threads > 1:
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = threads


def _decode_part(data: bytes, limits: VideoLimits, info: VideoInfo, schedule: DecodeSchedule,
                 progress: _Progress, out: _Output, codec_threads: int) -> None:
    """One part of the schedule decoded on a container of its own."""
    with open_video(data, limits) as (container, stream, _):
        use_codec_threads(stream, codec_threads)
        decode_frames(container, stream, info, schedule, progress, out)


def _decode_parts(data: bytes, limits: VideoLimits, info: VideoInfo, parts: Sequence[DecodeSchedule],
                  progress: _Progress, out: _Output, codec_threads: int) -> None:
    """Each part on a thread of its own; every thread joined, then the first part's error raised (not a
    thread's _Stopped: the error that stopped it is another part's)."""

    def run(part: DecodeSchedule) -> None:
        try:
            _decode_part(data, limits, info, part, progress, out, codec_threads)
        except BaseException:
            progress.stop()
            raise

    with ThreadPoolExecutor(len(parts), thread_name_prefix="video-frames") as pool:
        futures = [pool.submit(run, part) for part in parts]
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None and not isinstance(error, _Stopped):
            raise error
    if any(errors):  # only stopped threads: cannot happen (a thread stops for another's error)
        raise VideoError("video decoding stopped")


def _decode(data: bytes, limits: VideoLimits, indices: np.ndarray, info: VideoInfo, schedule: DecodeSchedule,
            progress: _Progress) -> np.ndarray:
    """uint8 [len(indices), H, W, 3] RGB frames at the (increasing) indices, decoding only the schedule's
    runs, on up to limits.decode_thread_count threads."""
    slack = SLACK_FRAMES_PER_RUN * len(schedule.runs)
    before = progress.decoded
    progress.allowed = before + schedule.frames_to_decode + slack
    progress.stopped = False
    out = _Output(indices, info)
    parts, codec_threads = thread_plan(schedule, limits.decode_thread_count)
    if len(parts) == 1:
        _decode_part(data, limits, info, schedule, progress, out, codec_threads)
    else:
        _decode_parts(data, limits, info, parts, progress, out, codec_threads)
    missing = out.missing()
    if missing:
        raise VideoError(f"the video stream ended after {progress.decoded - before} frames; frame "
                         f"{missing[0]} was needed (the header says {info.total_frames})")
    return out.frames
