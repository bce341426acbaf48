"""What one service accepts as a video, and the one error type for a video it cannot use.

Every cap is checked against the container header (size of the bytes, duration, frame count, frame
size, container and codec) before any frame is decoded, as common/images.py does for images.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from common.arg_types import non_negative_int, positive_float, positive_int
from common.config import option
from common.errors import InvalidInputError

# Containers are sniffed from their magic bytes and the demuxer is forced to that one: FFmpeg's other
# demuxers (HLS, concat, image2 ...) can open further files or URLs named inside the data.
# Our name -> FFmpeg's demuxer name.
KNOWN_VIDEO_FORMATS = {"mp4": "mov", "matroska": "matroska", "avi": "avi"}
DEFAULT_VIDEO_FORMATS = ("mp4", "matroska", "avi")  # matroska covers .webm and .mkv
# Codecs by FFmpeg's canonical name; anything else (mjpeg, png, ffv1, raw ...) is refused from the header.
DEFAULT_VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")
# Threads decoding one video (common/video/decode.py) when --video-decode-threads is not given: at most
# this many, and no more than the cores this process may run on. The encoder decodes a few videos at once
# (encoder_svc/video_lane.py: two at once), so each takes some of the cores, not all of them. More buy
# nothing: on the H200's host a 30 s 448x448 clip decoded in 127.7 / 139.1 ms at 4 / 8 threads (H.264, four
# keyframe runs), 46.2 / 45.0 ms (MPEG-4); 233 / 136 ms on one thread (bench.video_serve's clip line).
MAX_DEFAULT_DECODE_THREADS = 4


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def default_decode_threads() -> int:
    """min(MAX_DEFAULT_DECODE_THREADS, available cores): one video's decode threads by default."""
    return min(MAX_DEFAULT_DECODE_THREADS, available_cores())


class VideoError(InvalidInputError):
    """A video that cannot be used (corrupt, no video stream, a codec refused, over a cap); the message
    says why. An InvalidInputError, so a service answers it as INVALID_ARGUMENT."""


def name_list(text: str, known: tuple[str, ...] | None = None) -> str:
    """An argparse type: a comma-separated list of lower-case names (from `known` when given)."""
    names = [n.strip().lower() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if known is not None and n not in known]
    if not names or unknown:
        choices = f": give names from {', '.join(known)}" if known else ""
        raise argparse.ArgumentTypeError(f"{unknown[0] if unknown else text!r}{choices}")
    return ",".join(dict.fromkeys(names))


def video_format_list(text: str) -> str:
    """An argparse type: containers from KNOWN_VIDEO_FORMATS."""
    return name_list(text, tuple(KNOWN_VIDEO_FORMATS))


@dataclass(frozen=True)
class VideoLimits:
    """What one service accepts, checked from the header before decoding."""

    max_bytes: int = option(256 * 1024 * 1024, "largest encoded video, bytes", flag="--max-video-bytes",
                            type=positive_int)
    max_duration_s: float = option(600.0, "longest video, seconds", flag="--max-video-seconds",
                                   type=positive_float)
    # Sampled frames (what the tower sees): a request's max_frames above it is refused, and a model's
    # larger default is lowered to it.
    max_frames: int = option(768, "most frames sampled from one video (a request's max_frames may not "
                             "exceed it)", flag="--max-video-frames", type=positive_int)
    # Frames in the stream, not sampled ones: decoding reads every frame up to the last sampled one, so
    # this bounds the decoding work (600 s at 30 fps by default).
    max_stream_frames: int = option(18000, "most frames in a video's stream, from its header",
                                    flag="--max-video-stream-frames", type=positive_int)
    max_pixels: int = option(3840 * 2160, "most pixels in one video frame", flag="--max-video-frame-pixels",
                             type=positive_int)
    formats: str = option(",".join(DEFAULT_VIDEO_FORMATS), "video containers accepted (mp4, matroska, avi)",
                          flag="--video-formats", type=video_format_list)
    codecs: str = option(",".join(DEFAULT_VIDEO_CODECS), "video codecs accepted (FFmpeg names)",
                         flag="--video-codecs", type=name_list)
    max_per_request: int = option(4, "most videos in one request", flag="--max-videos-per-request",
                                  type=positive_int)
    # The sampled frames are decoded at full size (HF resizes them afterwards, and so must we to match
    # it): 768 frames of 1080p would be 4.8 GB of host memory for one video.
    max_decoded_bytes: int = option(2 << 30, "most bytes of one video's sampled frames decoded (frames x "
                                    "width x height x 3), from the header", flag="--max-video-decoded-bytes",
                                    type=positive_int)

    # Every frame decoded to reach the sampled ones, at full size (common/video/schedule.py seeks to the
    # keyframe before each sampled frame): a long 1080p video with 4 frames sampled but a single keyframe
    # would otherwise decode thousands of frames. The default is about 5500 1080p frames (3 minutes at
    # 30 fps) or 1380 of 4K.
    max_decode_bytes: int = option(32 << 30, "most bytes of frames decoded to reach one video's sampled "
                                   "frames (frames decoded x width x height x 3), from the packet index "
                                   "before decoding", flag="--max-video-decode-bytes", type=positive_int)
    # What a request asked for bounds what it may cost: a sampled frame far past the only keyframe (a
    # long video of one group of pictures) would cost every frame before it. Past this many frames
    # decoded per frame kept, each sampled frame is replaced by the nearest frame at or before it that
    # is within that share (common/video/schedule.py: bounded_indices), and the frames' timestamps are
    # those of the frames used. Both services plan a video; the decoder with the default (no flag).
    max_decode_per_frame: int = option(
        64, "most frames decoded per sampled frame kept: past it a sampled frame far from any keyframe is "
        "replaced by the nearest frame before it within that share, and its timestamp reported (0: no "
        "bound but --max-video-decode-bytes). Decoders plan videos with the default: another value here "
        "changes which frames are encoded, not the timestamps in the prompt",
        flag="--max-video-decode-per-frame", type=non_negative_int)
    # The schedule bounds the work; this bounds its time on a loaded host (checked at each frame).
    max_decode_s: float = option(60.0, "most seconds one video's decoding may take",
                                 flag="--max-video-decode-seconds", type=positive_float)
    # Not a cap on what is accepted but on the threads one video's decoding uses (common/video/decode.py):
    # its decode runs (each from a keyframe) split between threads, or FFmpeg's own threads for a video of
    # one run. The frames are the same for any count.
    decode_threads: int | None = option(
        None, "threads decoding one video's frames: its runs from keyframe to sampled frame split between "
        "them, or FFmpeg's codec threads when there is one run (default: cores, at most 4; 1: one thread)",
        flag="--video-decode-threads", type=positive_int)

    def check_decode_work(self, frames: int, width: int, height: int) -> None:
        """VideoError when decoding `frames` frames of width x height would pass max_decode_bytes."""
        size = frames * width * height * 3
        if size > self.max_decode_bytes:
            raise VideoError(f"reaching the sampled frames means decoding {frames} frames of "
                             f"{width}x{height}, {size} bytes; the limit is {self.max_decode_bytes} "
                             "(--max-video-decode-bytes: sample fewer or earlier frames, or send a video "
                             "with more keyframes)")

    def check_decoded(self, frames: int, width: int, height: int) -> None:
        """VideoError when `frames` sampled frames of width x height would pass max_decoded_bytes."""
        size = frames * width * height * 3
        if size > self.max_decoded_bytes:
            raise VideoError(f"{frames} sampled frames of {width}x{height} are {size} bytes decoded; at "
                             f"most {self.max_decoded_bytes} (lower max_frames or max_pixels' frame size)")

    @property
    def decode_thread_count(self) -> int:
        """The threads one video's decoding may use: decode_threads, or default_decode_threads()."""
        return self.decode_threads if self.decode_threads is not None else default_decode_threads()

    def __post_init__(self) -> None:
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError(f"video limits: decode_threads must be at least 1, not {self.decode_threads}")
        try:
            video_format_list(self.formats)
            name_list(self.codecs)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"video limits: {exc}") from None

    @property
    def format_names(self) -> tuple[str, ...]:
        """The accepted containers, by our names (keys of KNOWN_VIDEO_FORMATS)."""
        return tuple(video_format_list(self.formats).split(","))

    @property
    def codec_names(self) -> tuple[str, ...]:
        """The accepted codecs, by FFmpeg's canonical names."""
        return tuple(name_list(self.codecs).split(","))
