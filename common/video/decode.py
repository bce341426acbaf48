"""Decoding the sampled frames of a video: the header is read and checked first (common.video.probe),
the frame indices are chosen from it, then frames are decoded in order only up to the last one needed.

Frames are numbered in decode (presentation) order from 0 and converted with PyAV's
`to_ndarray(format="rgb24")`, as Hugging Face's `read_video_pyav` (transformers/video_utils.py) does, so
the same file gives HF's pixels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.video.limits import VideoError, VideoLimits
from common.video.probe import VideoInfo, open_video, public_message


@dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of a video and where they came from."""

    frames: np.ndarray  # uint8 [n, H, W, 3], RGB
    indices: np.ndarray  # int64 [n], each frame's index in the stream, increasing
    info: VideoInfo


def decode_frames(container, stream, indices: np.ndarray, info: VideoInfo) -> np.ndarray:
    """uint8 [len(indices), H, W, 3] RGB frames at the (increasing) indices; decoding stops at the last."""
    wanted = set(int(i) for i in indices)
    last = int(indices[-1])
    out: list[np.ndarray] = []
    count = 0
    try:
        for frame in container.decode(stream):
            # The header's size was checked against the cap; a stream may change size later on.
            if (frame.width, frame.height) != (info.width, info.height):
                raise VideoError(f"video frame {count} is {frame.width}x{frame.height}; the header says "
                                 f"{info.width}x{info.height}")
            if count in wanted:
                out.append(frame.to_ndarray(format="rgb24"))
            count += 1
            if count > last:
                break
    except VideoError:
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg raises many types for bad streams
        raise VideoError(f"cannot decode video frame {count}: {public_message(exc)}") from None
    if len(out) < len(indices):
        raise VideoError(f"the video stream ended after {count} frames; frame {last} was needed (the header "
                         f"says {info.total_frames})")
    return np.stack(out)


def decode_video(data: bytes, sample: Callable[[VideoInfo], np.ndarray],
                 limits: VideoLimits = VideoLimits()) -> DecodedVideo:
    """Decode the frames `sample(info)` picks from encoded video bytes (e.g. FrameSampling.indices_for).

    Every cap in `limits` is checked from the header before any frame is decoded. Raises VideoError for
    empty, oversized, corrupt or truncated input, a container or codec not accepted, or no video stream.
    """
    with open_video(data, limits) as (container, stream, info):
        indices = np.asarray(sample(info), dtype=np.int64).reshape(-1)
        if indices.size == 0 or indices[0] < 0 or indices[-1] >= info.total_frames \
                or np.any(np.diff(indices) <= 0):
            raise ValueError(f"frame indices must increase within [0, {info.total_frames}): "
                             f"{indices.tolist()}")
        limits.check_decoded(int(indices.size), info.width, info.height)
        frames = decode_frames(container, stream, indices, info)
    return DecodedVideo(frames, indices, info)
