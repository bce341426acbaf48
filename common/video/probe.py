"""A video's header (container, codec, frame size, frame rate, frame count, duration), read with PyAV
without decoding a frame, and checked against VideoLimits."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from common.video.limits import KNOWN_VIDEO_FORMATS, VideoError, VideoLimits


@dataclass(frozen=True)
class VideoInfo:
    """What the header says about a video's first video stream."""

    format: str  # our container name (a key of KNOWN_VIDEO_FORMATS)
    codec: str  # FFmpeg's canonical codec name
    width: int
    height: int
    fps: float  # the stream's average frame rate, as HF's PyAV reader takes it
    total_frames: int
    duration_s: float
    frames_estimated: bool  # no frame count in the header (Matroska/WebM): duration x fps, rounded


def sniff_format(data: bytes) -> str | None:
    """The container by its magic bytes (our name), or None when it is none we know."""
    if data[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):  # ISO BMFF: mp4, mov, 3gp
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska and WebM
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def public_message(exc: BaseException) -> str:
    """An FFmpeg/PyAV error's message without file names or object reprs (those stay in the logs)."""
    text = getattr(exc, "strerror", None) or str(exc)
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "<data>", text)


def _duration_s(container, stream) -> float | None:
    if container.duration is not None and container.duration > 0:
        import av  # PyAV only where a video is opened: image-only hosts need not have it

        return container.duration / av.time_base
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    return None


def _info(container, stream, fmt: str, limits: VideoLimits) -> VideoInfo:
    """The stream's header values, each cap checked in turn (cheapest and most basic first)."""
    ctx = stream.codec_context
    codec = stream.codec.canonical_name if stream.codec is not None else None
    if codec is None or ctx is None:
        raise VideoError("the video stream's codec has no decoder here")
    if codec not in limits.codec_names:
        raise VideoError(f"video codec {codec} is not accepted (accepted: {', '.join(limits.codec_names)})")
    width, height = int(stream.width or 0), int(stream.height or 0)
    if width < 1 or height < 1:
        raise VideoError(f"the video header gives no frame size ({width}x{height})")
    if width * height > limits.max_pixels:
        raise VideoError(f"video frames of {width}x{height} have more than the {limits.max_pixels} pixels "
                         "allowed")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not math.isfinite(fps) or fps <= 0:
        raise VideoError("the video header gives no frame rate")
    header_duration = _duration_s(container, stream)
    estimated = not stream.frames
    if not estimated:
        total = int(stream.frames)
    elif header_duration is not None:
        total = round(header_duration * fps)
    else:
        raise VideoError("the video header gives neither a frame count nor a duration")
    if total < 1:
        raise VideoError("the video has no frames")
    if total > limits.max_stream_frames:
        raise VideoError(f"video of {total} frames exceeds the limit of {limits.max_stream_frames} frames "
                         "in a stream")
    duration = header_duration if header_duration is not None else total / fps
    if duration > limits.max_duration_s:
        raise VideoError(f"video of {duration:.1f} s exceeds the limit of {limits.max_duration_s:g} s")
    return VideoInfo(fmt, codec, width, height, fps, total, duration, estimated)


@contextmanager
def open_video(data: bytes,
               limits: VideoLimits = VideoLimits()) -> Iterator[tuple[object, object, VideoInfo]]:
    """(container, video stream, info) for encoded video bytes, every cap checked from the header and
    no frame decoded yet; the container is closed on exit. Raises VideoError."""
    if not data:
        raise VideoError("empty video bytes")
    if len(data) > limits.max_bytes:
        raise VideoError(f"video file of {len(data)} bytes exceeds the limit of {limits.max_bytes}")
    fmt = sniff_format(data)
    if fmt is None or fmt not in limits.format_names:
        raise VideoError(f"not an accepted video container (accepted: {', '.join(limits.format_names)})")
    try:
        import av  # PyAV only where a video is opened: image-only hosts need not have it

        container = av.open(io.BytesIO(data), format=KNOWN_VIDEO_FORMATS[fmt])
    except Exception as exc:  # noqa: BLE001 - FFmpeg raises many types for bad data
        raise VideoError(f"cannot read the video container: {public_message(exc)}") from None
    try:
        if not container.streams.video:
            raise VideoError("the file has no video stream")
        stream = container.streams.video[0]
        yield container, stream, _info(container, stream, fmt, limits)
    finally:
        container.close()


def probe_video(data: bytes, limits: VideoLimits = VideoLimits()) -> VideoInfo:
    """The header of encoded video bytes, every cap checked, nothing decoded. Raises VideoError."""
    with open_video(data, limits) as (_, _, info):
        return info
