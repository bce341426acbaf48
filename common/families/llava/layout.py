"""How many tokens one image takes, derived once from a LLaVA checkpoint's processor and vision config.

Both services use this: the decoder expands each `<image>` to that many tokens, the encoder promises
embeddings of that many rows. Hugging Face's LlavaProcessor counts

    (pixel height // patch) * (pixel width // patch) + num_additional_image_tokens - (1 if "default")

from the size its image processor outputs, while the model's features have

    (image_size // patch) ** 2 + (1 if the tower prepends a CLS row) - (1 if "default")

rows. The two agree on every checkpoint HF can run; a configuration where they would not, or where the
count would depend on the image (no fixed output size), is refused at start-up with the reason, rather
than failing every image request later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from common.checkpoint import CheckpointError, load_config
from common.families.layout import ImageLayout, TextProcessor
from common.families.layout import read_processor_configs as read_configs

# Vision towers we serve, and whether their hidden states start with a CLS row.
VISION_TOWER_HAS_CLS: dict[str, bool] = {"clip_vision_model": True, "siglip_vision_model": False}
SELECT_STRATEGIES = ("default", "full")


class UnsupportedImageConfigError(CheckpointError):
    """The checkpoint's image configuration cannot be served (the message says why)."""


@dataclass(frozen=True)
class ImageTokenLayout(ImageLayout):
    """The image side of a checkpoint, as far as token counts go: the same count for every image, the
    model's `<image>` as the marker, positions by token index, no video."""

    sized_by_image: ClassVar[bool] = False
    mrope: ClassVar[bool] = False
    merge_size: ClassVar[int] = 1

    num_image_tokens: int  # placeholder tokens per image == embedding rows per image
    pixel_size: tuple[int, int]  # (height, width) the image processor outputs
    patch_size: int
    vision_model_type: str
    has_cls: bool  # the tower's hidden states start with a CLS row
    select_strategy: str  # "default" drops the first row of each selected layer, "full" keeps all
    feature_layers: tuple[int, ...]  # hidden-state indexes, as the config gives them

    @classmethod
    def load_text_processor(cls, model_dir: str | Path) -> TextProcessor:
        """The checkpoint's full HF processor (LlavaProcessor) and its tokenizer."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        return TextProcessor(processor, processor.tokenizer, getattr(processor, "image_token", "<image>"))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: dict[str, Any]) -> ImageTokenLayout:
        """image_token_layout of the checkpoint in model_dir; UnsupportedImageConfigError with the reason
        for a configuration it cannot serve (any config no other family claims comes here: it says why)."""
        processor, image_processor = read_processor_configs(model_dir)
        return image_token_layout(config, processor, image_processor)

    @property
    def tokens_per_image(self) -> int:
        """num_image_tokens: every image takes as many."""
        return self.num_image_tokens

    def num_tokens(self, grid: Sequence[int] | None = None) -> int:
        """num_image_tokens, whatever the image."""
        return self.num_image_tokens

    @property
    def num_patches(self) -> int:
        """Patch rows of the tower's output."""
        return (self.pixel_size[0] // self.patch_size) * (self.pixel_size[1] // self.patch_size)


def processed_pixel_size(image_processor: dict[str, Any]) -> tuple[int, int]:
    """(height, width) of the pixel values an image processor config produces for any input image.

    A center crop fixes the size; without one, a resize to explicit height and width does. A resize
    to a shortest or longest edge alone (or to an integer size, which transformers reads as a shortest
    edge) keeps the aspect ratio, so the size would depend on the image: UnsupportedImageConfigError.
    """
    crop = image_processor.get("crop_size")
    if image_processor.get("do_center_crop", crop is not None) and crop is not None:
        return _square_or_hw(crop, "crop_size")
    size = image_processor.get("size")
    if not image_processor.get("do_resize", True) or size is None:
        raise UnsupportedImageConfigError(
            "the image processor neither crops nor resizes to a fixed size, so the image token count "
            "would depend on each image; only fixed-size LLaVA processors are supported")
    if isinstance(size, dict) and "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    # An int size means a shortest edge to transformers (SigLIP's processor included): not fixed.
    raise UnsupportedImageConfigError(
        f"the image processor resizes to size={size!r} without a center crop: the output keeps each "
        "image's aspect ratio, so the image token count would depend on the image; supported are "
        "crop_size, or size with height and width")


def _square_or_hw(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    raise UnsupportedImageConfigError(f"the image processor's {name}={value!r} is not a fixed size")


def image_token_layout(config: dict[str, Any], processor: dict[str, Any],
                       image_processor: dict[str, Any]) -> ImageTokenLayout:
    """The layout of a checkpoint from its config.json, processor_config.json (without the nested
    image processor; {} when the checkpoint has none) and image processor config.

    The processor's patch_size, vision_feature_select_strategy and num_additional_image_tokens win, as
    in HF's LlavaProcessor; missing ones are taken from the vision config (num_additional_image_tokens:
    1 for a tower with a CLS row). Raises UnsupportedImageConfigError with the reason otherwise.
    """
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise UnsupportedImageConfigError("config.json has no vision_config: not a LLaVA checkpoint")
    model_type = config.get("model_type", "llava")
    if model_type != "llava":  # e.g. llava_next: tiles each image, so its token count varies per image
        raise UnsupportedImageConfigError(
            f"model_type {model_type!r} is not supported; only LlavaForConditionalGeneration checkpoints "
            "(model_type 'llava')")
    tower = vision.get("model_type", "clip_vision_model")
    if tower not in VISION_TOWER_HAS_CLS:
        raise UnsupportedImageConfigError(
            f"vision tower {tower!r} is not supported; supported: {', '.join(VISION_TOWER_HAS_CLS)}")
    has_cls = VISION_TOWER_HAS_CLS[tower]
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in SELECT_STRATEGIES:
        raise UnsupportedImageConfigError(
            f"vision_feature_select_strategy {strategy!r} is not supported; supported: default, full")
    proc_strategy = processor.get("vision_feature_select_strategy") or strategy
    if proc_strategy != strategy:
        raise UnsupportedImageConfigError(
            f"the processor's vision_feature_select_strategy is {proc_strategy!r} but the model's is "
            f"{strategy!r}: placeholder tokens and image features would differ in number")
    layers = vision_feature_layers(config.get("vision_feature_layer", -2), vision["num_hidden_layers"])
    image_size, patch = int(vision["image_size"]), int(vision["patch_size"])
    proc_patch = int(processor.get("patch_size") or patch)
    if proc_patch != patch:
        raise UnsupportedImageConfigError(
            f"the processor's patch_size is {proc_patch} but the vision tower's is {patch}")
    pixels = processed_pixel_size(image_processor)
    if pixels != (image_size, image_size):
        raise UnsupportedImageConfigError(
            f"the image processor outputs {pixels[0]}x{pixels[1]} pixels but the vision tower takes "
            f"{image_size}x{image_size}")
    additional = processor.get("num_additional_image_tokens")
    additional = int(has_cls if additional is None else additional)
    dropped = 1 if strategy == "default" else 0
    patches = (pixels[0] // patch) * (pixels[1] // patch)
    placeholders = patches + additional - dropped
    features = (image_size // patch) ** 2 + int(has_cls) - dropped
    if placeholders != features:
        raise UnsupportedImageConfigError(
            f"the processor would expand each image to {placeholders} tokens (num_additional_image_tokens="
            f"{additional}) but the {tower} tower gives {features} feature rows "
            f"({'with' if has_cls else 'without'} a CLS row, strategy {strategy!r})")
    if placeholders < 1:
        raise UnsupportedImageConfigError(f"{placeholders} image tokens per image: nothing to serve")
    return ImageTokenLayout(placeholders, pixels, patch, tower, has_cls, strategy, layers)


def vision_feature_layers(layer: int | list[int], num_layers: int) -> tuple[int, ...]:
    """vision_feature_layer as a tuple, each index checked against the num_layers + 1 hidden states."""
    layers = (layer,) if isinstance(layer, int) else tuple(layer)
    if not layers:
        raise UnsupportedImageConfigError("vision_feature_layer is an empty list")
    for idx in layers:
        if not -(num_layers + 1) <= idx <= num_layers:
            raise UnsupportedImageConfigError(
                f"vision_feature_layer {idx} is outside the tower's {num_layers + 1} hidden states")
    return layers


def read_processor_configs(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(processor, image processor) config dicts of a checkpoint directory (common.families.layout's
    reader, refusing with UnsupportedImageConfigError)."""
    return read_configs(model_dir, UnsupportedImageConfigError)


def load_image_token_layout(model_dir: str | Path) -> ImageTokenLayout:
    """image_token_layout of a checkpoint directory."""
    processor, image_processor = read_processor_configs(model_dir)
    return image_token_layout(load_config(model_dir), processor, image_processor)
