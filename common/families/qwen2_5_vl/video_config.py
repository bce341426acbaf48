"""A Qwen VL checkpoint's video processor settings: sampling, geometry, normalisation and timing (the
VideoConfig of common/video/rules.py; Qwen3-VL's rules live here beside Qwen2.5-VL's, as its layout does).

The defaults are Hugging Face's class attributes (Qwen2VLVideoProcessor, also Qwen2.5-VL's; and
Qwen3VLVideoProcessor); a checkpoint's files override them in HF's order: processor_config.json's
"video_processor", else video_preprocessor_config.json, else preprocessor_config.json (HF's
`get_video_processor_dict`; a Qwen2.5-VL checkpoint usually has only the last, so its video frames take
the image min/max pixels, as in HF).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from transformers.image_utils import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
)

from common.checkpoint import CheckpointError, load_config
from common.families.qwen2_5_vl.video_geometry import VideoGeometry
from common.families.qwen2_5_vl.video_sampling import FrameSampling
from common.families.qwen2_5_vl.video_timing import video_timing
from common.video.rules import VideoTiming

# model_type -> family (the sampling and resize rules)
VIDEO_MODEL_FAMILIES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl",
                        "qwen3_vl_moe": "qwen3_vl", "qwen3_5": "qwen3_vl", "qwen3_5_moe": "qwen3_vl"}


@dataclass(frozen=True)
class QwenVideoConfig:
    """Everything that turns a video file into a Qwen model's patches and tokens."""

    sampling: FrameSampling
    geometry: VideoGeometry
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255

    def with_request(self, fps: float | None = None, max_frames: int | None = None) -> QwenVideoConfig:
        """This config with a request's fps / max_frames (None: keep the checkpoint's)."""
        sampling = replace(self.sampling, **{k: v for k, v in (("fps", fps), ("max_frames", max_frames))
                                             if v is not None})
        return replace(self, sampling=sampling)

    def key(self) -> str:
        """Every parameter that changes a video's patches, for its content hash."""
        return (f"{self.sampling.key()};{self.geometry.key()};mean={list(self.image_mean)};"
                f"std={list(self.image_std)};rescale={self.rescale_factor!r}")

    def timing(self, indices: Sequence[int], total_frames: int, video_fps: float) -> VideoTiming:
        """Both timings (Qwen3-VL's group timestamps, Qwen2.5-VL's seconds per group) of frames sampled at
        indices from a video of total_frames at video_fps."""
        return video_timing(indices, total_frames, video_fps, self.geometry.temporal_patch_size)


# HF's class defaults. Qwen2VLVideoProcessor samples no frames by default (do_sample_frames=False, for
# backward compatibility); fps=2 is qwen-vl-utils' default, with which Qwen2.5-VL is usually served.
QWEN2_VL_VIDEO = QwenVideoConfig(
    FrameSampling("qwen2_vl", fps=2.0, min_frames=4, max_frames=768, temporal_patch_size=2),
    VideoGeometry("qwen2_vl", 14, 2, 2, 128 * 28 * 28, 28 * 28 * 768, max_video_tokens=128000),
    tuple(OPENAI_CLIP_MEAN), tuple(OPENAI_CLIP_STD))
QWEN3_VL_VIDEO = QwenVideoConfig(
    FrameSampling("qwen3_vl", fps=2, min_frames=4, max_frames=768, temporal_patch_size=2),
    VideoGeometry("qwen3_vl", 16, 2, 2, 128 * 32 * 32, 32 * 32 * 768, max_video_tokens=768),
    tuple(IMAGENET_STANDARD_MEAN), tuple(IMAGENET_STANDARD_STD))


def qwen_video_config(model_type: str, processor: dict[str, Any] | None = None) -> QwenVideoConfig:
    """The video config of a model_type, with a processor dict's keys (as HF's files spell them) applied."""
    family = VIDEO_MODEL_FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(f"model_type {model_type!r} has no video support here")
    base = QWEN2_VL_VIDEO if family == "qwen2_vl" else QWEN3_VL_VIDEO
    p = processor or {}
    size = p.get("size") or {}
    g, s = base.geometry, base.sampling
    temporal = int(p.get("temporal_patch_size", g.temporal_patch_size))
    # Qwen2VLVideoProcessor.__init__ lets min_pixels / max_pixels override size
    lo = p.get("min_pixels") if family == "qwen2_vl" and p.get("min_pixels") else size.get("shortest_edge")
    hi = p.get("max_pixels") if family == "qwen2_vl" and p.get("max_pixels") else size.get("longest_edge")
    geometry = replace(g, patch_size=int(p.get("patch_size", g.patch_size)),
                       merge_size=int(p.get("merge_size", g.merge_size)), temporal_patch_size=temporal,
                       min_pixels=int(lo or g.min_pixels), max_pixels=int(hi or g.max_pixels),
                       cap_pixels_per_frame=bool(p.get("cap_pixels_per_frame") or False),
                       max_video_tokens=int(p.get("max_video_tokens", g.max_video_tokens)))
    sampling = replace(s, fps=float(p.get("fps") or s.fps), min_frames=int(p.get("min_frames", s.min_frames)),
                       max_frames=int(p.get("max_frames", s.max_frames)), temporal_patch_size=temporal)
    return QwenVideoConfig(sampling, geometry, tuple(float(x) for x in p.get("image_mean", base.image_mean)),
                           tuple(float(x) for x in p.get("image_std", base.image_std)),
                           float(p.get("rescale_factor", base.rescale_factor)))


def load_qwen_video_config(model_dir: str | Path) -> QwenVideoConfig:
    """The checkpoint's video config from its files, in HF's order of precedence."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    processor: dict[str, Any] | None = None
    combined = model_dir / "processor_config.json"
    if combined.is_file():
        processor = json.loads(combined.read_text()).get("video_processor")
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if processor is None and (model_dir / name).is_file():
            processor = json.loads((model_dir / name).read_text())
    return qwen_video_config(str(config.get("model_type")), processor)
