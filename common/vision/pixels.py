"""The checkpoint's image processor as torch ops, so resize, crop and normalise run on the encoder's device.

Reproduces the CLIP/SigLIP-style processors LLaVA checkpoints ship (transformers' PIL backend):
RGB, a bicubic (or bilinear) resize to a shortest edge or to height x width, a center crop, a rescale
by 1/255 and a per-channel normalisation. The resize is `F.interpolate(..., antialias=True)`, PyTorch's
port of Pillow's resampling filter, in two separable passes (horizontal, then vertical) on float
pixels, each rounded and clipped to uint8 as Pillow's passes are. The rescale (in float64, then
float32) and the normalisation (float32) use the processor's own arithmetic.

Tolerance against the HF processor's pixel values, in uint8 levels (one level is `rescale / std` in
pixel values; 0.0146 for CLIP), tested in tests/encoder/test_pixels.py (CPU) and
tests/gpu/test_pixels_gpu.py (CUDA):
- no resampling (the image already has the processor's size, or needs only a crop): bit-identical;
- resampled: at most `MAX_LEVELS` on any pixel and `MAX_MEAN_LEVELS` on an image's mean. Pillow works
  in fixed point and, depending on the build and the shapes, does the vertical pass first for some
  shapes (Pillow 13.0 does: measured, not documented), so where a pass overshoots and is clipped
  (uniform noise, every pixel an edge) isolated pixels differ by up to ~24 levels; smooth images stay
  within a few levels (gradients: 2 for CLIP's shortest-edge resize, 8 for a square resize).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The stated bounds (module docstring); the worst measured: 24 levels on one pixel of resampled noise,
# 0.41 levels mean over an image.
MAX_LEVELS = 32
MAX_MEAN_LEVELS = 0.5

_MODES = {2: "bilinear", 3: "bicubic"}  # PILImageResampling values


class UnsupportedProcessorError(ValueError):
    """The image processor does something the torch reproduction does not (padding, other filters)."""


@dataclass(frozen=True)
class PixelRecipe:
    """What the processor does, read from it once."""

    shortest_edge: int | None
    resize_hw: tuple[int, int] | None
    crop_hw: tuple[int, int] | None
    mode: str
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None


def _get(processor, name: str, default=None):
    return getattr(processor, name, default)


def recipe_from_processor(processor) -> PixelRecipe:
    """The processor's steps, or UnsupportedProcessorError naming the one that cannot be reproduced."""
    for flag in ("do_pad", "do_image_splitting", "do_reduce_labels"):
        if _get(processor, flag):
            raise UnsupportedProcessorError(f"{type(processor).__name__} sets {flag}")
    if _get(processor, "image_grid_pinpoints"):
        raise UnsupportedProcessorError(f"{type(processor).__name__} tiles images (image_grid_pinpoints)")
    shortest = None
    resize_hw = None
    if _get(processor, "do_resize", True):
        size = _get(processor, "size")
        get = (lambda k: size.get(k)) if isinstance(size, dict) else (lambda k: getattr(size, k, None))
        if isinstance(size, int):
            shortest = size
        elif get("shortest_edge") and not get("longest_edge"):
            shortest = int(get("shortest_edge"))
        elif get("height") and get("width"):
            resize_hw = (int(get("height")), int(get("width")))
        else:
            raise UnsupportedProcessorError(f"resize to size={size!r}")
        resample = int(_get(processor, "resample", 3))
        if resample not in _MODES:
            raise UnsupportedProcessorError(f"resample={resample} (only bilinear and bicubic)")
        mode = _MODES[resample]
    else:
        mode = "bicubic"
    crop_hw = None
    if _get(processor, "do_center_crop", False):
        crop = _get(processor, "crop_size")
        get = (lambda k: crop.get(k)) if isinstance(crop, dict) else (lambda k: getattr(crop, k, None))
        crop_hw = (int(get("height")), int(get("width")))
    rescale = None
    if _get(processor, "do_rescale", True):
        rescale = float(_get(processor, "rescale_factor", 1 / 255))
    mean = std = None
    if _get(processor, "do_normalize", True):
        mean, std = _get(processor, "image_mean"), _get(processor, "image_std")
        mean = tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3
        std = tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3
    return PixelRecipe(shortest, resize_hw, crop_hw, mode, rescale, mean, std)


def pil_like_resize(batch: torch.Tensor, target: tuple[int, int], mode: str = "bicubic") -> torch.Tensor:
    """[n, 3, H, W] uint8 (or uint8-valued) to uint8-valued float32 [n, 3, *target], as Pillow resizes.

    Pillow resamples horizontally, rounds and clips to uint8, then vertically: the clip between the
    passes matters where bicubic overshoots (upscaled noise), so the passes are kept apart.
    """
    height, width = batch.shape[-2:]
    x = batch.float()
    if target[1] != width:
        x = F.interpolate(x, size=(height, target[1]), mode=mode, align_corners=False, antialias=True)
        x = x.round_().clamp_(0, 255)
    if target[0] != height:
        x = F.interpolate(x, size=tuple(target), mode=mode, align_corners=False, antialias=True)
        x = x.round_().clamp_(0, 255)
    return x


def _shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """transformers' get_resize_output_image_size(default_to_square=False): the short side to edge,
    the long side scaled and truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = edge, int(edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


class TorchPixelProcessor:
    """uint8 RGB images [3, H, W] (any device) to the processor's pixel values [B, 3, h, w] fp32."""

    def __init__(self, processor) -> None:
        self.recipe = recipe_from_processor(processor)
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def level(self) -> float:
        """One uint8 level in pixel values, for the channel where it is largest (rescale / min std)."""
        scale = self.recipe.rescale_factor or 1.0
        std = min(self.recipe.std) if self.recipe.std else 1.0
        return scale / std * (1 + 1e-5)

    def max_abs_diff(self) -> float:
        """The stated bound on |pixel value - HF processor's pixel value| for any pixel."""
        return MAX_LEVELS * self.level()

    def max_mean_abs_diff(self) -> float:
        """The stated bound on an image's mean |pixel value - HF processor's pixel value|."""
        return MAX_MEAN_LEVELS * self.level()

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) after resize and crop."""
        r = self.recipe
        if r.crop_hw:
            return r.crop_hw
        if r.resize_hw:
            return r.resize_hw
        if r.shortest_edge:
            return _shortest_edge_size(height, width, r.shortest_edge)
        return height, width

    def _resize(self, batch: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] uint8 of one size to uint8-valued float32, resized."""
        r = self.recipe
        height, width = batch.shape[-2:]
        if r.resize_hw:
            target = r.resize_hw
        elif r.shortest_edge:
            target = _shortest_edge_size(height, width, r.shortest_edge)
        else:
            target = (height, width)
        return pil_like_resize(batch, target, r.mode)

    @staticmethod
    def _crop(x: torch.Tensor, crop_hw: tuple[int, int]) -> torch.Tensor:
        height, width = x.shape[-2:]
        ch, cw = crop_hw
        if ch > height or cw > width:  # transformers pads a too-small image with zeros, centered
            top_pad, left_pad = (ch - height + 1) // 2, (cw - width + 1) // 2
            out = x.new_zeros((*x.shape[:-2], max(ch, height), max(cw, width)))
            out[..., top_pad:top_pad + height, left_pad:left_pad + width] = x
            x, height, width = out, out.shape[-2], out.shape[-1]
        top, left = (height - ch) // 2, (width - cw) // 2
        return x[..., top:top + ch, left:left + cw]

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        """Rescale (float64 product, then float32, as numpy does) and normalise (float32)."""
        r = self.recipe
        if r.rescale_factor is not None:
            x = (x.double() * r.rescale_factor).float()
        if r.mean is not None:
            mean, std = self._mean_std(x.device)
            x = (x - mean) / std
        return x

    def _mean_std(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """mean and std as float32 [1, 3, 1, 1] on device, made once (a host-to-device copy would wait
        for the stream's queued work)."""
        if device not in self._consts:
            mean = torch.tensor(np.asarray(self.recipe.mean, np.float32)).view(1, 3, 1, 1)
            std = torch.tensor(np.asarray(self.recipe.std, np.float32)).view(1, 3, 1, 1)
            self._consts[device] = (mean.to(device), std.to(device))
        return self._consts[device]

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor:
        """Pixel values for images (uint8 [3, H, W] each, all on one device), in input order.

        Images of one size are resized in one call, so a batch of same-sized images costs one kernel.
        """
        if not images:
            raise ValueError("no images")
        groups: dict[tuple[int, int], list[int]] = {}
        for i, img in enumerate(images):
            if img.dtype != torch.uint8 or img.dim() != 3 or img.shape[0] != 3:
                raise ValueError(f"image {i}: expected uint8 [3, H, W], got {img.dtype} {tuple(img.shape)}")
            groups.setdefault(tuple(img.shape[-2:]), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(images)
        for idxs in groups.values():
            x = self._resize(torch.stack([images[i] for i in idxs]))
            if self.recipe.crop_hw:
                x = self._crop(x, self.recipe.crop_hw)
            x = self._finish(x)
            for j, i in enumerate(idxs):
                out[i] = x[j]
        first = out[0].shape
        if any(t.shape != first for t in out):  # no crop and no fixed size: sizes differ
            raise ValueError("the processor gives images of different sizes; they cannot share a batch")
        return x if len(groups) == 1 else torch.stack(out)


def pick_pixel_processor(mode: str, device: torch.device, dtype: torch.dtype,
                         image_processor) -> TorchPixelProcessor | None:
    """The device-side reproduction of image_processor for a --preprocess mode, or None for HF's own:
    "hf" never, "torch" always (ValueError when the processor cannot be reproduced), "auto" on CUDA in
    half precision when it can be (fp32 keeps bit parity with HF's processor, the oracle tests' contract).
    """
    if mode == "hf" or (mode == "auto" and (device.type != "cuda" or dtype == torch.float32)):
        return None
    try:
        return TorchPixelProcessor(image_processor)
    except UnsupportedProcessorError as exc:
        if mode == "torch":
            raise ValueError(f"--preprocess torch cannot reproduce this image processor: {exc}") from None
        log.info("preprocessing with the HF image processor: %s", exc)
        return None


def to_uint8_hwc(image, pin_memory: bool = False) -> torch.Tensor:
    """A PIL image (or a DecodedImage of the encoder's decode pool, read in place) as a contiguous
    uint8 [H, W, 3] RGB tensor (one copy of its pixels). pin_memory puts it in page-locked memory, so
    that its copy to a GPU is asynchronous and does not wait for the tower's queued work."""
    if hasattr(image, "array"):  # DecodedImage: raw RGB bytes already, no PIL round trip
        arr = image.array()
    else:
        arr = np.asarray(image.convert("RGB") if image.mode != "RGB" else image)
    if not pin_memory:
        return torch.from_numpy(arr.copy())
    out = torch.empty(arr.shape, dtype=torch.uint8, pin_memory=True)
    out.numpy()[...] = arr
    return out


def to_uint8_chw(image) -> torch.Tensor:
    """A PIL image as a uint8 [3, H, W] RGB tensor (a channels-first view of `to_uint8_hwc`)."""
    return to_uint8_hwc(image).permute(2, 0, 1)
