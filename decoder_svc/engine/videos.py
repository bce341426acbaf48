"""Videos of a request, before any engine work: each video's header read and checked against the caps,
its frames chosen, grid, token count, timing and content hash known, without decoding a frame
(common/video's `plan_video`, the same function the encoder plans with, so both agree on the hash).

How a video fills the prompt depends on the family. Qwen2.5-VL: one run of t x h x w / 4 video tokens,
whose M-RoPE temporal positions step by tokens_per_second x seconds per temporal group. Qwen3-VL: one
run per temporal group, each after its `<t seconds>` text, laid out in M-RoPE as separate one-frame
grids (as its get_rope_index splits video grids). Either way the video is one embedding (one cache
entry); each run is a placeholder that takes its part of the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.checkpoint import CheckpointError, load_config
from common.families.layout import ImageLayout
from common.image_geometry import Grid
from common.memo import BoundedMemo
from common.video import VideoConfig, VideoError, VideoLimits, VideoPlan, plan_video, video_request_config
from common.video.hashing import hash_video_bytes
from decoder_svc.engine.embedding_source import VideoSource
from decoder_svc.engine.sampling_params import InvalidRequestError
from decoder_svc.tokenization import VideoPromptLayout

if TYPE_CHECKING:
    from decoder_svc.engine.config import EngineConfig

MAX_REMEMBERED_PLANS = 1024  # a plan is a few KB (its sampled frame indices)


@dataclass(frozen=True)
class VideoInputs:
    """One model's video rules; `base` is None for a model that takes no video."""

    base: VideoConfig | None
    limits: VideoLimits
    fingerprint: str
    merge_size: int
    tokens_per_second: float  # vision_config.tokens_per_second (an M-RoPE time axis' scale)
    max_videos: int
    # content hash -> plan of videos planned lately (plan runs on any input thread: the memo is thread-safe)
    _plans: BoundedMemo[VideoPlan] = field(default_factory=lambda: BoundedMemo(MAX_REMEMBERED_PLANS),
                                           compare=False, repr=False)

    @classmethod
    def for_model(cls, config: EngineConfig, fingerprint: str, layout: ImageLayout) -> VideoInputs:
        """The checkpoint's video processor settings, or no video support (a layout that takes none)."""
        base = None
        if layout.takes_video:
            try:
                base = layout.video_config(config.model)
            except CheckpointError:
                base = None
        vision = load_config(config.model).get("vision_config") or {}
        return cls(base, config.video_limits, fingerprint, layout.merge_size,
                   float(vision.get("tokens_per_second", 1)), config.video_limits.max_per_request)

    @property
    def timestamped(self) -> bool:
        """One prompt run per temporal group, each after its start time (the video rules say so)."""
        return self.base is not None and self.base.geometry.timestamped

    def plan(self, videos: Sequence[VideoSource], salt: str) -> list[tuple[VideoPlan, VideoSource]]:
        """Every video's plan (header only) and the source as the encoder is to be sent it: its settings
        resolved and written out, so that the encoder, whatever its own defaults and caps, processes
        (and hashes) it exactly as planned here. InvalidRequestError naming the video otherwise."""
        if self.base is None:
            raise InvalidRequestError("this model does not take video input")
        if len(videos) > self.max_videos:
            raise InvalidRequestError(f"{len(videos)} videos; at most {self.max_videos} per request")
        configs = []
        for i, video in enumerate(videos):
            if video.data is None:
                raise InvalidRequestError(f"video {i}: send the video's bytes (a video by content hash "
                                          "alone is not served by this decoder)")
            try:
                configs.append(video_request_config(self.base, video.fps, video.max_frames, video.min_pixels,
                                                    video.max_pixels, self.limits))
            except VideoError as exc:
                raise InvalidRequestError(f"video {i}: {exc}") from None
        plans = []
        for i, (video, config) in enumerate(zip(videos, configs, strict=True)):
            # Named by its bytes and settings first: a video planned before (a repeat) is not demuxed
            # again, and the same bytes under the same caps pass them the same way.
            key = hash_video_bytes(video.data, config, self.fingerprint, salt)
            plan = self._plans.get(key)
            if plan is None:
                try:
                    plan = plan_video(video.data, config, self.fingerprint, salt, self.limits,
                                      content_hash=key)
                except VideoError as exc:
                    raise InvalidRequestError(f"video {i}: {exc}") from None
                self._plans.put(key, plan)
            resolved = VideoSource(video.data, config.sampling.fps, config.sampling.max_frames,
                                   config.geometry.min_pixels, config.geometry.max_pixels)
            plans.append((plan, resolved))
        return plans

    def prompt_layout(self, plan: VideoPlan) -> VideoPromptLayout:
        """How the video's tokens go into the prompt."""
        t, h, w = plan.grid
        per_group = h * w // self.merge_size**2
        if self.timestamped:
            return VideoPromptLayout(t, per_group, tuple(plan.timing.timestamps))
        return VideoPromptLayout(1, t * per_group)

    def span_grid(self, plan: VideoPlan, runs: int) -> Grid:
        """The grid one run of the video covers in M-RoPE."""
        t, h, w = plan.grid
        return (1, h, w) if runs > 1 or self.timestamped else (t, h, w)

    def time_interval(self, plan: VideoPlan, runs: int) -> float:
        """M-RoPE temporal step of the run's groups (1 for Qwen3-VL's one-group runs)."""
        if self.timestamped or runs > 1:
            return 1.0
        return self.tokens_per_second * plan.timing.second_per_grid
