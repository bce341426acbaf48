"""Gemma 3's image layout: every image is `mm_tokens_per_image` soft tokens inside a fixed block.

Hugging Face's Gemma3Processor (transformers/models/gemma3/processing_gemma3.py) takes `<start_of_image>`
(the tokenizer's boi_token, which the chat template writes for each image part) as the prompt's image
marker and replaces each one with

    "\\n\\n" + boi_token + image_token * image_seq_length + eoi_token + "\\n\\n"

where image_token is `<image_soft_token>` (config.image_token_index: the rows the image features fill)
and image_seq_length is the processor's, which must equal the model's mm_tokens_per_image (the
projector pools the patch grid to that many rows). Unlike LLaVA and Qwen-VL, the marker in the prompt
is not the placeholder token in the ids: the marker is expanded into a block around the placeholders.

Pan-and-scan (the processor's do_pan_and_scan) adds crops, each a further block, with a sentence
around them, so an image's token count would follow its aspect ratio: refused here, naming the option.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from common.checkpoint import CheckpointError
from common.families.layout import ImageLayout, TextProcessor, read_json_or_empty, read_processor_configs

GEMMA3_MODEL_TYPES = ("gemma3",)


class UnsupportedGemmaConfigError(CheckpointError):
    """A Gemma 3 checkpoint whose image configuration cannot be served (the message says why)."""


@dataclass(frozen=True)
class Gemma3ImageLayout(ImageLayout):
    """The image side of a Gemma 3 checkpoint: a fixed count per image, positions by token index."""

    sized_by_image: ClassVar[bool] = False
    mrope: ClassVar[bool] = False
    bidirectional_images: ClassVar[bool] = True
    merge_size: ClassVar[int] = 1

    mm_tokens_per_image: int  # soft tokens (= embedding rows) per image
    image_size: int  # the square side the image processor resizes to and the tower takes
    patch_size: int
    boi_token: str = "<start_of_image>"  # the prompt's image marker
    eoi_token: str = "<end_of_image>"
    image_token: str = "<image_soft_token>"  # the placeholder the features replace

    @classmethod
    def load_text_processor(cls, model_dir: str | Path) -> TextProcessor:
        """The tokenizer (it carries the chat template and the boi/eoi/image token names); the marker is
        `<start_of_image>`, as Gemma3Processor.image_token is. The full processor is not needed: its
        only text work is the expansion, which `expand_prompt` does by the same rule."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        marker = getattr(tokenizer, "boi_token", None) or "<start_of_image>"
        return TextProcessor(tokenizer, tokenizer, marker)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: dict[str, Any]) -> Gemma3ImageLayout:
        """The layout of a Gemma 3 checkpoint; UnsupportedGemmaConfigError with the reason otherwise."""
        processor, image_processor = read_processor_configs(model_dir, UnsupportedGemmaConfigError)
        tokens = read_json_or_empty(Path(model_dir) / "tokenizer_config.json")
        return gemma3_layout(config, processor, image_processor, tokens)

    @property
    def tokens_per_image(self) -> int:
        """mm_tokens_per_image: every image takes as many soft tokens."""
        return self.mm_tokens_per_image

    def num_tokens(self, grid: Sequence[int] | None = None) -> int:
        """mm_tokens_per_image, whatever the image (the block's boi/eoi/newlines are ordinary text)."""
        return self.mm_tokens_per_image

    def image_block(self, count: int | None = None) -> str:
        """What one `<start_of_image>` becomes (Gemma3Processor.full_image_sequence), with `count`
        placeholders (default: the image's mm_tokens_per_image)."""
        count = self.mm_tokens_per_image if count is None else count
        return f"\n\n{self.boi_token}{self.image_token * count}{self.eoi_token}\n\n"

    def marker_text(self, marker: str, count: int) -> str:
        """The marker `<start_of_image>` becomes its block, not a run of itself."""
        return self.image_block(count)

    def expand_prompt(self, prompt: str, n_images: int) -> str:
        """The prompt with each of its n_images `<start_of_image>` markers replaced by image_block(), as
        Gemma3Processor does (it requires the counts to match: so does this)."""
        found = prompt.count(self.boi_token)
        if found != n_images:
            raise ValueError(f"prompt has {found} {self.boi_token} markers but {n_images} images")
        return prompt.replace(self.boi_token, self.image_block())

    def generic_image_text(self, image_token: str) -> str:
        """The API's generic `<image>` stands for the marker the chat template writes."""
        return self.boi_token


def gemma3_layout(config: dict[str, Any], processor: dict[str, Any], image_processor: dict[str, Any],
                  tokenizer: dict[str, Any] | None = None) -> Gemma3ImageLayout:
    """The layout from config.json, processor_config.json (without its nested image processor), the image
    processor config and tokenizer_config.json (for the token names; Gemma's defaults where absent)."""
    if config.get("model_type") not in GEMMA3_MODEL_TYPES:
        raise UnsupportedGemmaConfigError(
            f"model_type {config.get('model_type')!r} is not a Gemma 3 checkpoint")
    vision = config.get("vision_config") or {}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise UnsupportedGemmaConfigError(f"vision tower {vision.get('model_type')!r}: only SigLIP is served")
    image_size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 16))
    tokens = int(config.get("mm_tokens_per_image", 256))
    _check_pooling(image_size, patch, tokens)
    seq = int(processor.get("image_seq_length") or image_processor.get("image_seq_length") or tokens)
    if seq != tokens:
        raise UnsupportedGemmaConfigError(
            f"the processor expands each image to {seq} tokens but the model's projector gives {tokens} "
            "(mm_tokens_per_image)")
    if image_processor.get("do_pan_and_scan"):
        raise UnsupportedGemmaConfigError(
            "do_pan_and_scan is set in the image processor config: pan-and-scan crops (a token count that "
            "follows each image's aspect ratio) are not served yet")
    size = image_processor.get("size") or {}
    resized_to = (size.get("height"), size.get("width"))
    if image_processor.get("do_resize", True) and resized_to != (image_size, image_size):
        raise UnsupportedGemmaConfigError(
            f"the image processor resizes to {size} but the vision tower takes {image_size}x{image_size}")
    names = {k: (tokenizer or {}).get(k) for k in ("boi_token", "eoi_token", "image_token")}
    return Gemma3ImageLayout(tokens, image_size, patch,
                             **{k: v for k, v in names.items() if isinstance(v, str)})


def _check_pooling(image_size: int, patch: int, tokens: int) -> None:
    """The projector's AvgPool2d: a square token grid whose side divides the patch grid's, exactly (HF
    would silently drop the remainder's patches, or give a different count)."""
    side = int(tokens ** 0.5)
    patches = image_size // patch
    if side * side != tokens or side == 0 or patches % side or image_size % patch:
        raise UnsupportedGemmaConfigError(
            f"mm_tokens_per_image={tokens} does not pool a {patches}x{patches} patch grid ({image_size} px, "
            f"patch {patch}) evenly into a square grid")
