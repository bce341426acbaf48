"""Qwen2-VL's image processor as torch ops, so the resize, normalisation and patching of an image run on
the encoder's device (the HF processor's host time on a large image is a TTFT stage of its own:
BENCHMARKS.md).

The steps are the PIL backend's: a bicubic resize to the grid's size (smart_resize, done by the caller),
rescale by 1/255 and normalise per channel, the frame repeated to the temporal patch size, then the
patch rows in the order the tower expects (each 2x2 merge block's patches contiguous). The resize is
common.vision.pixels.pil_like_resize, with the tolerance stated there; without resampling (an image
whose size is already on the 28-px grid) the rows equal the HF processor's.
"""

from __future__ import annotations

import numpy as np
import torch

from common.vision.pixels import MAX_LEVELS, MAX_MEAN_LEVELS, pil_like_resize


class QwenTorchPixels:
    """uint8 [3, H, W] images to Qwen2-VL patch rows [t*h*w, 3*temporal*patch*patch] (fp32)."""

    def __init__(self, image_processor) -> None:
        self.patch = int(image_processor.patch_size)
        self.temporal = int(image_processor.temporal_patch_size)
        self.merge = int(image_processor.merge_size)
        self.rescale = float(getattr(image_processor, "rescale_factor", 1 / 255))
        self.mean = tuple(float(x) for x in image_processor.image_mean)
        self.std = tuple(float(x) for x in image_processor.image_std)
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def max_abs_diff(self) -> float:
        """The bound on |pixel value - HF processor's| for any pixel (in normalised units)."""
        return MAX_LEVELS * self.rescale / min(self.std) * (1 + 1e-5)

    def max_mean_abs_diff(self) -> float:
        """The bound on an image's mean |pixel value - HF processor's|."""
        return MAX_MEAN_LEVELS * self.rescale / min(self.std) * (1 + 1e-5)

    def _mean_std(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._consts:
            mean = torch.tensor(np.asarray(self.mean, np.float32)).view(3, 1, 1)
            std = torch.tensor(np.asarray(self.std, np.float32)).view(3, 1, 1)
            self._consts[device] = (mean.to(device), std.to(device))
        return self._consts[device]

    def __call__(self, image: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Patch rows of one uint8 [3, H, W] image resized to its (t, h, w) grid (t must be 1)."""
        t, gh, gw = grid
        size = (gh * self.patch, gw * self.patch)
        x = pil_like_resize(image.unsqueeze(0), size)[0]
        x = (x.double() * self.rescale).float()  # numpy's float64 product, then float32, as HF does
        mean, std = self._mean_std(x.device)
        x = (x - mean) / std
        p, m, c = self.patch, self.merge, x.shape[0]
        frames = x.unsqueeze(0).expand(self.temporal * t, c, *size)  # an image repeats to fill a patch
        x = frames.reshape(t, self.temporal, c, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(t * gh * gw, c * self.temporal * p * p)
