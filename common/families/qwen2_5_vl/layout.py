"""The Qwen-VL image geometry (Qwen2.5-VL and Qwen3-VL): an image's patch grid from its size, its token
count, and M-RoPE positions.

Both services use this. The decoder counts an image's placeholder tokens from its header (width,
height) without decoding pixels; the encoder resizes to the same grid. As in Hugging Face's
Qwen2-VL image processor, an image is resized to multiples of patch x merge (Qwen2.5-VL: 28 px, Qwen3-VL:
32 px) with its pixel count inside [min_pixels, max_pixels] (`smart_resize`; both from the checkpoint's
preprocessor_config.json), cut into patches (14 px, 16 px; grid h x w, t = 1 for an image) and merged
2x2, so it takes h * w / 4 tokens.

M-RoPE (the language model's positions): a text token has the same position on all three axes (t, h,
w), counting on from the previous token; an image's tokens take (start, start + row, start + column)
over its merged grid, and the text after it continues from the largest position + 1. A request's
positions are computed once, at admission; generated tokens take `index + delta`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from common.checkpoint import CheckpointError, load_config
from common.families.layout import ImageLayout, Span, TextProcessor
from common.families.qwen2_5_vl.resize import smart_resize
from common.image_geometry import Grid, ImageGeometryError, PixelRange

if TYPE_CHECKING:
    from common.families.qwen2_5_vl.video_config import QwenVideoConfig

# Image layouts alike (read_qwen_layout); the embeddings differ (Qwen3-VL adds DeepStack parts)
QWEN_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class QwenImageLayout(ImageLayout):
    """The image side of a Qwen2.5-VL or Qwen3-VL checkpoint, as far as grids, token counts and positions
    go."""

    sized_by_image: ClassVar[bool] = True
    mrope: ClassVar[bool] = True
    video_token: ClassVar[str | None] = "<|video_pad|>"

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # the checkpoint's defaults
    max_pixels: int
    image_token_id: int
    vision_start_token_id: int
    deepstack_levels: int = 0  # the vision config's deepstack_visual_indexes (Qwen3-VL)

    @classmethod
    def load_text_processor(cls, model_dir: str | Path) -> TextProcessor:
        """The tokenizer, which carries the chat template: Qwen's full processor would also load a video
        processor (torchvision), which serving images does not need."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        return TextProcessor(tokenizer, tokenizer, getattr(tokenizer, "image_token", None) or "<|image_pad|>")

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: dict[str, Any]) -> QwenImageLayout:
        """load_qwen_layout's checks, on a config already read."""
        if not is_qwen_vl(config):
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen2.5-VL or Qwen3-VL "
                                  "checkpoint")
        return read_qwen_layout(model_dir, config)

    @property
    def tokens_per_image(self) -> None:
        """None: an image's count follows its grid."""
        return None

    @property
    def factor(self) -> int:
        """Sides are resized to multiples of this many pixels."""
        return self.patch_size * self.merge_size

    def pixel_range(self, min_pixels: int = 0, max_pixels: int = 0, cap: int | None = None) -> PixelRange:
        """The range for one image: a request may set min_pixels and lower max_pixels (0: the
        checkpoint's), within the server's cap on max_pixels. A min_pixels below the checkpoint's is taken
        as HF's processor and vLLM take it, raised to one merged block at least (a smaller one would let
        a tiny image round to no patch at all)."""
        top = self.max_pixels if cap is None else min(self.max_pixels, cap)
        lo = max(min_pixels or self.min_pixels, self.factor * self.factor)
        hi = max_pixels or top
        if hi > top:
            raise ImageGeometryError(f"max_pixels {hi} is above the server's limit of {top}")
        if lo > hi:
            raise ImageGeometryError(f"min_pixels {lo} is above max_pixels {hi}")
        if hi < self.factor * self.factor:
            raise ImageGeometryError(f"max_pixels {hi} is below one {self.factor}x{self.factor} block")
        return PixelRange(lo, hi)

    def max_pixels_for(self, max_tokens: int) -> int:
        """Pixels of max_tokens merged blocks."""
        return max_tokens * self.factor * self.factor

    def grid(self, height: int, width: int, pixels: PixelRange) -> Grid:
        """(t, h, w) patch grid of an image of height x width pixels."""
        h, w = smart_resize(height, width, self.factor, pixels.min_pixels, pixels.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Placeholder tokens (= embedding rows) of an image of this grid."""
        t, h, w = (int(x) for x in grid)
        return t * h * w // (self.merge_size * self.merge_size)

    def check_grid(self, grid: Sequence[int]) -> Grid:
        """A grid reported for a hash-only image, checked (t, h, w all positive, h and w merge-aligned)."""
        if len(grid) != 3 or min(grid) < 1 or grid[1] % self.merge_size or grid[2] % self.merge_size:
            raise ImageGeometryError(f"grid {list(grid)} is not a (t, h, w) grid this model can take")
        return int(grid[0]), int(grid[1]), int(grid[2])

    def generic_image_text(self, image_token: str) -> str:
        """The vision block the chat template writes around an image."""
        return f"<|vision_start|>{image_token}<|vision_end|>"

    def video_config(self, model_dir: str | Path) -> QwenVideoConfig:
        """The checkpoint's video rules (video_config.py here: Qwen2-VL's and Qwen3-VL's sampling, resize
        and timing, HF's defaults under the checkpoint's files; transformers loads only here)."""
        from common.families.qwen2_5_vl.video_config import load_qwen_video_config

        return load_qwen_video_config(model_dir)

    def video_group_text(self, pads: str, seconds: float) -> str:
        """Qwen3-VL's processor: each group's start time, then its run in a vision block."""
        return f"<{seconds:.1f} seconds><|vision_start|>{pads}<|vision_end|>"

    def positions(self, num_tokens: int, spans: Sequence[Span]) -> tuple[np.ndarray, int]:
        """M-RoPE positions (mrope_positions) over the merged grids."""
        return mrope_positions(num_tokens, spans, self.merge_size)


def mrope_positions(num_tokens: int, images: Sequence[tuple], merge_size: int) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, num_tokens] (int64) of a prompt whose images are (offset, grid) spans in
    token order, and the delta that generated tokens add to their index (as HF's get_rope_index).

    A video span is (offset, grid, time_interval): its temporal positions are int(index x interval)
    (Qwen2.5-VL: tokens_per_second x seconds per temporal group). As in transformers 5.24, the text
    after any span continues max(h, w) / merge past its start, whatever its temporal extent."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor, next_pos = 0, 0
    for offset, (t, h, w), *rest in sorted(images, key=lambda span: span[0]):
        text = offset - cursor
        out[:, cursor:offset] = np.arange(next_pos, next_pos + text)
        next_pos += text
        pattern, advance = span_pattern(int(t), int(h), int(w), merge_size, rest[0] if rest else None)
        n = pattern.shape[1]
        np.add(pattern, next_pos, out=out[:, offset:offset + n])
        next_pos += advance
        cursor = offset + n
    out[:, cursor:] = np.arange(next_pos, next_pos + num_tokens - cursor)
    top = int(out.max()) if num_tokens else -1
    return out, top + 1 - num_tokens


@functools.lru_cache(maxsize=256)
def span_pattern(t: int, h: int, w: int, merge_size: int, interval: float | None) -> tuple[np.ndarray, int]:
    """One span's positions from its start ([3, tokens], read-only: shared by every span of this grid,
    e.g. a video's groups) and how far the text after it moves on. interval None: an image's temporal
    positions 0..t-1; else a video's int(index x interval)."""
    gh, gw = h // merge_size, w // merge_size
    # float32 as torch computes it, truncated as .long() does
    temporal = ((np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
                if interval is not None else np.arange(t))
    tt, hh, ww = np.meshgrid(temporal, np.arange(gh), np.arange(gw), indexing="ij")
    pattern = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]).astype(np.int64)
    pattern.flags.writeable = False
    return pattern, (max(gh, gw) if t * gh * gw else 0)


def is_qwen_vl(config: dict[str, Any]) -> bool:
    """True for a Qwen2.5-VL or Qwen3-VL checkpoint's config.json: images laid out by grid."""
    return config.get("model_type") in QWEN_MODEL_TYPES


def load_qwen_layout(model_dir: str | Path) -> QwenImageLayout:
    """The layout from config.json and preprocessor_config.json; CheckpointError when it cannot be served."""
    return QwenImageLayout.from_checkpoint(model_dir, load_config(model_dir))


def read_qwen_layout(model_dir: str | Path, config: dict[str, Any]) -> QwenImageLayout:
    """The layout of a checkpoint whose config.json is `config`, whatever its model type (Qwen2.5-VL and
    Qwen3-VL lay images out alike: only the patch size and pixel range differ, both read here)."""
    vision = config.get("vision_config") or {}
    path = Path(model_dir) / "preprocessor_config.json"
    proc = json.loads(path.read_text()) if path.is_file() else {}
    size = proc.get("size") or {}
    patch = int(proc.get("patch_size", vision.get("patch_size", 14)))
    merge = int(proc.get("merge_size", vision.get("spatial_merge_size", 2)))
    temporal = int(proc.get("temporal_patch_size", vision.get("temporal_patch_size", 2)))
    if patch != int(vision.get("patch_size", patch)) or merge != int(vision.get("spatial_merge_size", merge)):
        raise CheckpointError(f"the image processor's patch {patch} / merge {merge} differ from the vision "
                              f"tower's {vision.get('patch_size')} / {vision.get('spatial_merge_size')}")
    min_pixels = int(size.get("shortest_edge") or proc.get("min_pixels") or 56 * 56)
    max_pixels = int(size.get("longest_edge") or proc.get("max_pixels") or 28 * 28 * 1280)
    text = config.get("text_config") or {}
    image_token = config.get("image_token_id", text.get("image_token_id"))
    vision_start = config.get("vision_start_token_id", text.get("vision_start_token_id"))
    if image_token is None or vision_start is None:
        raise CheckpointError("config.json names no image_token_id / vision_start_token_id")
    return QwenImageLayout(patch, merge, temporal, min_pixels, max_pixels, int(image_token),
                           int(vision_start), len(vision.get("deepstack_visual_indexes") or ()))
