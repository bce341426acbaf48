"""Gemma 3's image layout: every image is `mm_tokens_per_image` soft tokens inside a fixed block.

Hugging Face's Gemma3Processor (transformers/models/gemma3/processing_gemma3.py) takes `<start_of_image>`
(the tokenizer's boi_token, which the chat template writes for each image part) as the prompt's image
marker and replaces each one with

    "\\n\\n" + boi_token + image_token * image_seq_length + eoi_token + "\\n\\n"

where image_token is `<image_soft_token>` (config.image_token_index: the rows the image features fill)
and image_seq_length is the processor's, which must equal the model's mm_tokens_per_image (the
projector pools the patch grid to that many rows). Unlike LLaVA and Qwen-VL, the marker in the prompt
is not the placeholder token in the ids: the marker is expanded into a block around the placeholders.

Pan-and-scan (the image processor config's do_pan_and_scan, or a request's per-image pan_and_scan, vLLM's
mm_processor_kwargs do_pan_and_scan, which overrides it) adds crops of an image whose aspect ratio
is far enough from square (HF's Gemma3ImageProcessor.pan_and_scan): each crop goes through the tower as
an image of its own, and Gemma3Processor writes that image's `<start_of_image>` as

    "Here is the original image " + block + " and here are some crops to help you see better "
    + " ".join([block] * num_crops)

where block is the no-crop expansion above. The crop count is a function of the image's (width, height)
and the processor's settings only (PanAndScan.num_crops, read from the header: no pixels decoded), so
an image with crops on is sized: its "grid" is (1 + crops, 1, 1), the images the tower takes, and its
tokens are (1 + crops) runs of mm_tokens_per_image, each its own bidirectional block (HF's mask groups
contiguous soft-token runs; the text between them breaks the runs). Each image's choice is a CropChoice
(common/image_geometry.py): its key, the crop rule's settings when on, is part of the content hash; the
rule itself (min crop size, max crops, min ratio) is always the checkpoint's (Gemma3Processor's defaults
where the config leaves it out), whichever side turned crops on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from common.checkpoint import CheckpointError
from common.families.layout import ImageLayout, TextProcessor, read_json_or_empty, read_processor_configs
from common.image_geometry import CropChoice, Grid, ImageGeometryError, ImageSettings

GEMMA3_MODEL_TYPES = ("gemma3",)


class UnsupportedGemmaConfigError(CheckpointError):
    """A Gemma 3 checkpoint whose image configuration cannot be served (the message says why)."""


# Gemma3Processor.images_kwargs: the values a checkpoint's config leaves null (google/gemma-3-4b-it's
# preprocessor_config.json does) mean these.
PAN_AND_SCAN_DEFAULTS = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                         "pan_and_scan_min_ratio_to_activate": 1.2}


@dataclass(frozen=True)
class PanAndScan:
    """The image processor's pan-and-scan settings (transformers' Gemma3ImageProcessor.pan_and_scan)."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    @classmethod
    def from_image_processor(cls, image_processor: dict[str, Any]) -> PanAndScan | None:
        """The settings of an image processor config; None where do_pan_and_scan is off (or null)."""
        if not image_processor.get("do_pan_and_scan"):
            return None
        return cls.rule_of(image_processor)

    @classmethod
    def rule_of(cls, image_processor: dict[str, Any]) -> PanAndScan:
        """The crop rule of an image processor config whether or not it turns crops on (a request may):
        Gemma3Processor's defaults for the settings it leaves out or null."""
        value = {k: image_processor.get(k) if image_processor.get(k) is not None else default
                 for k, default in PAN_AND_SCAN_DEFAULTS.items()}
        return cls(int(value["pan_and_scan_min_crop_size"]), int(value["pan_and_scan_max_num_crops"]),
                   float(value["pan_and_scan_min_ratio_to_activate"]))

    def processor_kwargs(self) -> dict[str, Any]:
        """The keyword arguments that make HF's image processor crop by these settings (passed on every
        call: the PIL processor reads null settings from a config as None and would fail on them)."""
        return {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": self.min_crop_size,
                "pan_and_scan_max_num_crops": self.max_num_crops,
                "pan_and_scan_min_ratio_to_activate": self.min_ratio_to_activate}

    def num_crops(self, height: int, width: int) -> int:
        """The crops HF's pan_and_scan cuts an image of height x width pixels into (0: none), step by
        step as it decides, so the counts agree for every size (tests/gemma3/test_pan_and_scan.py)."""
        if width >= height:  # square or landscape: crops side by side
            if width / height < self.min_ratio_to_activate:
                return 0
            across = min(int(math.floor(width / self.min_crop_size)), int(math.floor(width / height + 0.5)))
            across, down = min(self.max_num_crops, max(2, across)), 1
        else:  # portrait: crops stacked
            if height / width < self.min_ratio_to_activate:
                return 0
            down = min(int(math.floor(height / self.min_crop_size)), int(math.floor(height / width + 0.5)))
            across, down = 1, min(self.max_num_crops, max(2, down))
        # HF clamps to at least 2 crops first, then gives up where that makes a crop too small.
        if min(math.ceil(width / across), math.ceil(height / down)) < self.min_crop_size:
            return 0
        return across * down

    def key(self) -> str:
        """Part of an image's content hash: the same bytes with and without crops, or cut by another rule,
        are two embeddings. Every field of the rule, so a setting added to it cannot be left out."""
        return "pan_and_scan=" + ",".join(repr(getattr(self, f.name)) for f in fields(self))


@dataclass(frozen=True)
class Gemma3ImageLayout(ImageLayout):
    """The image side of a Gemma 3 checkpoint: a fixed count per image (or, with pan-and-scan, one block
    per tower image: the original and its crops), positions by token index."""

    mrope: ClassVar[bool] = False
    bidirectional_images: ClassVar[bool] = True
    per_image_crops: ClassVar[bool] = True
    merge_size: ClassVar[int] = 1

    mm_tokens_per_image: int  # soft tokens (= embedding rows) per image
    image_size: int  # the square side the image processor resizes to and the tower takes
    patch_size: int
    boi_token: str = "<start_of_image>"  # the prompt's image marker
    eoi_token: str = "<end_of_image>"
    image_token: str = "<image_soft_token>"  # the placeholder the features replace
    pan_and_scan: PanAndScan | None = None  # the checkpoint's crops (do_pan_and_scan); None: off
    # the rule crops follow when on (by the checkpoint or a request): the checkpoint's settings (None: a
    # checkpoint with crops off whose settings are unusable; a request cannot turn them on)
    crop_rule: PanAndScan | None = PanAndScan()

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
    def sized_by_image(self) -> bool:  # type: ignore[override]  # the base's class data, per checkpoint
        """With pan-and-scan an image's count follows its aspect ratio (its crops); without, it is fixed."""
        return self.pan_and_scan is not None

    # Crops follow the image's shape, never a pixel range: a request has no min/max_pixels to give.
    pixel_ranges: ClassVar[bool] = False

    @property
    def tokens_per_image(self) -> int | None:
        """mm_tokens_per_image: every image takes as many soft tokens; None with pan-and-scan (each crop
        adds as many)."""
        return None if self.pan_and_scan is not None else self.mm_tokens_per_image

    @property
    def largest_image_run(self) -> int:
        """One block (the original or a crop) is the longest run attending to itself whole."""
        return self.mm_tokens_per_image

    def crops(self, pan_and_scan: bool | None = None) -> CropChoice:
        """One image's choice: the request's (None: the checkpoint's do_pan_and_scan), keyed by the rule."""
        on = self.pan_and_scan is not None if pan_and_scan is None else bool(pan_and_scan)
        if self.crop_rule is None:
            if on:
                raise ImageGeometryError("this checkpoint's pan-and-scan settings are unusable: crops "
                                         "cannot be turned on")
            return CropChoice(False)
        return CropChoice(on, self.crop_rule.key())

    def image_settings(self, min_pixels: int = 0, max_pixels: int = 0, pan_and_scan: bool | None = None,
                       cap: int | None = None) -> CropChoice:
        """The image's crop choice; a pixel range means nothing here (images are resized to the tower's
        square), as before the switch existed."""
        return self.crops(pan_and_scan)

    def sizes_image(self, settings: ImageSettings | None) -> bool:
        """An image with crops on has a grid (its crop count follows its shape); one without is one block."""
        return self._crops_on(settings)

    def _crops_on(self, settings: ImageSettings | None) -> bool:
        return settings.on if isinstance(settings, CropChoice) else self.pan_and_scan is not None

    def grid(self, height: int, width: int, pixels: ImageSettings | None = None) -> Grid:
        """(1 + crops, 1, 1): the tower images of a height x width image, the original first, with crops
        as `pixels` (a CropChoice; None: the checkpoint's) chooses; (1, 1, 1) without."""
        if not self._crops_on(pixels) or self.crop_rule is None:
            return (1, 1, 1)
        return (1 + self.crop_rule.num_crops(height, width), 1, 1)

    def check_grid(self, grid: Sequence[int]) -> Grid:
        """A grid reported for a hash-only image: (1 + crops, 1, 1) with a crop count pan-and-scan makes."""
        most = 1 + (self.crop_rule.max_num_crops if self.crop_rule is not None else 0)  # HF clamps last
        if len(grid) != 3 or tuple(grid[1:]) != (1, 1) or not 1 <= int(grid[0]) <= most:
            raise ImageGeometryError(f"grid {tuple(grid)} is not (1 + crops, 1, 1) with at most {most - 1} "
                                     "crops")
        return (int(grid[0]), 1, 1)

    def num_tokens(self, grid: Sequence[int] | None = None) -> int:
        """mm_tokens_per_image per tower image: the original and each crop of `grid` (None: no crops);
        the blocks' boi/eoi/newlines and the crop sentence are ordinary text."""
        return (1 if grid is None else int(grid[0])) * self.mm_tokens_per_image

    def image_runs(self, count: int) -> list[int]:
        """An image of `count` soft tokens is one block of mm_tokens_per_image per tower image (more than
        one: crops, whether the checkpoint or the request turned them on)."""
        if count <= self.mm_tokens_per_image:
            return [count]
        if count % self.mm_tokens_per_image:
            raise ValueError(f"{count} soft tokens are not whole blocks of {self.mm_tokens_per_image}")
        return [self.mm_tokens_per_image] * (count // self.mm_tokens_per_image)

    def image_block(self, count: int | None = None) -> str:
        """What one `<start_of_image>` becomes (Gemma3Processor.full_image_sequence), with `count`
        placeholders (default: the image's mm_tokens_per_image)."""
        count = self.mm_tokens_per_image if count is None else count
        return f"\n\n{self.boi_token}{self.image_token * count}{self.eoi_token}\n\n"

    def marker_text(self, marker: str, count: int, runs: int = 1) -> str:
        """The marker `<start_of_image>` becomes its block, not a run of itself; an image of several runs
        (pan-and-scan: the original, then its crops) Gemma3Processor.replace_image_token's sentence
        around one block per run, `count` placeholders in each."""
        if runs == 1:
            return self.image_block(count)
        return (f"Here is the original image {self.image_block(count)} and here are some crops to help you "
                "see better " + " ".join([self.image_block(count)] * (runs - 1)))

    def expand_prompt(self, prompt: str, n_images: int, crops: Sequence[int] | None = None) -> str:
        """The prompt with each of its n_images `<start_of_image>` markers replaced by its text (image i
        with crops[i] crops; default none), as Gemma3Processor does (it requires the counts to match: so
        does this)."""
        found = prompt.count(self.boi_token)
        if found != n_images:
            raise ValueError(f"prompt has {found} {self.boi_token} markers but {n_images} images")
        pieces = prompt.split(self.boi_token)
        crops = list(crops or [0] * n_images)
        out = [pieces[0]]
        for n, piece in zip(crops, pieces[1:], strict=True):
            out += [self.marker_text(self.boi_token, self.mm_tokens_per_image, 1 + n), piece]
        return "".join(out)

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
    rule, problem = _crop_rule(image_processor)
    pan_and_scan = rule if image_processor.get("do_pan_and_scan") else None
    if problem and image_processor.get("do_pan_and_scan"):
        raise UnsupportedGemmaConfigError(problem)
    size = image_processor.get("size") or {}
    resized_to = (size.get("height"), size.get("width"))
    if image_processor.get("do_resize", True) and resized_to != (image_size, image_size):
        raise UnsupportedGemmaConfigError(
            f"the image processor resizes to {size} but the vision tower takes {image_size}x{image_size}")
    names = {k: (tokenizer or {}).get(k) for k in ("boi_token", "eoi_token", "image_token")}
    return Gemma3ImageLayout(tokens, image_size, patch, pan_and_scan=pan_and_scan, crop_rule=rule,
                             **{k: v for k, v in names.items() if isinstance(v, str)})


def _crop_rule(image_processor: dict[str, Any]) -> tuple[PanAndScan | None, str]:
    """The config's crop rule, or None and why it is unusable (refused at start-up only where the config
    turns crops on; otherwise requests cannot turn them on)."""
    try:
        rule = PanAndScan.rule_of(image_processor)
    except (TypeError, ValueError) as exc:
        return None, f"unreadable pan-and-scan settings: {exc}"
    if rule.min_crop_size < 1 or rule.max_num_crops < 1:
        return None, f"pan-and-scan settings out of range: {rule}"
    return rule, ""


def _check_pooling(image_size: int, patch: int, tokens: int) -> None:
    """The projector's AvgPool2d: a square token grid whose side divides the patch grid's, exactly (HF
    would silently drop the remainder's patches, or give a different count)."""
    side = int(tokens ** 0.5)
    patches = image_size // patch
    if side * side != tokens or side == 0 or patches % side or image_size % patch:
        raise UnsupportedGemmaConfigError(
            f"mm_tokens_per_image={tokens} does not pool a {patches}x{patches} patch grid ({image_size} px, "
            f"patch {patch}) evenly into a square grid")
