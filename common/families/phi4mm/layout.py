"""Phi-4-multimodal's image layout: each image marker becomes a run of the image token whose length follows
the image's size through its HD crops.

Hugging Face's Phi4MultimodalProcessor (processing_phi4_multimodal.py) takes the tokenizer's image_token
(`<|image|>` in transformers' converted checkpoints; the chat template writes it for each image part) as
the prompt's marker and replaces each one with image_token * num_img_tokens; the model fills the rows
whose id is config.vision_config.image_token_id. (The original remote-code processor numbered its
markers, `<|image_1|>`, `<|image_2|>`: that format is not the transformers class's and is not read here.)

An image's "grid" here is (1, rows, cols) of its sub-image tokens after the 2x2 compression (the patch
rows and columns its crops' masks keep, halved, rounded up): its token count is rows * cols + rows (one
separator per row) + 273 (the global view's 16 x 17 and its separator), a pure function of the image's
width and height (pixels.num_tokens), read from the header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from common.checkpoint import CheckpointError
from common.families.layout import ImageLayout, TextProcessor, read_json_or_empty, read_processor_configs
from common.families.phi4mm.pixels import (
    CROP_SIZE,
    PATCH_SIZE,
    PixelSettings,
    UnsupportedPixelConfigError,
    global_tokens,
    hd_geometry,
)
from common.image_geometry import Grid, ImageGeometryError, PixelRange

PHI4MM_MODEL_TYPES = ("phi4_multimodal",)
DEFAULT_IMAGE_TOKEN = "<|image|>"
DEFAULT_AUDIO_TOKEN = "<|audio|>"
VISION_ADAPTER = "vision"  # the checkpoint's own LoRA image requests run with (FAMILY.checkpoint_adapters)


class UnsupportedPhi4ConfigError(CheckpointError):
    """A Phi-4-multimodal checkpoint whose image configuration cannot be served (the message says why)."""


@dataclass(frozen=True)
class Phi4ImageLayout(ImageLayout):
    """The image side of a Phi-4-multimodal checkpoint: HD crops, positions by token index."""

    sized_by_image: ClassVar[bool] = True
    # Crops follow the image's shape within the checkpoint's dynamic_hd: a request gives no pixel range.
    pixel_ranges: ClassVar[bool] = False
    mrope: ClassVar[bool] = False
    merge_size: ClassVar[int] = 1  # grids are already in tokens (after the 2x2 compression)

    settings: PixelSettings
    image_token: str = DEFAULT_IMAGE_TOKEN
    audio_token: str | None = DEFAULT_AUDIO_TOKEN  # the tokenizer's; its inputs are not served

    @classmethod
    def load_text_processor(cls, model_dir: str | Path) -> TextProcessor:
        """The tokenizer (chat template, image token); HF's full processor needs torchvision for its
        image half, and its only text work is the expansion marker_text does by the same rule."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        marker = getattr(tokenizer, "image_token", None) or DEFAULT_IMAGE_TOKEN
        return TextProcessor(tokenizer, tokenizer, marker)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: dict[str, Any]) -> Phi4ImageLayout:
        """The layout of a Phi-4-multimodal checkpoint; UnsupportedPhi4ConfigError with the reason."""
        _, image_processor = read_processor_configs(model_dir, UnsupportedPhi4ConfigError)
        tokens = read_json_or_empty(Path(model_dir) / "tokenizer_config.json")
        return phi4_layout(config, image_processor, tokens)

    @property
    def tokens_per_image(self) -> None:
        """None: the count follows each image's size."""
        return None

    def request_adapter(self, has_images: bool, has_videos: bool) -> str | None:
        """The checkpoint's vision LoRA for a request with images (as the original model switches to its
        vision adapter in vision mode); none, the base model, for text alone."""
        return VISION_ADAPTER if has_images else None

    @property
    def hash_key(self) -> str:
        """The HD transform's settings (the image processor config, which the checkpoint fingerprint does
        not cover): the same bytes under another dynamic_hd, crop, patch or normalisation are another
        embedding (PixelSettings.key: every field). Both services append it to the fingerprint an image's
        content hash is made under."""
        return "|phi4hd=" + self.settings.key()

    @property
    def unserved_markers(self) -> dict[str, str]:
        """The audio placeholder: Phi-4-MM's speech encoder is not served."""
        return {self.audio_token: "audio"} if self.audio_token else {}

    @property
    def largest_grid(self) -> Grid:
        """The grid of the most tokens any image can take: dynamic_hd crops in one column (each crop row
        adds a separator)."""
        per_crop = -(-self.settings.mask_size // 2)
        return 1, per_crop * self.settings.dynamic_hd, per_crop

    def grid(self, height: int, width: int, pixels: PixelRange | None = None) -> Grid:
        """(1, rows, cols) of the sub-image tokens of a height x width image (pixels: unused, the crop
        limit is the checkpoint's dynamic_hd); ImageGeometryError for a too extreme aspect ratio."""
        s = self.settings
        geo = hd_geometry(width, height, s.dynamic_hd, s.crop_size, s.patch_size)
        return 1, geo.token_rows, geo.token_cols

    def check_grid(self, grid: Sequence[int]) -> Grid:
        """A grid reported for a hash-only image: three positive ints, t = 1, within dynamic_hd crops."""
        if len(grid) != 3 or any(int(g) <= 0 for g in grid) or int(grid[0]) != 1:
            raise ImageGeometryError(f"grid {list(grid)} is not an image's (1, rows, cols)")
        per_crop = -(-self.settings.mask_size // 2)  # tokens per crop side: 16
        if -(-int(grid[1]) // per_crop) * -(-int(grid[2]) // per_crop) > self.settings.dynamic_hd:
            raise ImageGeometryError(f"grid {list(grid)} needs more than dynamic_hd="
                                     f"{self.settings.dynamic_hd} crops")
        return 1, int(grid[1]), int(grid[2])

    def num_tokens(self, grid: Sequence[int] | None = None) -> int:
        """rows * cols + rows + the global view's tokens."""
        if grid is None:
            raise ImageGeometryError("a Phi-4-multimodal image's token count needs its grid")
        rows, cols = int(grid[1]), int(grid[2])
        return rows * cols + rows + global_tokens(self.settings.crop_size, self.settings.patch_size)

    def tokens_for_size(self, width: int, height: int) -> int:
        """Tokens of a width x height image (num_tokens of its grid)."""
        return self.num_tokens(self.grid(height, width))

    def generic_image_text(self, image_token: str) -> str:
        """The API's generic `<image>` stands for the image token the chat template writes."""
        return image_token

    def expand_prompt(self, prompt: str, counts: Sequence[int]) -> str:
        """The prompt with its image tokens, in order, each repeated to its image's count (the text
        Phi4MultimodalProcessor tokenizes); ValueError when the marker count differs from len(counts)."""
        parts = prompt.split(self.image_token)
        if len(parts) - 1 != len(counts):
            raise ValueError(f"prompt has {len(parts) - 1} {self.image_token} markers but {len(counts)} "
                             "images")
        out = [parts[0]]
        for count, piece in zip(counts, parts[1:], strict=True):
            out += [self.marker_text(self.image_token, count), piece]
        return "".join(out)


def phi4_layout(config: dict[str, Any], image_processor: dict[str, Any],
                tokenizer: dict[str, Any] | None = None) -> Phi4ImageLayout:
    """The layout from config.json, the image processor config and tokenizer_config.json (the image and
    audio tokens' names; `<|image|>` and `<|audio|>` where absent)."""
    if config.get("model_type") not in PHI4MM_MODEL_TYPES:
        raise UnsupportedPhi4ConfigError(f"model_type {config.get('model_type')!r} is not Phi-4-multimodal")
    try:
        settings = PixelSettings.from_config(image_processor)
    except UnsupportedPixelConfigError as exc:
        raise UnsupportedPhi4ConfigError(f"image processor: {exc}") from exc
    vision = config.get("vision_config") or {}
    crop, image_size = int(vision.get("crop_size", CROP_SIZE)), int(vision.get("image_size", CROP_SIZE))
    patch = int(vision.get("patch_size", PATCH_SIZE))
    # The processor counts 256 + 16 + 1 global tokens, constants that hold at 448 px and 14 px patches
    # only; the model's layout follows its config: both must be the same shapes.
    served = (CROP_SIZE, PATCH_SIZE)
    processor_shape = (settings.crop_size, settings.patch_size)
    if processor_shape != served or (crop, image_size, patch) != (CROP_SIZE, *served):
        raise UnsupportedPhi4ConfigError(
            f"crops of {settings.crop_size} px / patch {settings.patch_size} (processor) and {crop} px, "
            f"tower {image_size} px / patch {patch} (model): only 448 px crops of 14 px patches are served "
            "(the processor's token count assumes them)")
    if settings.dynamic_hd < 1:
        raise UnsupportedPhi4ConfigError(f"dynamic_hd={settings.dynamic_hd}: at least one crop is needed")
    token, audio = (tokenizer or {}).get("image_token"), (tokenizer or {}).get("audio_token")
    return Phi4ImageLayout(settings, token if isinstance(token, str) else DEFAULT_IMAGE_TOKEN,
                           audio if isinstance(audio, str) else DEFAULT_AUDIO_TOKEN)
