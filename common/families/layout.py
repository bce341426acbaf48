"""The image layout a family declares: how its images (and videos) fill a prompt.

The tokenizer and the input processor ask this interface instead of testing which family they serve: how
to load the text processor, what the model's own placeholder tokens are, how many tokens an image takes
(a fixed count, or one that follows the image's size through a pixel range and a patch grid read from its
header), what the API's generic `<image>` marker becomes, and the positions of a prompt (M-RoPE or none).
A family's implementation lives in its folder (common/families/<name>/layout.py) and is named by its
ModelFamily's `layout` reference; the shared types (Grid, PixelRange, ImageGeometryError) are
common/image_geometry.py's.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from common.image_geometry import Grid, ImageGeometryError, ImageSettings, PixelRange

if TYPE_CHECKING:
    from common.video.rules import VideoConfig

# What a model without crops answers an image that asks for them (INVALID_ARGUMENT, the image named).
NO_PAN_AND_SCAN = ("pan_and_scan (do_pan_and_scan) is not supported by this model: only Gemma 3 cuts images "
                   "into pan-and-scan crops")

# (offset, grid) of an image, (offset, grid, temporal step) of a video run: what positions are made from
Span = tuple[int, Grid] | tuple[int, Grid, float]


@dataclass(frozen=True)
class TextProcessor:
    """What a checkpoint's prompts are rendered and tokenized with."""

    processor: Any  # has apply_chat_template (the full HF processor, or the tokenizer itself)
    tokenizer: Any
    image_token: str  # the model's image placeholder token


class ImageLayout(ABC):
    """One checkpoint's image side, as far as prompts, token counts and positions go.

    Capabilities are class data, so that callers branch on what a layout does, never on whose it is.
    """

    # token counts follow each image's size (pixel ranges, grids); a property where the checkpoint
    # decides (Gemma 3: only with pan-and-scan crops)
    sized_by_image: ClassVar[bool]
    # a sized layout's images are resized into a pixel range (a request's min/max_pixels); False where
    # only the image's shape sizes it (Gemma 3's pan-and-scan crops)
    pixel_ranges: ClassVar[bool] = True
    mrope: ClassVar[bool]  # positions are M-RoPE [3, tokens], computed once at admission
    # its video placeholder where the tokenizer names none; None: it takes no video
    video_token: ClassVar[str | None] = None
    # each image's tokens attend to each other whole during prefill (Gemma 3's token_type_ids mask): the
    # scheduler never splits an image across fresh chunks and attention extends each image row's keys
    bidirectional_images: ClassVar[bool] = False
    # an image may be cut into crops per request (Gemma 3's pan-and-scan): even where the layout sizes no
    # image by default, a hash-only image may have a grid (its crops) to look up
    per_image_crops: ClassVar[bool] = False
    merge_size: int  # patches merged per token side (1: none); a video's tokens per frame follow it
    # image embeddings carry this many DeepStack levels besides the rows themselves (Qwen3-VL: added to
    # the hidden states after the first layers); 0: plain rows
    deepstack_levels: int = 0

    @classmethod
    @abstractmethod
    def load_text_processor(cls, model_dir: str | Path) -> TextProcessor:
        """The checkpoint's processor, tokenizer and image placeholder token, offline."""

    @classmethod
    @abstractmethod
    def from_checkpoint(cls, model_dir: str | Path, config: dict[str, Any]) -> ImageLayout:
        """The layout of the checkpoint in model_dir whose config.json is `config`; CheckpointError (with
        the reason) when it cannot be served."""

    @property
    def takes_video(self) -> bool:
        """Video inputs are laid out by this layout."""
        return self.video_token is not None

    @property
    @abstractmethod
    def tokens_per_image(self) -> int | None:
        """The placeholder tokens of every image, or None where the count follows each image's grid."""

    def pixel_range(self, min_pixels: int = 0, max_pixels: int = 0, cap: int | None = None) -> PixelRange:
        """The range one image is resized into: a request's (0: the checkpoint's) within the cap."""
        raise ImageGeometryError("this model's images take no pixel range")

    def image_settings(self, min_pixels: int = 0, max_pixels: int = 0, pan_and_scan: bool | None = None,
                       cap: int | None = None) -> ImageSettings | None:
        """One image's processor settings from a request's options (0 / None: the checkpoint's): the pixel
        range where the layout resizes into one, else None (the pixel options then mean nothing, as they
        always have for fixed-size models). pan_and_scan true is refused here: only a layout with crops
        (Gemma 3) overrides this; false asks for what every other model does."""
        if pan_and_scan:
            raise ImageGeometryError(NO_PAN_AND_SCAN)
        if self.sized_by_image and self.pixel_ranges:
            return self.pixel_range(min_pixels, max_pixels, cap)
        return None

    def sizes_image(self, settings: ImageSettings | None) -> bool:
        """Whether an image with these settings has a grid from its size (its own token count): every image
        of a sized layout; for Gemma 3 each image with crops on."""
        return self.sized_by_image

    def max_pixels_for(self, max_tokens: int) -> int:
        """The pixel count at which an image would take max_tokens tokens (the server's cap)."""
        raise ImageGeometryError("this model's images take no pixel range")

    def grid(self, height: int, width: int, pixels: PixelRange) -> Grid:
        """(t, h, w) patch grid of an image of height x width pixels resized into `pixels`."""
        raise ImageGeometryError("this model's images have no grid")

    def check_grid(self, grid: Sequence[int]) -> Grid:
        """A grid reported for a hash-only image, checked."""
        raise ImageGeometryError("this model's images have no grid")

    @property
    def largest_image_run(self) -> int:
        """The most placeholder tokens of one run (one contiguous span: a bidirectional block) where the
        count per image is fixed, 0 where it follows the image; the runner's buffers hold one more."""
        return self.tokens_per_image or 0

    def request_adapter(self, has_images: bool, has_videos: bool) -> str | None:
        """The LoRA adapter (a --lora-modules name) a request without one of its own runs with, chosen by
        its content: the seam for a family whose checkpoint carries a modality adapter (Phi-4-multimodal
        runs image requests with its vision adapter and text with none). Default: none, the base model."""
        return None

    @property
    def hash_key(self) -> str:
        """Settings beyond the checkpoint's files (whose config, processor settings and weights the model
        fingerprint covers: common/checkpoint.py) that change an image's embedding, appended to the
        fingerprint its content hash is made under by both services ("": none)."""
        return ""

    @property
    def unserved_markers(self) -> dict[str, str]:
        """{placeholder token: what it stands for} of inputs the checkpoint names but no service takes
        (Phi-4-MM's `<|audio|>`): a prompt holding one is refused, never run on the token's bare
        embedding. Empty by default."""
        return {}

    @abstractmethod
    def num_tokens(self, grid: Sequence[int] | None = None) -> int:
        """Placeholder tokens (= embedding rows) of an image of this grid (None: a fixed-count layout's)."""

    def image_runs(self, count: int) -> list[int]:
        """The contiguous placeholder runs an image of `count` tokens is written as, in order: one by
        default; several where the model's text separates parts of one image (Gemma 3's pan-and-scan
        crops), which then share the image's one embedding."""
        return [count]

    def generic_image_text(self, image_token: str) -> str | None:
        """What the API's generic `<image>` marker stands for in a prompt without the model's own markers
        (the model's vision block around image_token); None where `<image>` is the model's own marker."""
        return None

    def marker_text(self, marker: str, count: int, runs: int = 1) -> str:
        """What one image marker of the prompt becomes before tokenizing, its placeholder written `count`
        times in each of its `runs` runs (image_runs; the tokenizer repeats the placeholder ids to each
        run's length afterwards): by default the marker is the placeholder, in one run."""
        if runs != 1:
            raise ImageGeometryError("this model writes each image as one run")
        return marker * count

    def video_config(self, model_dir: str | Path) -> VideoConfig | None:
        """The checkpoint's video rules (frame sampling, geometry, normalisation, timing: the
        VideoConfig of common/video/rules.py) in model_dir, None where the layout takes no video;
        CheckpointError where the checkpoint's video settings cannot be served."""
        return None

    def video_group_text(self, pads: str, seconds: float) -> str:
        """One timestamped group of a video's tokens, as the model's processor writes it."""
        raise ImageGeometryError("this model takes no video")

    def positions(self, num_tokens: int, spans: Sequence[Span]) -> tuple[np.ndarray, int] | None:
        """The positions of a prompt of num_tokens whose images and video runs are `spans`, and the delta
        generated tokens add to their index; None where positions are the plain token index."""
        return None


def read_json_or_empty(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file, or {} where it has none."""
    return json.loads(path.read_text()) if path.is_file() else {}


def read_processor_configs(model_dir: str | Path,
                           error: type[Exception]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(processor, image processor) config dicts of a checkpoint directory; `error` (the family's
    CheckpointError) when it has no image processor config.

    transformers 5 nests the image processor inside processor_config.json; checkpoints saved by older
    versions (the llava-hf ones, the Hub's Gemma 3) keep it in preprocessor_config.json.
    """
    model_dir = Path(model_dir)
    processor = read_json_or_empty(model_dir / "processor_config.json")
    image_processor = processor.pop("image_processor", None)
    if not isinstance(image_processor, dict):
        image_processor = read_json_or_empty(model_dir / "preprocessor_config.json")
    if not image_processor:
        raise error(f"{model_dir} has no image processor config (preprocessor_config.json or "
                    "processor_config.json)")
    return processor, image_processor
