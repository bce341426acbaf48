"""Phi-4-multimodal's HD transform without torchvision: an image becomes a global view and a grid of
square crops, as Hugging Face's Phi4MultimodalImageProcessor (image_processing_phi4_multimodal.py) makes
them, op for op:

1. the crop grid: ceil(W / 448) x ceil(H / 448) crops, or, past `dynamic_hd` crops, the (w, h) grid of at
   most dynamic_hd crops whose aspect ratio is nearest the image's (ties: the later, larger grid when the
   image's area exceeds half of it);
2. the uint8 image resized to fill the grid on its limiting side, aspect kept (torchvision's resize:
   bilinear, antialiased; on a CPU with AVX2 or AVX-512 torch's native uint8 kernel, elsewhere float32 and
   round), then padded right and bottom with white (255) to the grid;
3. rescaled and normalised in float32 ((x - 127.5) / 127.5 with the checkpoint's 0.5 mean and std);
4. the global view: that padded, normalised image resized to one crop (bicubic, not antialiased, float32);
5. the crops, row-major, after the global view; a patch mask per crop, 0 on the patch columns and rows that
   are only padding (floor(padding / patch) of them), 1 elsewhere and on the global view.

torchvision's tensor resize is torch.nn.functional.interpolate with those arguments, so this module calls
the same kernels and is bit-exact with the processor run on a CPU (bench/phi4mm_pixels_check.py checks it
against HF's processor where torchvision is installed). The token count is a pure function of the image's
width and height (num_tokens): the layout counts tokens from the header without decoding pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from PIL import Image

from common.image_geometry import ImageGeometryError

CROP_SIZE = 448
PATCH_SIZE = 14
DEFAULT_DYNAMIC_HD = 36
PAD_VALUE = 255  # the processor pads with white before normalising


class UnsupportedPixelConfigError(ValueError):
    """An image processor config whose transform this module does not reproduce (the message says why)."""


@dataclass(frozen=True)
class PixelSettings:
    """The image processor settings the HD transform reads (Phi4MultimodalImageProcessor's defaults)."""

    crop_size: int = CROP_SIZE
    patch_size: int = PATCH_SIZE
    dynamic_hd: int = DEFAULT_DYNAMIC_HD
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def key(self) -> str:
        """Every setting as text, for the image's content hash: all of them change its pixels or its crops,
        so a field added here is hashed without another edit."""
        return ",".join(repr(list(v) if isinstance(v, tuple) else v)
                        for v in (getattr(self, f.name) for f in fields(self)))

    @property
    def mask_size(self) -> int:
        """Patches per crop side (32 at 448 px, patch 14)."""
        return self.crop_size // self.patch_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PixelSettings:
        """The settings of an image processor config dict; UnsupportedPixelConfigError for options the
        transform here does not follow (non-square crops, rescale or normalise turned off)."""
        size = config.get("size") or {"height": CROP_SIZE, "width": CROP_SIZE}
        if size.get("height") != size.get("width"):
            raise UnsupportedPixelConfigError(f"non-square crops {size}: the processor refuses them too")
        for flag in ("do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag, True) is False:
                raise UnsupportedPixelConfigError(f"{flag}=false is not reproduced")
        return cls(crop_size=int(size["height"]), patch_size=int(config.get("patch_size", PATCH_SIZE)),
                   dynamic_hd=int(config.get("dynamic_hd", DEFAULT_DYNAMIC_HD)),
                   image_mean=tuple(config.get("image_mean", cls.image_mean)),
                   image_std=tuple(config.get("image_std", cls.image_std)),
                   rescale_factor=float(config.get("rescale_factor", 1 / 255)))


@dataclass(frozen=True)
class HDGeometry:
    """Where an image of a given size goes: its crop grid, its resized size and padding, and the patch
    rows and columns of its crops that hold image (the rest is padding, masked)."""

    w_crops: int
    h_crops: int
    resized_width: int
    resized_height: int
    pad_width: int
    pad_height: int
    valid_patch_cols: int  # over the whole grid (w_crops * mask_size at most)
    valid_patch_rows: int

    @property
    def crops(self) -> int:
        """Crops, without the global view."""
        return self.w_crops * self.h_crops

    @property
    def token_rows(self) -> int:
        """Rows of sub-image tokens after the 2x2 compression (the mask sampled at every other patch)."""
        return math.ceil(self.valid_patch_rows / 2)

    @property
    def token_cols(self) -> int:
        """Columns of sub-image tokens after the 2x2 compression."""
        return math.ceil(self.valid_patch_cols / 2)


def _closest_aspect_ratio(aspect: float, ratios: list[tuple[int, int]], width: int, height: int,
                          crop: int) -> tuple[int, int]:
    """The processor's find_closest_aspect_ratio, tie rule included: on an equal difference the later
    (larger) grid wins when the image's area exceeds half of that grid's."""
    best_diff, best = float("inf"), (1, 1)
    area = width * height
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * crop * crop * ratio[0] * ratio[1]:
            best = ratio
    return best


def _target_ratios(max_num: int, min_num: int = 1) -> list[tuple[int, int]]:
    """The candidate (w, h) grids in the processor's order: built as a set, then sorted stably by crop
    count. The order among equal counts is the set's iteration order, which is CPython's (deterministic
    for tuples of ints); it matters only through the tie rule above, so it is kept exactly."""
    ratios = {(i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
              if min_num <= i * j <= max_num}
    return sorted(ratios, key=lambda x: x[0] * x[1])


def hd_geometry(width: int, height: int, dynamic_hd: int = DEFAULT_DYNAMIC_HD, crop_size: int = CROP_SIZE,
                patch_size: int = PATCH_SIZE) -> HDGeometry:
    """The crop grid, resize and padding of a width x height image (dynamic_preprocess's arithmetic);
    ImageGeometryError for an image so thin that a side would shrink under 10 px, as the processor
    refuses it."""
    if width <= 0 or height <= 0:
        raise ImageGeometryError(f"an image of {width}x{height} px has no pixels")
    w_crops, h_crops = math.ceil(width / float(crop_size)), math.ceil(height / float(crop_size))
    if w_crops * h_crops > dynamic_hd:
        w_crops, h_crops = _closest_aspect_ratio(width / height, _target_ratios(dynamic_hd), width, height,
                                                 crop_size)
    target_w, target_h = crop_size * w_crops, crop_size * h_crops
    ratio_w, ratio_h = target_w / width, target_h / height
    if ratio_w < ratio_h:
        new_w, new_h = target_w, int(height * ratio_w)
    else:
        new_w, new_h = int(width * ratio_h), target_h
    if min(new_h, target_h) < 10 or min(new_w, target_w) < 10:
        raise ImageGeometryError(f"the aspect ratio of a {width}x{height} image is too extreme: it would be "
                                 f"resized to {new_w}x{new_h} px")
    pad_w, pad_h = target_w - new_w, target_h - new_h
    mask = crop_size // patch_size
    # floor(padding / patch) whole patch columns (rows) are masked; under one patch of padding, none.
    cols = mask * w_crops - (pad_w // patch_size if pad_w >= patch_size else 0)
    rows = mask * h_crops - (pad_h // patch_size if pad_h >= patch_size else 0)
    return HDGeometry(w_crops, h_crops, new_w, new_h, pad_w, pad_h, cols, rows)


def global_tokens(crop_size: int = CROP_SIZE, patch_size: int = PATCH_SIZE) -> int:
    """Tokens of the global view with its row separators, and the separator before it: 16 x 17 + 1 at 448
    px (the processor writes them as the constants 256 + 16 + 1)."""
    side = math.ceil(crop_size // patch_size / 2)
    return side * side + side + 1


def num_tokens(width: int, height: int, dynamic_hd: int = DEFAULT_DYNAMIC_HD, crop_size: int = CROP_SIZE,
               patch_size: int = PATCH_SIZE) -> int:
    """Image tokens of a width x height image (the processor's num_img_tokens): the sub-image's
    compressed rows x columns, one separator per row, then the global view's 273. From the header alone."""
    geo = hd_geometry(width, height, dynamic_hd, crop_size, patch_size)
    return geo.token_rows * geo.token_cols + geo.token_rows + global_tokens(crop_size, patch_size)


@dataclass(frozen=True)
class Phi4Pixels:
    """One image, ready for the tower: what Phi4MultimodalImageProcessor returns for it alone."""

    pixel_values: torch.Tensor  # [1 + crops, 3, S, S] float32: the global view, then the crops
    attention_mask: torch.Tensor  # [1 + crops, S/patch, S/patch] float32 (1: image, 0: padding)
    image_size: tuple[int, int]  # (height, width) of the padded grid, in pixels
    num_tokens: int
    grid: tuple[int, int, int] = (1, 0, 0)  # (1, token rows, token cols): the layout's grid of the image


def to_rgb_uint8(image: Image.Image) -> torch.Tensor:
    """[3, H, W] uint8, contiguous, as the processor converts a PIL image (transparency composited onto
    white, as transformers' convert_to_rgb does since 5.2x; written out here because older releases'
    convert_to_rgb has no return_numpy and converts without compositing)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    array = np.array(image.convert("RGB"))
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _native_uint8_bilinear(device: torch.device) -> bool:
    """torchvision's rule for a native uint8 bilinear resize: on CPUs with AVX2 or AVX-512 only."""
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def resize_uint8_bilinear(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize(image, [height, width]) of a [3, H, W] uint8 tensor:
    bilinear, antialiased, align_corners=False; the same kernel torchvision calls, so the same bytes."""
    channels, old_h, old_w = image.shape
    if (height, width) == (old_h, old_w):
        return image
    batch = image.reshape(1, channels, old_h, old_w)
    if batch.is_contiguous(memory_format=torch.channels_last) and batch.numel() != batch.stride(0):
        # torchvision re-strides a channels-last 1CHW view so that interpolate keeps its memory format
        strides = list(batch.stride())
        strides[0] = batch.numel()
        batch = batch.as_strided(batch.shape, strides)
    native = _native_uint8_bilinear(image.device)
    x = batch if native else batch.to(torch.float32)
    x = torch.nn.functional.interpolate(x, size=[height, width], mode="bilinear", align_corners=False,
                                        antialias=True)
    if not native:
        x = x.round_().to(torch.uint8)
    return x.reshape(channels, height, width)


def resize_float_bicubic(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's resize of a [3, H, W] float32 tensor, bicubic, antialias=False (the global view)."""
    channels, old_h, old_w = image.shape
    if (height, width) == (old_h, old_w):
        return image
    out = torch.nn.functional.interpolate(image.reshape(1, channels, old_h, old_w), size=[height, width],
                                          mode="bicubic", align_corners=False, antialias=False)
    return out.reshape(channels, height, width)


def normalize(image: torch.Tensor, settings: PixelSettings) -> torch.Tensor:
    """The processor's fused rescale and normalise: (x - mean / r) / (std / r) in float32, r the rescale
    factor, its mean and std tensors made the same way (float32, then scaled)."""
    mean = torch.tensor(settings.image_mean, device=image.device) * (1.0 / settings.rescale_factor)
    std = torch.tensor(settings.image_std, device=image.device) * (1.0 / settings.rescale_factor)
    return image.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def crop_mask(geo: HDGeometry, settings: PixelSettings) -> torch.Tensor:
    """[crops, m, m] patch masks of the crops, row-major (the processor's mask, reshaped per crop)."""
    m = settings.mask_size
    full = torch.zeros(m * geo.h_crops, m * geo.w_crops)
    full[:geo.valid_patch_rows, :geo.valid_patch_cols] = 1
    return full.reshape(geo.h_crops, m, geo.w_crops, m).transpose(1, 2).reshape(-1, m, m).contiguous()


def hd_transform_uint8(image: torch.Tensor, settings: PixelSettings = PixelSettings()) -> Phi4Pixels:
    """The HD transform of a [3, H, W] uint8 RGB tensor (CPU or CUDA)."""
    _, height, width = image.shape
    s = settings.crop_size
    geo = hd_geometry(width, height, settings.dynamic_hd, s, settings.patch_size)
    resized = resize_uint8_bilinear(image, geo.resized_height, geo.resized_width)
    padded = torch.nn.functional.pad(resized, (0, geo.pad_width, 0, geo.pad_height), value=PAD_VALUE)
    hd = normalize(padded, settings)
    global_view = resize_float_bicubic(hd, s, s)
    crops = hd.reshape(3, geo.h_crops, s, geo.w_crops, s).permute(1, 3, 0, 2, 4).reshape(-1, 3, s, s)
    pixels = torch.cat([global_view.unsqueeze(0), crops], dim=0).contiguous()
    m = settings.mask_size
    mask = torch.cat([torch.ones(1, m, m), crop_mask(geo, settings)], dim=0).to(image.device)
    tokens = geo.token_rows * geo.token_cols + geo.token_rows + global_tokens(s, settings.patch_size)
    return Phi4Pixels(pixels, mask, (s * geo.h_crops, s * geo.w_crops), tokens,
                      (1, geo.token_rows, geo.token_cols))


def hd_transform(image: Image.Image, settings: PixelSettings = PixelSettings()) -> Phi4Pixels:
    """The HD transform of a PIL image, as Phi4MultimodalImageProcessor makes it on a CPU."""
    return hd_transform_uint8(to_rgb_uint8(image), settings)


def batch_pixels(items: list[Phi4Pixels]) -> dict[str, Any]:
    """Several images as the processor batches them: crops padded to the most any image has (zero pixels,
    all-ones masks), image_sizes [n, 2] int64, num_img_tokens a list."""
    most = max(item.pixel_values.shape[0] for item in items)
    pixels, masks = [], []
    for item in items:
        extra = most - item.pixel_values.shape[0]
        pv, am = item.pixel_values, item.attention_mask
        if extra:
            pv = torch.cat([pv, pv.new_zeros((extra, *pv.shape[1:]))])
            am = torch.cat([am, am.new_ones((extra, *am.shape[1:]))])
        pixels.append(pv)
        masks.append(am)
    return {"image_pixel_values": torch.stack(pixels), "image_attention_mask": torch.stack(masks),
            "image_sizes": torch.tensor([list(item.image_size) for item in items], dtype=torch.long),
            "num_img_tokens": [item.num_tokens for item in items]}
