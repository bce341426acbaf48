"""Videos in the encoder service: a video's header is checked against the caps, its decode work counted
from its packet index and its content hash made from its bytes without decoding a frame (`plan_videos`,
off the event loop); a cache miss becomes a VideoJob, which the video lane (video_lane.py) decodes and
patches as HF's video processor does, on threads of its own, before the tower runs it with the video's
(t, h, w) grid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from common.errors import invalid_argument
from common.video import (
    VideoConfig,
    VideoError,
    VideoLimits,
    VideoPlan,
    decode_video,
    plan_video,
    video_input_config,
)
from common.video.hashing import hash_video_bytes
from common.video.patches import frames_to_rows
from common.vision.prepared import PreparedGrid


@dataclass(frozen=True)
class VideoJob:
    """A video to encode: its bytes, the config it is processed under and its header-derived plan; once
    decoded and patched (`decoded`), also its prepared input for the tower."""

    data: bytes
    config: VideoConfig
    limits: VideoLimits
    plan: VideoPlan
    prepared: PreparedGrid | None = None

    def decode(self, keep_going: Callable[[], bool] | None = None, patch: bool = True) -> PreparedGrid:
        """Decode the planned frames and patch them (patch=False: the frames as they are, for a tower that
        patches videos on its device). VideoError for a stream that breaks after its header or runs past
        its time budget; DecodeAbandoned once keep_going() (asked at every frame) is False."""
        video = decode_video(self.data, lambda _info: np.asarray(self.plan.indices, dtype=np.int64),
                             self.limits, keep_going)
        n, height, width, _ = video.frames.shape
        grid = self.config.geometry.grid(n, height, width)
        if tuple(grid) != tuple(self.plan.grid):  # the frames differ from what the header promised
            raise VideoError(f"decoded frames give grid {list(grid)}, the header {list(self.plan.grid)}")
        if not patch:
            return PreparedGrid(tuple(grid), frames=torch.from_numpy(video.frames), timing=self.plan.timing)
        rows = frames_to_rows(video.frames, grid, self.config)
        return PreparedGrid(tuple(grid), pixel_values=rows, timing=self.plan.timing)

    def decoded(self, keep_going: Callable[[], bool] | None = None, patch: bool = True) -> VideoJob:
        """This job with its frames decoded, and patched unless patch is False (see `decode`)."""
        return replace(self, prepared=self.decode(keep_going, patch))

    def prepare(self) -> PreparedGrid:
        """The tower's input (what the vision worker calls on a prep thread): the frames decoded by the
        video lane, or decoded here when the job comes straight to the worker."""
        return self.prepared if self.prepared is not None else self.decode()


def hash_only(index: int, video) -> str:
    """The checked content hash of a VideoInput without bytes."""
    from common.hashing import is_content_hash

    if video.WhichOneof("source") != "content_hash":
        raise invalid_argument(f"video {index}: neither data nor content_hash is set")
    text = video.content_hash.lower()
    if not is_content_hash(text):
        raise invalid_argument(f"video {index}: content_hash is not a 64-digit hex digest")
    return text


def video_file_key(video, base: VideoConfig | None, limits: VideoLimits, fingerprint: str,
                   salt: str) -> str | None:
    """The content hash a VideoInput with bytes will have (its bytes under its settings; nothing read but
    the settings), or None where it will be refused anyway (no video model, settings out of range)."""
    if base is None:
        return None
    try:
        config = video_input_config(base, video, limits)
    except VideoError:
        return None
    return hash_video_bytes(video.data, config, fingerprint, salt)


def plan_videos(videos: Sequence, base: VideoConfig, limits: VideoLimits, fingerprint: str,
                salt: str) -> list[tuple[str, VideoJob | None]]:
    """(content hash, job or None for a hash-only input) per VideoInput; every video's settings and
    header are checked before the first is hashed. INVALID_ARGUMENT naming the video otherwise."""
    configs: list[VideoConfig | None] = []
    for i, video in enumerate(videos):
        if video.WhichOneof("source") != "data":
            hash_only(i, video)
            configs.append(None)
            continue
        try:
            configs.append(video_input_config(base, video, limits))
        except VideoError as exc:
            raise invalid_argument(f"video {i}: {exc}") from None
    out: list[tuple[str, VideoJob | None]] = []
    for i, (video, config) in enumerate(zip(videos, configs, strict=True)):
        if config is None:
            out.append((hash_only(i, video), None))
            continue
        try:
            plan = plan_video(video.data, config, fingerprint, salt, limits)
        except VideoError as exc:
            raise invalid_argument(f"video {i}: {exc}") from None
        out.append((plan.content_hash, VideoJob(video.data, config, limits, plan)))
    return out
