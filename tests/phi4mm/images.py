"""The images the Phi-4-MM tests run: sizes chosen to reach every branch of the HD transform with the
tiny preset's dynamic_hd of 16 (one crop; several; portrait and landscape; padding under one patch and of
many; past dynamic_hd, where the aspect-ratio search picks the grid; a global view that is resized and
one that is not), plus an RGBA and a grayscale image for the RGB conversion."""

from __future__ import annotations

import numpy as np
from PIL import Image

SIZES = [(448, 448), (300, 200), (1000, 500), (97, 900), (455, 460), (2000, 700), (4000, 900), (1500, 1500)]


def noise_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Seeded noise over a smooth gradient (the same bytes in every process: PIL's effect_noise is not)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    ramp = np.linspace(0, 160, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    pixels = np.clip(ramp + rng.normal(0, 40, (height, width, channels)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


def sample_images() -> list[Image.Image]:
    """Noise images of SIZES, then an RGBA (partly transparent) and an L image."""
    out = [noise_image(w, h, i) for i, (w, h) in enumerate(SIZES)]
    return out + [noise_image(640, 360, 100, "RGBA"), noise_image(200, 520, 101, "L")]
